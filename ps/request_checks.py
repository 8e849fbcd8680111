"""What a request's keys must satisfy before anything in it is decoded or applied: a job, every key known to this
shard and named once, and each chunk's shape holding its key's elements. The shape is checked before the decode
because a payload's decoded size comes from it: a few bytes of factors (lowrank) can stand for gigabytes.
(shard.push checks the decoded count again: in-process callers hand it tensors, not chunks.)"""
from __future__ import annotations

import math

from deltaps.errors import ShardError


def unique_keys(keys: list[str], what: str) -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:     # a second copy would be dropped as a duplicate, or cloned once more per copy
            raise ShardError("INVALID_ARGUMENT", f"{what} names key {key!r} twice")
        seen.add(key)


def request_keys(shard, keys: list[str], what: str) -> list:
    """The KeyStates of a request's keys: the job registered, each key this shard's and named once."""
    shard.require_job()
    unique_keys(keys, what)
    return [shard.key_state(k) for k in keys]


def check_chunk_shapes(shard, chunks, what: str) -> None:
    """Each TensorChunk's shape holds exactly its key's elements (checked before anything is decoded)."""
    for c, ks in zip(chunks, request_keys(shard, [c.key for c in chunks], what)):
        shape = list(c.shape)
        n = math.prod(shape) if all(d >= 0 for d in shape) else -1
        if n != ks.spec.numel:
            raise ShardError("INVALID_ARGUMENT", f"key {c.key!r}: the chunk's shape {shape} holds {n} elements, the "
                                                 f"layout says {ks.spec.numel}")
