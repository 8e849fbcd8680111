"""The shard's shared pull view of one key (see deltaps/pull_codec.py for the protocol)."""
from __future__ import annotations

import torch

from compression import get_codec
from deltaps.pull_codec import DELTA, FULL, UNCHANGED


class PullView:
    """Shared view of one key plus the delta payload that produced its current version."""

    __slots__ = ("codec", "view", "delta", "delta_version", "cols")

    def __init__(self, spec: str, value: torch.Tensor, cols: int = 0):
        self.codec = get_codec(spec)
        self.view = value.clone()
        self.cols = cols            # > 0: a matrix key, its deltas compressed as (rows, cols) (a matrix codec's view)
        self.delta = None          # Payload taking the view from delta_version - 1 to delta_version
        self.delta_version = -1

    def publish(self, value: torch.Tensor, version: int) -> None:
        change = value - self.view
        payload = self.codec.compress(change.view(-1, self.cols) if self.cols else change)
        self.codec.accumulate(payload, self.view)       # view += decoded delta, block by block
        self.delta, self.delta_version = payload, version

    def serve(self, have: int, version: int):
        """(kind, tensor or payload) for a worker holding version `have` of this view."""
        if have == version:
            return UNCHANGED, None
        if have == version - 1 and self.delta_version == version:
            return DELTA, self.delta
        return FULL, self.view
