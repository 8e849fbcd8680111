import functools
import sys
import time
from pathlib import Path

import grpc
import torch

from deltaps.optimizer_config import OptimizerConfig
from protos import pb, rpc
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


# ---- real processes on loopback (tests/cluster) ----------------------------------------------------------
DELTAPS = [sys.executable, "-m", "deltaps"]
ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "demo.yaml")


@functools.cache
def _session_starter():
    """The test session's zygote, started on first use and stopped (its scratch directory removed) at exit."""
    import atexit
    import shutil
    import tempfile

    from deltaps.tools.zygote import Starter
    scratch = tempfile.mkdtemp(prefix="deltaps-tests-zygote-")
    try:
        starter = Starter(str(Path(scratch) / "zygote")).ready()
    except Exception as e:      # cached too: every later test fails with it instead of starting another zygote
        shutil.rmtree(scratch, ignore_errors=True)
        return e
    atexit.register(lambda: (starter.close(), shutil.rmtree(scratch, ignore_errors=True)))
    return starter


def session_zygote():
    """This session's zygote (deltaps/tools/zygote.py Zygote), or the error that kept it from starting."""
    starter = _session_starter()
    if isinstance(starter, Exception):
        raise starter
    return starter.zygote


def start_program(argv, log):
    """`deltaps <argv...>` with its output (and errors) to log, forked from this session's zygote (deltaps/tools/
    zygote.py: torch imported once, as `deltaps launch` and the bench start their programs — a fresh interpreter's
    imports cost a worker ~3 s of CPU); the child's cwd is ROOT. A real process: kill -9, exit codes as Popen's."""
    return session_zygote().spawn(argv, log, cwd=str(ROOT))


def server_proc(i, port, log, *flags):
    return start_program(["--log-level", "INFO", "server", "--port", str(port), "--shard-id", str(i), "--num-shards",
                          "2", *flags], log)


def start_shards(procs, *flags):
    """Two `deltaps server` processes on free loopback ports (procs: the test's Procs), up; their addresses."""
    from deltaps.tools.launch import free_port
    ports = [free_port(), free_port()]
    for i in range(2):
        procs.add(server_proc(i, ports[i], procs.log(f"server{i}"), *flags))
    addrs = [f"127.0.0.1:{p}" for p in ports]
    for a in addrs:
        wait_up(a)
    return addrs


def worker_proc(r, addrs, tmp, log, *flags, world=2):
    return start_program(["worker", "--servers", ",".join(addrs), "--rank", str(r), "--world-size", str(world),
                          "--config", CONFIG, "--no-progress", "--result-json", str(tmp / f"w{r}.json"), *flags], log)


def stats(addr):
    try:
        rep = rpc.ParameterServerStub(grpc.insecure_channel(addr)).Stats(pb.StatsRequest(), timeout=2)
    except grpc.RpcError:
        return None
    return rep if rep.num_keys else None


def wait_version(addr, v, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = stats(addr)
        if st is not None and st.min_version >= v:
            return st
        time.sleep(0.02)
    raise TimeoutError(f"{addr} did not reach version {v}")


def wait_up(addr, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            rpc.ParameterServerStub(grpc.insecure_channel(addr)).Stats(pb.StatsRequest(), timeout=1)
            return
        except grpc.RpcError:
            time.sleep(0.05)
    raise TimeoutError(addr)


class Procs:
    def __init__(self, tmp):
        self.tmp, self.all = tmp, []

    def log(self, name):
        return open(self.tmp / f"{name}.log", "a")

    def add(self, p):
        self.all.append(p)
        return p

    def cleanup(self):
        for p in self.all:      # every one killed before any is waited for: one that hangs leaks no other
            if p.poll() is None:
                p.kill()
        for p in self.all:
            p.wait(10)

    def tail(self):
        return "\n".join(f"--- {f.name}\n" + "".join(f.read_text().splitlines(True)[-15:])
                         for f in sorted(self.tmp.glob("*.log")))
