"""What a shard holds: the job it serves and the state of each key, each with its own state_dict.

state_dict() returns plain types and tensors only (torch.load(weights_only=True) safe); the shard composes
them into its own state_dict, which ps/durability.py writes as a checkpoint.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import asdict, dataclass, field

import torch

from deltaps.layout import Key
from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import resolve_pull_residual
from deltaps.sync import SyncMode, parse_sync
from ps.optimizer import KeyOptimizer
from ps.pull_views import PullView


@dataclass
class Job:
    world_size: int
    sync: SyncMode
    optimizer: OptimizerConfig
    digest: str
    codec: str
    pull_codec: str = "auto"         # as configured; Shard.pull_spec is the one in force
    min_workers: int = 0             # elastic: below this many live workers the job pauses (0: never pauses)
    max_workers: int = 0             # elastic: ids below this may join while the job runs (0: world_size)
    elastic: bool = False            # min/max given: joiners may report another world size, restores resize
    local_steps: int = 0             # local-update job: pushes are parameter deltas, `optimizer` the outer one

    def __post_init__(self):
        self.elastic = self.elastic or bool(self.min_workers or self.max_workers)
        self.min_workers = self.min_workers or 1
        self.max_workers = self.max_workers or self.world_size

    def drops_pull_residual(self, pull_spec: str) -> bool:
        """Each outer step starts from the pull view (deltaps/pull_codec.py resolve_pull_residual)."""
        return resolve_pull_residual(self.optimizer.pull_residual, pull_spec, self.local_steps > 0) == "drop"

    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "sync": str(self.sync), "optimizer": asdict(self.optimizer),
                "digest": self.digest, "codec": self.codec, "pull_codec": self.pull_codec,
                "min_workers": self.min_workers, "max_workers": self.max_workers, "elastic": self.elastic,
                "local_steps": self.local_steps}

    @classmethod
    def from_state_dict(cls, d: dict) -> "Job":
        return cls(d["world_size"], parse_sync(d["sync"]), OptimizerConfig(**d["optimizer"]), d["digest"], d["codec"],
                   d.get("pull_codec", "auto"), d.get("min_workers", 0), d.get("max_workers", 0),
                   d.get("elastic", False), d.get("local_steps", 0))


@dataclass
class KeyState:
    spec: Key
    value: torch.Tensor
    cond: threading.Condition = field(default_factory=threading.Condition)
    initialized: bool = False
    version: int = 0
    pushed: dict = field(default_factory=dict)      # worker -> steps pushed (next expected step)
    # quorum: worker -> the open round its last push landed in late (a replay of that push waits for it as well)
    landed: dict = field(default_factory=dict)
    agg: torch.Tensor | None = None                  # bsp: sum of this step's gradients
    agg_from: set = field(default_factory=set)
    agg_weight: float = 0.0                          # weights summed in agg (quorum: a worker may add two)
    opt: KeyOptimizer | None = None
    view: PullView | None = None                     # compressed-pull view (None: pulls send values)
    exact_since: int = -1                            # version at which the last view was dropped
    # the last full answer's values_digest, so N fresh workers cost one hash, not N (ps/pull_views.py digest_of)
    served_digest: tuple | None = None

    def pull_view(self, pull_spec: str, value: torch.Tensor | None = None) -> PullView | None:
        """A shared pull view of this key's value (or `value`): a matrix key's deltas compress as its rows; None for a
        buffer key (pulled exactly) or pull codec 'none'."""
        if pull_spec == "none" or self.spec.is_buffer:
            return None
        return PullView(pull_spec, self.value if value is None else value, self.spec.cols)

    def state_dict(self) -> dict:
        """A copy of everything that must survive a restart (the caller holds self.cond)."""
        s = self.spec
        return {"spec": [s.key, s.param, s.offset, s.numel, s.dtype, s.shard, s.role, s.cols],
                "value": self.value.clone(), "initialized": self.initialized, "version": self.version,
                "pushed": dict(self.pushed), "landed": dict(self.landed),
                "agg": None if self.agg is None else self.agg.clone(),
                "agg_from": sorted(self.agg_from), "agg_weight": self.agg_weight,
                "opt": copy.deepcopy(self.opt.state_dict()) if self.opt is not None else None,
                "view": self.view.view.clone() if self.view is not None else None, "exact_since": self.exact_since}

    @classmethod
    def from_state_dict(cls, d: dict, optimizer: OptimizerConfig | None, pull_spec: str) -> "KeyState":
        ks = cls(Key(*d["spec"]), d["value"].clone().to(torch.float32))
        ks.initialized, ks.version = d["initialized"], d["version"]
        ks.pushed = {int(w): int(n) for w, n in d["pushed"].items()}
        ks.landed = {int(w): int(r) for w, r in d.get("landed", {}).items()}   # older checkpoints have none
        ks.agg = None if d["agg"] is None else d["agg"].clone()
        ks.agg_from = set(d["agg_from"])
        ks.agg_weight = float(d.get("agg_weight", len(ks.agg_from)))
        if ks.initialized and not ks.spec.is_buffer:     # buffer keys have no optimizer (ps/buffers.py)
            ks.opt = KeyOptimizer(ks.value, optimizer)
            if d["opt"] is not None:
                ks.opt.load_state_dict(d["opt"])
        if d.get("view") is not None:
            ks.view = ks.pull_view(pull_spec, d["view"])
        ks.exact_since = d.get("exact_since", -1)
        return ks


def parse_shard_state(state: dict, shard_id: int, num_shards: int) -> dict:
    """A shard's state_dict() output, checked against this shard and built into the objects it holds; raises
    (ValueError, KeyError, TypeError, RuntimeError) before the shard changes, so a checkpoint that does not load
    leaves it as it was (ps/durability.py then tries the previous one)."""
    if (state["shard_id"], state["num_shards"]) != (shard_id, num_shards):
        raise ValueError(f"checkpoint is of shard {state['shard_id']}/{state['num_shards']}, "
                         f"this server is {shard_id}/{num_shards}")
    job = None if state["job"] is None else Job.from_state_dict(state["job"])
    pull_spec = str(state.get("pull_spec", "none"))
    opt = job.optimizer if job is not None else None
    return {"job": job, "codec": str(state["codec"]), "codec_epoch": int(state["codec_epoch"]), "pull_spec": pull_spec,
            "keys": {name: KeyState.from_state_dict(k, opt, pull_spec) for name, k in state["keys"].items()},
            "live": {int(w) for w in state["live"]},
            "counters": {k: int(v) for k, v in state["counters"].items()},
            "staleness": {int(k): int(v) for k, v in state["staleness"].items()},
            "beat_s": {int(w): float(s) for w, s in state.get("beat_s", {}).items()},       # older checkpoints: none
            "stopped": None if state.get("stopped") is None else dict(state["stopped"])}
