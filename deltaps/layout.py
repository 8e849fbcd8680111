"""Key layout and message sizing: parameters -> chunk keys -> shards, gradient buckets, fused messages.

Deterministic, so every worker computes the same layout; the cost model (deltaps/tools/costmodel.py)
calls these same functions, so its predicted RPC counts follow the runtime by construction.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from typing import Callable

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


# keys=balanced stops cutting once the busiest shard carries at most this x the mean: a big model's keys at the key
# size already spread that evenly (a 70B one's 75k keys: the search took minutes in every worker's setup for 0.001 %)
BALANCED_WITHIN = 1.01
# what a key costs on the wire each way: its shape ((rows, cols) for a matrix key, (numel,) for a flat one) -> bytes
# (None: unknown, the raw bytes count); the matrix codec's Codec.shaped_wire_nbytes, asked for the shape only: a
# lowrank body does not depend on the parameter's dtype (its factors' codes and float32 scales)
WireCost = Callable[[tuple[int, ...]], "int | None"]


def build_layout(params: list[tuple[str, int, str]], num_shards: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, buffers: list[tuple[str, int]] = (),
                 buffer_role: str = BUFFER_ROLES["broadcast"], cols: dict[str, int] | None = None,
                 wire_cost: WireCost | None = None) -> list[Key]:
    """params: (name, numel, dtype) in model order; buffers: (name, numel) in model order, keys of role
    buffer_role after the parameters' (float32). Parameters are cut into keys of balanced_chunk_bytes; greedy
    size balancing: largest key first onto the least-loaded shard (ties: lowest shard id). Returns keys in
    model order. cols (a matrix codec's job): parameter -> its matrix view's columns (matrix_cols); such a
    parameter is cut at whole rows, at chunk_bytes only (a factor pair costs (rows + cols) x rank, so every cut pays
    for the columns again) or, given the codec's wire_cost (keys=balanced), into the row blocks that balance the
    shards' links by the bytes the codec sends (balanced_row_blocks)."""
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
    matrices = {name: (numel, dtype) for name, numel, dtype, role in entries if role == PARAM and name in cols}
    matrix_key_bytes = ({name: chunk_bytes for name in matrices} if wire_cost is None else
                        balanced_row_blocks(matrices, cols, entries, num_shards, chunk_bytes, key_bytes, wire_cost))
    chunks = _cut(entries, cols, chunk_bytes, key_bytes, matrix_key_bytes)
    costs = [_chunk_cost(c, cols, wire_cost) for c in chunks]
    shard_of = dict(zip((c[0] for c in chunks), _spread(costs, num_shards)))
    return [Key(k, name, off, n, dtype, shard_of[k], role, cols.get(name, 0) if role == PARAM else 0)
            for k, name, off, n, dtype, role in chunks]


def _cut(entries, cols: dict[str, int], chunk_bytes: int, key_bytes: int,
         matrix_key_bytes: dict[str, int]) -> list[tuple]:
    """(key, param, offset, numel, dtype, role) of every key: a matrix in keys of matrix_key_bytes[name], another
    parameter in keys of key_bytes, a buffer in keys of chunk_bytes."""
    return [(k, name, off, n, dtype, role)
            for name, numel, dtype, role in entries
            for k, off, n in split_param(name, numel, dtype,
                                         chunk_bytes if role != PARAM else matrix_key_bytes.get(name, key_bytes),
                                         cols.get(name, 0) if role == PARAM else 0)]


def _chunk_cost(chunk, cols: dict[str, int], wire_cost: WireCost | None) -> int:
    _, name, _, n, dtype, role = chunk
    raw = n * itemsize(dtype)
    if wire_cost is None or role != PARAM:       # buffers always travel as float32
        return max(1, raw)
    c = cols.get(name, 0)
    cost = wire_cost((n // c, c) if c else (n,))
    return max(1, raw if cost is None else cost)


def _spread(costs: list[int], num_shards: int) -> list[int]:
    """Each chunk's shard: largest first onto the least-loaded shard (ties: lowest id, then model order)."""
    loads = [(0, j) for j in range(num_shards)]       # a heap of (load, shard id)
    shard = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, s = heapq.heappop(loads)
        shard[i] = s
        heapq.heappush(loads, (load + costs[i], s))
    return shard


def balanced_row_blocks(matrices: dict[str, tuple[int, str]], cols: dict[str, int], entries, num_shards: int,
                        chunk_bytes: int, key_bytes: int, wire_cost: WireCost) -> dict[str, int]:
    """Key bytes per matrix (whole rows) that balance the links by what the codec sends. Cutting a matrix costs
    bytes — each row block's factor pair pays for the columns again — so the row blocks are chosen, not the raw
    fair share: from the cut at chunk_bytes, the matrix with a block on the busiest shard is cut into one block
    more (equal rows) while that lowers the busiest shard's bytes (every worker sends each shard its keys, so that
    shard's link is the round's slowest) or, at the same, the number of shards that carry them, ties to the fewer
    bytes in all; so the busiest shard never carries more than under the cut at chunk_bytes. Independent of the
    worker count, so a joiner computes the same layout. (The raw fair share cut clf's 768 x 768 weight into four
    at rank 32 and left the shard that also held the 768 x 64 weight twice the others' bytes.)"""
    def rows_of(name):
        return matrices[name][0] // cols[name]

    def row_bytes(name):
        return cols[name] * itemsize(matrices[name][1])

    entry_costs: dict[tuple[str, int | None], list[int]] = {}    # (param, rows per key) -> its keys' bytes

    def costs_of(entry, per_rows):
        name = entry[0]
        rows = per_rows.get(name)
        if (name, rows) not in entry_costs:
            cut = {name: rows * row_bytes(name)} if rows else {}
            entry_costs[name, rows] = [_chunk_cost(c, cols, wire_cost)
                                       for c in _cut([entry], cols, chunk_bytes, key_bytes, cut)]
        return entry_costs[name, rows]

    def plan(per_rows):
        costs, owners = [], []
        for entry in entries:
            entry_cost = costs_of(entry, per_rows)
            costs += entry_cost
            owners += [entry[0]] * len(entry_cost)
        shards = _spread(costs, num_shards)
        load = [0] * num_shards
        for s, c in zip(shards, costs):
            load[s] += c
        busiest = max(range(num_shards), key=lambda j: (load[j], -j))
        on_busiest = sorted({owners[i] for i, s in enumerate(shards) if s == busiest and owners[i] in per_rows})
        return (load[busiest], load.count(load[busiest]), sum(costs)), on_busiest

    per = {name: max(1, chunk_bytes // row_bytes(name)) for name in matrices}      # rows per key at chunk_bytes
    most = {name: num_shards * -(-rows_of(name) // per[name]) for name in matrices}
    best, candidates = plan(per)
    while best[0] > BALANCED_WITHIN * best[2] / num_shards:
        trials = []
        for name in candidates:
            # one block more, or one row less where that leaves the block count as it is (small blocks)
            finer = min(-(-rows_of(name) // (-(-rows_of(name) // per[name]) + 1)), per[name] - 1)
            if finer >= 1 and -(-rows_of(name) // finer) <= most[name]:
                trials.append((plan({**per, name: finer})[0], name, finer))
        if not trials or min(trials)[0] >= best:
            break
        _, name, finer = min(trials)
        per[name] = finer
        best, candidates = plan(per)
    return {name: r * row_bytes(name) for name, r in per.items()}


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
