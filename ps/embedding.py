"""Row-sparse embedding tables on a shard: lazily allocated rows, row-wise optimizers, BSP per step.

A table of `num_rows` x `dim` float32 rows is sharded by row id: row r lives on shard r % num_shards, at
local index r // num_shards. A shard allocates a row the first time a worker pulls it (its initial value
is a pure function of (seed, row, column), so lazy allocation on n shards gives exactly the values a dense
preallocated table would hold) and keeps its optimizer state next to it. A per-shard memory cap
(`deltaps server --embedding-memory-cap`) bounds values + optimizer state of all tables of the shard: a pull
that would allocate past it is refused with RESOURCE_EXHAUSTED naming table, shard, cap and row counts.

Optimizers (row-wise, only rows in the step's gradient are touched, state allocated per row):
  * sgd      p -= lr * g                                 (== torch.optim.SGD, no momentum / weight decay)
  * adagrad  s += g*g; p -= lr * g / (sqrt(s) + eps)      (== torch.optim.Adagrad, sparse or dense)
  * adam     lazy Adam, torch.optim.SparseAdam semantics: per-row m, v; one step counter per table
             (incremented every applied step); bias correction uses it.

Sync: bsp. A worker sends one SparsePush per shard per step (possibly empty: rows it did not touch count
as pushed with zero gradient); once every live worker pushed step t the shard coalesces the rows
(sum over workers of duplicate ids), divides by the number of workers (the mean gradient, as DDP
computes it for a dense table) and applies the optimizer once; the shard's version becomes t + 1.
SparsePull(min_version=t) blocks until then. `asp` applies every push on arrival (scaled by 1/W) and
never blocks pulls, as Persia does for its embedding PS; it is accepted but not what the bench uses.
"""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from compression.server import all_finite

from ps.shard import ShardError

OPTIMIZERS = ("sgd", "adagrad", "adam")
INITS = ("uniform", "zeros")
_STATE_TENSORS = {"sgd": 0, "adagrad": 1, "adam": 2}


class EmbeddingError(ShardError):
    """Refusal; `code` is a grpc.StatusCode name (a ShardError, so ps.server maps it to a status)."""


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int
    optimizer: str = "adagrad"
    lr: float = 0.01
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0
    init: str = "uniform"
    init_scale: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        if not self.name:
            raise ValueError("embedding table needs a name")
        if self.num_rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name}: num_rows and dim must be >= 1")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"table {self.name}: unknown optimizer {self.optimizer!r}; use {', '.join(OPTIMIZERS)}")
        if self.init not in INITS:
            raise ValueError(f"table {self.name}: unknown init {self.init!r}; use {', '.join(INITS)}")
        if not self.lr > 0:
            raise ValueError(f"table {self.name}: lr must be > 0")

    @property
    def bytes_per_row(self) -> int:
        return self.dim * 4 * (1 + _STATE_TENSORS[self.optimizer])

    @property
    def nbytes(self) -> int:
        """Values only (what a dense nn.Embedding of this size holds)."""
        return self.num_rows * self.dim * 4

    def to_proto(self, msg) -> None:
        for k, v in self.__dict__.items():
            setattr(msg, k, v)

    @classmethod
    def from_proto(cls, msg) -> "TableSpec":
        return cls(**{k: getattr(msg, k) for k in cls.__dataclass_fields__})


# ---- deterministic initialisation: a pure function of (seed, row, column) ---------------------------------
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def hash_uniform(ids, dim: int, seed: int, scale: float = 1.0, salt: int = 0) -> torch.Tensor:
    """float32 [len(ids), dim], uniform in [-scale, scale), identical for a row wherever it is computed."""
    ids = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        base = _mix(ids * _GOLD + np.uint64((seed * 1_000_003 + salt * 7_919 + 1) & 0xFFFFFFFFFFFFFFFF))
        cols = np.arange(dim, dtype=np.uint64) * _GOLD
        h = _mix(base[:, None] ^ cols[None, :])
    u = (h >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))   # [0, 1)
    return torch.from_numpy((u * np.float32(2 * scale) - np.float32(scale)).astype(np.float32))


def init_rows(spec: TableSpec, ids) -> torch.Tensor:
    if spec.init == "zeros":
        return torch.zeros(len(ids), spec.dim)
    return hash_uniform(ids, spec.dim, spec.seed, spec.init_scale)


def dense_init(spec: TableSpec, block: int = 1 << 16) -> torch.Tensor:
    """The whole table as one dense tensor (what an nn.Embedding in allreduce / ps mode starts from)."""
    out = torch.empty(spec.num_rows, spec.dim)
    for lo in range(0, spec.num_rows, block):
        hi = min(spec.num_rows, lo + block)
        out[lo:hi] = init_rows(spec, np.arange(lo, hi))
    return out


# ---- one table's rows on one shard -------------------------------------------------------------------------
class ShardTable:
    def __init__(self, spec: TableSpec, shard_id: int, num_shards: int):
        self.spec, self.shard_id, self.num_shards = spec, shard_id, num_shards
        self.local_rows = max(0, -(-(spec.num_rows - shard_id) // num_shards))
        self.slot_of = torch.full((self.local_rows,), -1, dtype=torch.int64)   # local index -> slot
        self.rows = 0                                   # allocated slots
        self.values = torch.empty(0, spec.dim)
        self.state = [torch.empty(0, spec.dim) for _ in range(_STATE_TENSORS[spec.optimizer])]
        self.opt_steps = 0                              # adam: SparseAdam's per-parameter step counter
        self.rows_applied = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.spec.bytes_per_row

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.num_rows:
            raise EmbeddingError("INVALID_ARGUMENT", f"table {self.spec.name}: row id out of range "
                                                     f"[0, {self.spec.num_rows}): min {lo}, max {hi}")
        if bool(((ids % self.num_shards) != self.shard_id).any()):
            raise EmbeddingError("INVALID_ARGUMENT", f"table {self.spec.name}: row ids not owned by shard "
                                                     f"{self.shard_id} (owner = id % {self.num_shards})")

    def missing(self, ids: torch.Tensor) -> torch.Tensor:
        """Unique ids among `ids` not allocated yet."""
        local = ids // self.num_shards
        return torch.unique(ids[self.slot_of[local] < 0])

    def allocate(self, new_ids: torch.Tensor) -> None:
        n = new_ids.numel()
        if n == 0:
            return
        need = self.rows + n
        if need > self.values.shape[0]:
            cap = max(need, min(self.local_rows, max(1024, self.values.shape[0] * 2)))
            self.values = _grow(self.values, cap)
            self.state = [_grow(s, cap) for s in self.state]
        slots = torch.arange(self.rows, need)
        self.values[self.rows:need] = init_rows(self.spec, new_ids.numpy())
        if self.spec.optimizer == "adagrad":
            self.state[0][self.rows:need] = self.spec.initial_accumulator
        else:
            for s in self.state:
                s[self.rows:need] = 0.0
        self.slot_of[new_ids // self.num_shards] = slots
        self.rows = need

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slot_of[ids // self.num_shards]

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return self.values.index_select(0, self.slots(ids))

    @torch.no_grad()
    def apply(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on the rows `ids` (unique, allocated) with gradient rows `grad`."""
        sp = self.spec
        if sp.optimizer == "adam":
            self.opt_steps += 1       # SparseAdam counts steps per table, even if this shard got no rows
        if ids.numel() == 0:
            return
        slots = self.slots(ids)
        p = self.values.index_select(0, slots)
        if sp.optimizer == "sgd":
            p.add_(grad, alpha=-sp.lr)
        elif sp.optimizer == "adagrad":
            s = self.state[0].index_select(0, slots).addcmul_(grad, grad)
            self.state[0].index_copy_(0, slots, s)
            p.addcdiv_(grad, s.sqrt().add_(sp.eps), value=-sp.lr)
        else:   # torch.optim.SparseAdam, operation for operation
            m_old, v_old = self.state[0].index_select(0, slots), self.state[1].index_select(0, slots)
            m_upd = grad.sub(m_old).mul_(1 - sp.beta1)
            v_upd = grad.pow(2).sub_(v_old).mul_(1 - sp.beta2)
            m = m_upd.add_(m_old)
            v = v_upd.add_(v_old)
            self.state[0].index_copy_(0, slots, m)
            self.state[1].index_copy_(0, slots, v)
            denom = v.sqrt().add_(sp.eps)
            step_size = sp.lr * math.sqrt(1 - sp.beta2 ** self.opt_steps) / (1 - sp.beta1 ** self.opt_steps)
            p.add_(m.div(denom).mul_(-step_size))
        self.values.index_copy_(0, slots, p)
        self.rows_applied += ids.numel()


def _grow(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.empty(rows, t.shape[1])
    out[:t.shape[0]] = t
    return out


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted) and the sum of their gradient rows."""
    if ids.numel() == 0:
        return ids, grads
    uniq, inv = torch.unique(ids, return_inverse=True)
    out = torch.zeros(uniq.numel(), grads.shape[1])
    out.index_add_(0, inv, grads)
    return uniq, out


# ---- all tables of one shard --------------------------------------------------------------------------------
class EmbeddingStore:
    """The embedding tables a shard holds; thread-safe (one lock + condition for all its tables)."""

    def __init__(self, shard_id: int, num_shards: int, memory_cap_bytes: int = 0, wait_timeout_s: float = 300.0):
        self.shard_id, self.num_shards = shard_id, num_shards
        self.memory_cap_bytes = int(memory_cap_bytes or 0)
        self.wait_timeout_s = wait_timeout_s
        self.cond = threading.Condition()
        self.tables: dict[str, ShardTable] = {}
        self.world_size = 0
        self.sync = "bsp"
        self.live: set[int] = set()
        self.version = 0                      # steps fully applied
        self.pushed: dict[int, int] = {}      # worker -> next expected step
        self._agg: dict[int, dict] = {}       # worker -> {table: (ids, grads)} for the current step
        self.counters = {"pushes": 0, "duplicates": 0, "pulls": 0, "rows_pulled": 0, "rows_pushed": 0,
                         "rejected_exhausted": 0, "bytes_received": 0, "bytes_sent": 0}

    # -- membership --
    def register(self, worker: int, world_size: int, num_shards: int, sync: str, specs: list[TableSpec]) -> int:
        if num_shards != self.num_shards:
            raise EmbeddingError("FAILED_PRECONDITION", f"worker {worker} expects {num_shards} shards, this server "
                                                        f"is shard {self.shard_id} of {self.num_shards}")
        if not 0 <= worker < world_size:
            raise EmbeddingError("INVALID_ARGUMENT", f"worker id {worker} outside world size {world_size}")
        if sync not in ("bsp", "asp"):
            raise EmbeddingError("INVALID_ARGUMENT", f"embedding tables support sync bsp or asp, not {sync!r}")
        for s in specs:
            try:
                s.validate()
            except ValueError as e:
                raise EmbeddingError("INVALID_ARGUMENT", str(e)) from None
        with self.cond:
            if not self.world_size:
                self.world_size, self.sync = world_size, sync
                self.live = set(range(world_size))
                self.pushed = {w: 0 for w in self.live}
            elif (world_size, sync) != (self.world_size, self.sync):
                raise EmbeddingError("FAILED_PRECONDITION",
                                     f"worker {worker}: job is world {self.world_size} sync {self.sync}, "
                                     f"worker says world {world_size} sync {sync}")
            for s in specs:
                have = self.tables.get(s.name)
                if have is None:
                    self.tables[s.name] = ShardTable(s, self.shard_id, self.num_shards)
                elif have.spec != s:
                    raise EmbeddingError("FAILED_PRECONDITION", f"table {s.name}: worker {worker} registers "
                                                                f"{s}, shard holds {have.spec}")
            return self.version

    def evict(self, worker: int) -> None:
        """Drop a worker from the live set; a step waiting only for it completes."""
        with self.cond:
            if worker in self.live:
                self.live.discard(worker)
                self._agg.pop(worker, None)
                self._maybe_complete()
                self.cond.notify_all()

    # -- pull --
    def pull(self, worker: int, requests: list[tuple[str, torch.Tensor]], min_version: int,
             timeout_s: float = 0.0) -> tuple[list[torch.Tensor], int, float]:
        """Values of the requested rows (allocating missing ones), after the shard reached min_version."""
        t0 = time.perf_counter()
        timeout = timeout_s if timeout_s > 0 else self.wait_timeout_s
        with self.cond:
            tables = [self._table(name) for name, _ in requests]
            for t, (_, ids) in zip(tables, requests):
                t.check_ids(ids)
            if not self.cond.wait_for(lambda: self.version >= min_version, timeout):
                raise EmbeddingError("DEADLINE_EXCEEDED", f"shard {self.shard_id}: embedding rows still at version "
                                                          f"{self.version} < {min_version} after {timeout:.1f}s")
            waited = time.perf_counter() - t0
            missing = [t.missing(ids) for t, (_, ids) in zip(tables, requests)]
            extra = sum(m.numel() * t.spec.bytes_per_row for t, m in zip(tables, missing))
            if self.memory_cap_bytes and self.nbytes + extra > self.memory_cap_bytes:
                self.counters["rejected_exhausted"] += 1
                desc = ", ".join(f"{t.spec.name}: {t.rows} rows held + {m.numel()} new x {t.spec.bytes_per_row} B"
                                 for t, m in zip(tables, missing))
                raise EmbeddingError("RESOURCE_EXHAUSTED",
                                     f"shard {self.shard_id}: embedding memory cap {self.memory_cap_bytes} B exceeded "
                                     f"(holds {self.nbytes} B, pull needs {extra} B more; {desc}); add shards or "
                                     f"raise --embedding-memory-cap")
            for t, m in zip(tables, missing):
                t.allocate(m)
            out = [t.gather(ids) for t, (_, ids) in zip(tables, requests)]
            self.counters["pulls"] += 1
            self.counters["rows_pulled"] += sum(ids.numel() for _, ids in requests)
            return out, self.version, waited

    # -- push --
    def push(self, worker: int, step: int, grads: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[bool, int]:
        """grads: (table, ids, grad rows [n, dim]). Returns (duplicate, version after)."""
        with self.cond:
            if worker not in self.live:
                raise EmbeddingError("FAILED_PRECONDITION", f"worker {worker} is not a live worker of this job")
            for name, ids, g in grads:
                t = self._table(name)
                t.check_ids(ids)
                if g.shape != (ids.numel(), t.spec.dim):
                    raise EmbeddingError("INVALID_ARGUMENT", f"table {name}: grad shape {tuple(g.shape)} != "
                                                             f"({ids.numel()}, {t.spec.dim})")
                if not all_finite(g):
                    raise EmbeddingError("INVALID_ARGUMENT", f"table {name}: non-finite gradient")
                if ids.numel() and bool((t.slots(ids) < 0).any()):
                    raise EmbeddingError("FAILED_PRECONDITION", f"table {name}: gradient for rows never pulled")
            if step < self.pushed.get(worker, 0) or (self.sync == "bsp" and worker in self._agg):
                self.counters["duplicates"] += 1
                return True, self.version
            if self.sync == "asp":
                self.pushed[worker] = step + 1
                self._apply({name: [(ids, g)] for name, ids, g in grads}, 1.0 / self.world_size)
                self.version = min(self.pushed[w] for w in self.live) if self.live else self.version
                self._count(grads)
                self.cond.notify_all()
                return False, self.version
            timeout = self.wait_timeout_s
            if not self.cond.wait_for(lambda: self.version >= step or worker not in self.live, timeout):
                raise EmbeddingError("DEADLINE_EXCEEDED", f"shard {self.shard_id}: push of step {step} waited for "
                                                          f"version {step}, still {self.version}")
            if self.version > step:       # applied already (a retry after the step completed)
                self.counters["duplicates"] += 1
                return True, self.version
            self._agg[worker] = {}
            for name, ids, g in grads:
                self._agg[worker].setdefault(name, []).append((ids, g))
            self.pushed[worker] = step + 1
            self._count(grads)
            self._maybe_complete()
            return False, self.version

    def _count(self, grads) -> None:
        self.counters["pushes"] += 1
        self.counters["rows_pushed"] += sum(ids.numel() for _, ids, _ in grads)

    def _maybe_complete(self) -> None:
        if not self.live or not self.live.issubset(self._agg):
            return
        merged: dict[str, list] = {}
        for w in self.live:
            for name, parts in self._agg[w].items():
                merged.setdefault(name, []).extend(parts)
        self._apply(merged, 1.0 / len(self.live))
        self._agg.clear()
        self.version += 1
        self.cond.notify_all()

    def _apply(self, merged: dict[str, list], scale: float) -> None:
        for name, t in self.tables.items():
            parts = merged.get(name, [])
            if parts:
                ids = torch.cat([p[0] for p in parts])
                g = torch.cat([p[1] for p in parts])
                ids, g = coalesce(ids, g)
                g.mul_(scale)
            else:
                ids, g = torch.empty(0, dtype=torch.int64), torch.empty(0, t.spec.dim)
            t.apply(ids, g)

    def _table(self, name: str) -> ShardTable:
        t = self.tables.get(name)
        if t is None:
            raise EmbeddingError("FAILED_PRECONDITION", f"unknown embedding table {name!r} on shard {self.shard_id} "
                                                        f"(RegisterEmbedding first)")
        return t

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def stats(self) -> dict:
        with self.cond:
            return {"shard_id": self.shard_id, "version": self.version, "memory_cap_bytes": self.memory_cap_bytes,
                    "bytes": self.nbytes, "live_workers": sorted(self.live), **self.counters,
                    "tables": {n: {"rows_held": t.rows, "rows_owned": t.local_rows, "bytes": t.nbytes,
                                   "optimizer": t.spec.optimizer, "rows_applied": t.rows_applied}
                               for n, t in self.tables.items()}}


# ---- wire helpers (shared with worker/embedding.py) --------------------------------------------------------
def ids_to_bytes(ids: torch.Tensor) -> bytes:
    return ids.to(torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes()


def ids_from_bytes(b: bytes) -> torch.Tensor:
    if len(b) % 8:
        raise EmbeddingError("INVALID_ARGUMENT", "row ids must be int64 (length a multiple of 8)")
    return torch.from_numpy(np.frombuffer(b, dtype="<i8").astype(np.int64))


def rows_to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to(torch.float32).contiguous().numpy().tobytes()


def rows_from_bytes(b: bytes, n: int, dim: int) -> torch.Tensor:
    if len(b) != n * dim * 4:
        raise EmbeddingError("INVALID_ARGUMENT", f"row values: {len(b)} bytes for {n} rows x {dim} float32")
    return torch.from_numpy(np.frombuffer(b, dtype=np.float32).copy()).view(n, dim)


def store_of(shard, memory_cap_bytes: int | None = None) -> EmbeddingStore:
    """The shard's EmbeddingStore, created on first use (unlimited unless attach() set a cap)."""
    store = getattr(shard, "embedding", None)
    if store is None:
        store = EmbeddingStore(shard.shard_id, shard.num_shards, memory_cap_bytes or 0, shard.wait_timeout_s)
        shard.embedding = store
    return store


def attach(shard, memory_cap_bytes: int = 0) -> EmbeddingStore:
    shard.embedding = EmbeddingStore(shard.shard_id, shard.num_shards, memory_cap_bytes, shard.wait_timeout_s)
    return shard.embedding


# ---- servicer bodies (ps/server.py keeps thin wrappers) ---------------------------------------------------
def handle_register(shard, req, pb):
    store = store_of(shard)
    version = store.register(req.worker_id, req.world_size, req.num_shards, req.sync or "bsp",
                             [TableSpec.from_proto(t) for t in req.tables])
    return pb.RegisterEmbeddingResponse(shard_id=shard.shard_id, version=version,
                                        memory_cap_bytes=store.memory_cap_bytes, server_id=shard.server_id)


def handle_pull(shard, req, pb):
    store = store_of(shard)
    reqs = [(r.table, ids_from_bytes(r.ids)) for r in req.rows]
    values, version, waited = store.pull(req.worker_id, reqs, req.min_version, req.timeout_s)
    rows = [pb.EmbeddingRows(table=r.table, values=rows_to_bytes(v)) for r, v in zip(req.rows, values)]
    store.counters["bytes_sent"] += sum(len(r.values) for r in rows)
    return pb.SparsePullResponse(rows=rows, version=version, waited_s=waited)


def handle_push(shard, req, pb):
    store = store_of(shard)
    grads = []
    for r in req.grads:
        ids = ids_from_bytes(r.ids)
        t = store._table(r.table)
        grads.append((r.table, ids, rows_from_bytes(r.values, ids.numel(), t.spec.dim)))
    store.counters["bytes_received"] += sum(len(r.ids) + len(r.values) for r in req.grads)
    dup, version = store.push(req.worker_id, req.step, grads)
    return pb.SparsePushResponse(duplicate=dup, version=version)


def handle_stats(shard, req, pb):
    return pb.EmbeddingStatsResponse(json=json.dumps(store_of(shard).stats()))
