import torch

from deltaps.optimizer_config import OptimizerConfig
from worker.client import PSClient


def client(addrs, rank=0, world=1, sync="bsp", opt=None, **kw) -> PSClient:
    return PSClient(addrs, rank, world, sync=sync, optimizer=opt or OptimizerConfig("sgd", lr=0.1),
                    timeout_s=kw.pop("timeout_s", 20.0), **kw)


def named(seed=0, sizes=(("w", (40, 30)), ("b", (30,)))):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(*s, generator=g)) for n, s in sizes]


def walk_flags(parser, path=()):
    """(sub-command path, --flag) of every option of an argparse parser and its sub-parsers."""
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk_flags(sub, path + (name,))
        else:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    yield path, opt
