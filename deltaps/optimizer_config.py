"""Server-optimizer hyper-parameters: chosen by workers, carried in Register, applied by the shards."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # torch is imported where it is used: `deltaps ctl` (the rollback switch) starts without it
    import torch

SUPPORTED = ("sgd", "adam")
# local-update jobs with a lossy pull codec: what becomes of the part of an outer step the shared pull view did not
# carry (docs/local-updates.md#the-way-down-carry-or-drop): carry = it stays in the shard's model and goes down with
# later pulls; drop = the next outer step starts from the view, and the outer momentum carries its direction;
# auto = drop under a round codec's pull, else carry (deltaps/pull_codec.py resolve_pull_residual)
PULL_RESIDUALS = ("auto", "carry", "drop")


@dataclass
class OptimizerConfig:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    pull_residual: str = "auto"

    def validate(self) -> None:
        if self.name not in SUPPORTED:
            raise ValueError(f"unknown optimizer {self.name!r}; supported: {', '.join(SUPPORTED)}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"learning rate must be > 0 and finite, got {self.lr}")
        # torch.optim's own checks, here so that a job is refused at Register rather than at every Init
        for name in ("momentum", "dampening", "weight_decay", "eps"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"Adam's betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(f"Nesterov momentum needs a momentum > 0 and no dampening, got momentum {self.momentum}, "
                             f"dampening {self.dampening}")
        if self.pull_residual not in PULL_RESIDUALS:
            raise ValueError(f"pull residual must be one of {', '.join(PULL_RESIDUALS)}, got {self.pull_residual!r}")

    @classmethod
    def from_torch(cls, opt: torch.optim.Optimizer) -> "OptimizerConfig":
        """Take hyper-parameters from a local torch optimizer (the DistributedOptimizer wrapper does): a job that
        pushes gradients every step, whose steps keep everything a pull did not carry (pull_residual carry)."""
        import torch
        g = opt.param_groups[0]
        if isinstance(opt, torch.optim.Adam):
            b1, b2 = g["betas"]
            return cls("adam", lr=float(g["lr"]), beta1=b1, beta2=b2, eps=g["eps"],
                       weight_decay=g["weight_decay"], pull_residual="carry")
        if isinstance(opt, torch.optim.SGD):
            return cls("sgd", lr=float(g["lr"]), momentum=g["momentum"], dampening=g["dampening"],
                       nesterov=g["nesterov"], weight_decay=g["weight_decay"], pull_residual="carry")
        raise ValueError(f"server optimizer cannot mirror {type(opt).__name__}; use SGD or Adam")

    def to_proto(self, msg) -> None:
        for k, v in asdict(self).items():
            setattr(msg, k, v)

    @classmethod
    def from_proto(cls, msg) -> "OptimizerConfig":
        fields = {k: getattr(msg, k) for k in asdict(cls()).keys()}
        fields["pull_residual"] = fields["pull_residual"] or "auto"     # a client that does not set it
        return cls(**fields)


OUTER_OPTIMIZERS = ("avg", "sgd", "nesterov")
# Measured (docs/local-updates.md#choosing-the-outer-optimizer): on the clf race, 4 workers, Adam inner, Nesterov
# lr 0.9 / momentum 0.8 reaches 90 % in about the steps synchronous training needs (352-384 at H=8..32)
# where averaging needs 512-576 and DiLoCo's published 0.7 / 0.9 needs 384-416.
DEFAULT_OUTER = ("nesterov", 0.9, 0.8)


def outer_optimizer_config(name: str, lr: float = 1.0, momentum: float = 0.0,
                           pull_residual: str = "auto") -> OptimizerConfig:
    """The shards' optimizer of a local-update job, applied to the workers' mean parameter delta
    (anchor - local model): avg = SGD lr 1 (the new model is the mean of the local models), sgd = SGD with
    lr and heavy-ball momentum, nesterov = SGD with lr and Nesterov momentum (DiLoCo's outer optimizer);
    pull_residual: PULL_RESIDUALS."""
    if name == "avg":
        cfg = OptimizerConfig("sgd", lr=1.0)
    elif name == "sgd":
        cfg = OptimizerConfig("sgd", lr=lr, momentum=momentum)
    elif name == "nesterov":
        if not momentum > 0:
            raise ValueError(f"outer optimizer nesterov needs --outer-momentum > 0, got {momentum}")
        cfg = OptimizerConfig("sgd", lr=lr, momentum=momentum, nesterov=True)
    else:
        raise ValueError(f"unknown outer optimizer {name!r}; supported: {', '.join(OUTER_OPTIMIZERS)}")
    cfg.pull_residual = pull_residual
    cfg.validate()
    return cfg


def overlap_steps(local_steps: int, fragments: int, tau: int | None) -> int:
    """The inner steps a local-update exchange overlaps (--overlap-steps; None = the default: 1 with stream
    fragments where H >= 2F, else 0). Each must land before the next fragment's round starts (tau < H / F),
    so the workers are synced between exchanges, where evaluations of the global model happen."""
    limit = max(1, local_steps // max(1, fragments))
    resolved = (1 if fragments > 1 and limit > 1 else 0) if tau is None else tau
    if not 0 <= resolved < limit:
        raise ValueError(f"--overlap-steps must be between 0 and --local-steps / --stream-fragments - 1 "
                         f"({local_steps} / {fragments} - 1 = {limit - 1}), got {resolved}")
    return resolved
