"""All embedding tables of one shard: registration, memory cap, BSP/ASP push and blocking pulls."""
from __future__ import annotations

import threading
import time

import torch

from compression.server import all_finite
from deltaps.embedding import TableSpec
from deltaps.errors import NOT_LIVE_MEMBER, EmbeddingError
from ps.embedding.table import ShardTable, coalesce


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
            tables = [self.table(name) for name, _ in requests]
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
                raise EmbeddingError("FAILED_PRECONDITION", f"worker {worker} is not a live worker of this job",
                                     reason=NOT_LIVE_MEMBER)
            for name, ids, g in grads:
                t = self.table(name)
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

    def table(self, name: str) -> ShardTable:
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
