"""The shard's shared pull view of one key (see deltaps/pull_codec.py for the protocol)."""
from __future__ import annotations

import weakref

import torch

from compression import get_codec
from deltaps.errors import ShardError
from deltaps.pull_codec import DELTA, DIGEST_BYTES, FULL, UNCHANGED, values_digest


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


def check_offers(nkeys: int, have_versions, have_digests) -> None:
    """A pull's per-key offers (PullRequest.have_versions / have_digests): INVALID_ARGUMENT naming what is wrong."""
    if have_versions and len(have_versions) != nkeys:
        raise ShardError("INVALID_ARGUMENT", "have_versions must have one entry per key")
    if have_digests and (not have_versions or len(have_digests) != nkeys):
        raise ShardError("INVALID_ARGUMENT", "have_digests needs have_versions and one entry per key")
    if have_digests and any(d and len(d) != DIGEST_BYTES for d in have_digests):
        raise ShardError("INVALID_ARGUMENT", f"have_digests: a digest is {DIGEST_BYTES} bytes (values_digest) or empty")


def answer_key(ks, have: int | None, digest: bytes = b""):
    """(kind, tensor or payload) answering one key of a pull (ks: its KeyState, under its lock). have None: a plain
    pull, the exact value; else the worker's view version (deltaps/pull_codec.py), and a digest of the values it
    holds, which spares sending a full value it already has."""
    if have is None:
        return FULL, ks.value.clone()
    if ks.view is not None:
        kind, obj = ks.view.serve(have, ks.version)
    elif have == ks.version and have > ks.exact_since:
        kind, obj = UNCHANGED, None
    else:
        kind, obj = FULL, ks.value
    if kind == FULL and digest and digest == digest_of(ks, obj):
        return UNCHANGED, None     # the worker holds these very bytes (built from the job's seed, as rank 0)
    return kind, (obj.clone() if kind == FULL else obj)


def digest_of(ks, values: torch.Tensor) -> bytes:
    """values_digest(values), remembered on the KeyState while the same tensor is unchanged: same key version and
    the same in-place version counter (torch bumps it on in-place writes; KeyOptimizer also after its fused step,
    whose kernels do not)."""
    memo = ks.served_digest
    if memo is None or memo[0]() is not values or memo[1:3] != (ks.version, values._version):
        memo = ks.served_digest = (weakref.ref(values), ks.version, values._version, values_digest(values))
    return memo[3]
