"""--eval-cache DIR: the ranks of one host evaluate a model once, however many of them hold it.

At a synced step every rank of a DDP, torchft or PS local-update job holds bit-identical parameters and scores them
on the same held-out data, so N ranks sharing a machine run the same evaluation N times (on lm, four ranks on this
repo's 2-core box: ~30 s of every race run's wall time, more than half of it redundant). With a cache directory the
first rank to evaluate a model stores the result under the digest of the model's state; the others wait on the same
lock — off their training clocks, where every evaluation is — and read it. A PS local-update rank evaluating the
global model mid-round finds the one it scored at the round's start. Models that differ (asp, quorum rounds,
per-rank state) have different digests and are evaluated each on its own, so results never mix.

Contract: the directory belongs to one job (the same workload, data, seed and split); results are JSON-able dicts,
read back exactly (floats round-trip through JSON). A rank killed mid-evaluation releases its lock with its process.
Only strategies whose evaluation is a function of the module's own state, computed by the rank alone, take it
(Strategy.evaluates_alone): not TorchRec (its tables are ShardedTensors, and its forward a collective a rank waiting
here would stall) nor hybrid (its tables live on the shards, outside the digest).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Callable

import torch
from torch import nn


def model_digest(model: nn.Module) -> str:
    """BLAKE2b of every entry of the model's state_dict (names, dtypes, shapes and bytes, in its order)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1).cpu().contiguous()
        h.update(f"{name}:{flat.dtype}:{tuple(t.shape)};".encode())
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


class SharedEvaluations:
    """evaluate(model) -> dict, each distinct model state evaluated once per directory (see the module docstring)."""

    def __init__(self, directory: str, evaluate: Callable[[nn.Module], dict]):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.evaluate = directory, evaluate

    def __call__(self, model: nn.Module) -> dict:
        path = os.path.join(self.directory, f"eval-{model_digest(model)}.json")
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)       # released by close(), or by the kernel if this rank dies
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
            evaluation = self.evaluate(model)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(evaluation, f)
            os.replace(tmp, path)                  # whole or absent: a reader never sees half a result
            return evaluation
