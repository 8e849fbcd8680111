"""Checkpoint and resume of a DDP job that torchrun's elastic agent restarts (--ddp-checkpoint-dir; bench compare's
`ddp-elastic` modes): what a DDP user does so that a dead rank costs the steps since the last checkpoint and the
restart, not the whole job.

torchrun restarts every rank of the job when one dies (a new rendezvous round; ranks may move between nodes). Each
rank then loads the newest checkpoint — rank 0 writes one before the first step and every N steps after, atomically
(a temporary file renamed) — and resumes at its step: model and optimizer states, the data stream advanced to it,
and the training clock. The clock of a restarted job runs from the first incarnation's start (wall time, one host's
clock: the bench's ranks share it) less every evaluation carried in the checkpoint, so what the failure costs —
the steps since the checkpoint, the restart, the rendezvous, the start-up — counts. An evaluation after the
newest checkpoint is lost with the rest, and its time is then counted as training (a checkpoint follows the
evaluation of its step when N is a multiple of --eval-every: the default 16 with --eval-every 16).
"""
from __future__ import annotations

import os

import torch

FILE = "ddp-checkpoint.pt"


class ElasticCheckpoint:
    def __init__(self, directory: str, every: int, rank: int):
        if every < 1:
            raise ValueError(f"--ddp-checkpoint-every must be >= 1, got {every}")
        self.every, self.rank = every, rank
        self.path = os.path.join(directory, FILE)
        os.makedirs(directory, exist_ok=True)

    def load(self) -> dict | None:
        """The newest checkpoint, or None when the job starts afresh (no checkpoint yet)."""
        if not os.path.exists(self.path):
            return None
        return torch.load(self.path, map_location="cpu", weights_only=True)

    def save(self, step: int, model, optimizers, run) -> None:
        """Rank 0: the state after `step` steps and the run's clock (origin, evaluations so far)."""
        if self.rank != 0:
            return
        state = {"step": step, "model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                 **run.clock_state()}
        tmp = f"{self.path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.path)

    def due(self, done: int) -> bool:
        return done % self.every == 0


def restore(state: dict, model, optimizers) -> int:
    """Load a checkpoint's model and optimizer states; returns its step."""
    model.load_state_dict(state["model"])
    for opt, saved in zip(optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(saved)
    return int(state["step"])
