"""Key layout and message sizing: parameters -> chunk keys -> shards, gradient buckets, fused messages.

Deterministic, so every worker computes the same layout; the cost model (deltaps/tools/costmodel.py)
calls these same functions, so its predicted RPC counts follow the runtime by construction.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 4 << 20      # a key holds at most this many bytes
# A parameter larger than its fair share of a shard (total / shards) is cut into keys of that share, so one
# big weight cannot put most of the traffic on one shard's link (ps-lite slices key ranges across servers
# the same way); parameters under this size are never cut for balance (per-key overhead).
BALANCE_MIN_BYTES = 256 << 10
DEFAULT_BUCKET_BYTES = 25 << 20    # gradient fusion bucket, as DDP's bucket_cap_mb default
MESSAGE_HEADROOM = 1 << 20         # fused messages stay this far below the gRPC message limit

# What a key holds. A parameter's pushes are gradients for the server optimizer; a model buffer's (BatchNorm
# running statistics, any registered buffer) are the worker's current values, assigned, never optimised or
# compressed: the lowest-rank pusher's (DDP's broadcast_buffers) or the mean of the pushers'. Buffers always
# travel as float32 (integer buffers such as num_batches_tracked are exact up to 2**24).
PARAM = "param"
BUFFER_ROLES = {"broadcast": "buffer:broadcast", "average": "buffer:average"}
BUFFER_MODES = ("broadcast", "average", "local")   # local: buffers stay on each worker (not in the layout)


@dataclass(frozen=True)
class Key:
    key: str        # "<param>#<chunk>"
    param: str
    offset: int     # element offset inside the flattened parameter
    numel: int
    dtype: str
    shard: int
    role: str = PARAM   # PARAM or one of BUFFER_ROLES' values
    cols: int = 0       # > 0: a matrix key, whole rows of `cols` values (a matrix codec's; 0: flat)

    @property
    def is_buffer(self) -> bool:
        return self.role != PARAM


def itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[dtype]


def split_param(name: str, numel: int, dtype: str, chunk_bytes: int, cols: int = 0) -> list[tuple[str, int, int]]:
    """(key, offset, numel) chunks of at most chunk_bytes each; cols > 0: whole rows of cols values (one row at
    least)."""
    per = max(1, chunk_bytes // itemsize(dtype))
    if cols > 0:
        per = max(cols, per // cols * cols)
    n_chunks = max(1, -(-numel // per))
    return [(f"{name}#{i}", i * per, min(per, numel - i * per) if numel else 0) for i in range(n_chunks)]


def balanced_chunk_bytes(params: list[tuple[str, int, str]], num_shards: int, chunk_bytes: int) -> int:
    """The key size for params on num_shards: chunk_bytes, or less where a shard's fair share is smaller."""
    share = -(-sum(numel * itemsize(dtype) for _, numel, dtype in params) // max(1, num_shards))
    return min(chunk_bytes, max(BALANCE_MIN_BYTES, share))


def role_for_buffers(mode: str) -> str | None:
    """The key role of model buffers under DistributedOptimizer(buffers=mode); None for "local"."""
    if mode not in BUFFER_MODES:
        raise ValueError(f"buffer sync must be one of {', '.join(BUFFER_MODES)}, got {mode!r}")
    return BUFFER_ROLES.get(mode)


def matrix_cols(shape: tuple[int, ...]) -> int:
    """The columns of a parameter's matrix view (PowerSGD's: dim 0 by the rest); 0 for a 1-D one."""
    return 0 if len(shape) < 2 or not shape[0] else math.prod(shape) // shape[0]


def build_layout(params: list[tuple[str, int, str]], num_shards: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, buffers: list[tuple[str, int]] = (),
                 buffer_role: str = BUFFER_ROLES["broadcast"], cols: dict[str, int] | None = None,
                 balance_matrices: bool = False) -> list[Key]:
    """params: (name, numel, dtype) in model order; buffers: (name, numel) in model order, keys of role
    buffer_role after the parameters' (float32). Parameters are cut into keys of balanced_chunk_bytes; greedy
    size balancing: largest key first onto the least-loaded shard (ties: lowest shard id). Returns keys in
    model order. cols (a matrix codec's job): parameter -> its matrix view's columns (matrix_cols); such a
    parameter is cut at whole rows, at chunk_bytes only (a factor pair costs (rows + cols) x rank, so every cut pays
    for the columns again) or, balance_matrices, into balanced keys as a flat one."""
    cols = {name: c for name, c in (cols or {}).items() if c > 0}
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if buffers and buffer_role not in BUFFER_ROLES.values():
        raise ValueError(f"buffer_role must be one of {', '.join(BUFFER_ROLES.values())}, got {buffer_role!r}")
    entries = [(name, numel, dtype, PARAM) for name, numel, dtype in params]
    entries += [(name, numel, "float32", buffer_role) for name, numel in buffers]
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("parameter and buffer names must be unique")
    key_bytes = balanced_chunk_bytes(params, num_shards, chunk_bytes)
    chunks = [(k, name, off, n, dtype, role)
              for name, numel, dtype, role in entries
              for k, off, n in split_param(name, numel, dtype,
                                           chunk_bytes if role != PARAM or (name in cols and not balance_matrices)
                                           else key_bytes, cols.get(name, 0) if role == PARAM else 0)]
    load = [0] * num_shards
    shard_of: dict[str, int] = {}
    order = sorted(range(len(chunks)), key=lambda i: (-chunks[i][3] * itemsize(chunks[i][4]), i))
    for i in order:
        s = min(range(num_shards), key=lambda j: (load[j], j))
        shard_of[chunks[i][0]] = s
        load[s] += max(1, chunks[i][3] * itemsize(chunks[i][4]))
    return [Key(k, name, off, n, dtype, shard_of[k], role, cols.get(name, 0) if role == PARAM else 0)
            for k, name, off, n, dtype, role in chunks]


def layout_digest(layout: list[Key], num_shards: int) -> str:
    """sha256 of the layout; a buffer key's role and a matrix key's cols are part of it (flat parameter-only layouts
    digest as before)."""
    blob = json.dumps([num_shards] + [[k.key, k.offset, k.numel, k.dtype, k.shard] + ([k.role] if k.is_buffer else [])
                                      + ([{"cols": k.cols}] if k.cols else []) for k in layout])
    return hashlib.sha256(blob.encode()).hexdigest()


def shard_loads(layout: list[Key], num_shards: int) -> list[int]:
    load = [0] * num_shards
    for k in layout:
        load[k.shard] += k.numel * itemsize(k.dtype)
    return load


def check_message_limits(chunk_bytes: int, max_message_bytes: int) -> None:
    """A request carries up to two chunks of raw data, so a chunk must fit twice in a message."""
    if chunk_bytes * 2 > max_message_bytes:
        raise ValueError(f"chunk_bytes {chunk_bytes} too large for max message {max_message_bytes}")


def fused_message_bytes(chunk_bytes: int, max_message_bytes: int) -> int:
    """Raw bytes per fused PushPull message: 2 x chunk_bytes, less when the message limit is tight."""
    return max(chunk_bytes, min(2 * chunk_bytes, max_message_bytes - MESSAGE_HEADROOM))


def make_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """(name, gradient bytes) in model order -> names grouped in backward order (reverse of model order)
    into buckets of about bucket_bytes (a larger parameter is a bucket of its own); 0 = one per parameter."""
    buckets, size = [[]], 0
    for name, nbytes in reversed(sizes):
        if buckets[-1] and (bucket_bytes <= 0 or size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return [b for b in buckets if b]


def message_batches(keys: list[Key], limit: int):
    """Keys grouped into requests of at most `limit` bytes of raw fp32 data (a larger key goes alone)."""
    batch, size = [], 0
    for k in keys:
        nbytes = k.numel * 4
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(k)
        size += nbytes
    if batch:
        yield batch
