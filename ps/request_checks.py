"""What a request's keys must satisfy before anything in it is decoded or applied: a job, every key known to this
shard and named once, and each chunk's shape holding its key's elements. The shape is checked before the decode
because a payload's decoded size comes from it: a few bytes of factors (lowrank) can stand for gigabytes.
(shard.push checks the decoded count again: in-process callers hand it tensors, not chunks.)"""
from __future__ import annotations

import math

from deltaps.errors import ShardError

MAX_WORKERS = 1 << 16   # a job's world size / --max-workers: the live set and per-worker tables are sized by it


def unique_keys(keys: list[str], what: str, kind: str = "key") -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:     # a second copy would be dropped as a duplicate, or cloned once more per copy
            raise ShardError("INVALID_ARGUMENT", f"{what} names {kind} {key!r} twice")
        seen.add(key)


def check_world_size(world_size: int, max_workers: int = 0) -> None:
    if not 1 <= world_size <= MAX_WORKERS or not 0 <= max_workers <= MAX_WORKERS:
        raise ShardError("INVALID_ARGUMENT", f"world size {world_size} / --max-workers {max_workers}: want "
                                             f"1 .. {MAX_WORKERS} workers")


def wait_seconds(timeout_s: float, default_s: float) -> float:
    """How long a request may wait on the server: its own timeout_s if > 0 (finite), else the server's default."""
    if timeout_s > 0 and not math.isfinite(timeout_s):
        raise ShardError("INVALID_ARGUMENT", f"timeout_s must be a finite number of seconds, got {timeout_s}")
    return timeout_s if timeout_s > 0 else default_s


def request_keys(shard, keys: list[str], what: str) -> list:
    """The KeyStates of a request's keys: the job registered, each key this shard's and named once."""
    shard.require_job()
    unique_keys(keys, what)
    return [shard.key_state(k) for k in keys]


def check_chunk_shapes(shard, chunks) -> None:
    """Each TensorChunk's shape holds exactly its key's elements (checked before anything is decoded; a key named
    twice is the shard's push or init to refuse)."""
    shard.require_job()
    for c in chunks:
        ks = shard.key_state(c.key)
        shape = list(c.shape)
        n = math.prod(shape) if all(d >= 0 for d in shape) else -1
        if n != ks.spec.numel:
            raise ShardError("INVALID_ARGUMENT", f"key {c.key!r}: the chunk's shape {shape} holds {n} elements, the "
                                                 f"layout says {ks.spec.numel}")
