"""All embedding tables of one shard: registration, memory cap, BSP/ASP push and blocking pulls, membership
(silent workers evicted, rejoins admitted at the current version) and the state checkpoints hold."""
from __future__ import annotations

import logging
import threading
import time

import torch

from compression.server import all_finite
from deltaps.embedding import TableSpec
from deltaps.errors import NOT_LIVE_MEMBER, EmbeddingError
from ps.embedding.dynamic import DynamicTable
from ps.embedding.table import ShardTable, coalesce
from ps.reaper import reaper_tick, start_reaper
from ps.request_checks import check_world_size, unique_keys, wait_seconds

log = logging.getLogger("deltaps.embedding")
COUNTERS = ("pushes", "duplicates", "pulls", "rows_pulled", "rows_pushed", "rejected_exhausted", "bytes_received",
            "bytes_sent", "evictions", "rejoins", "rows_allocated_by_replay", "peeks")


class EmbeddingStore:
    """The embedding tables a shard holds; thread-safe (one lock + condition for all its tables)."""

    def __init__(self, shard_id: int, num_shards: int, memory_cap_bytes: int = 0, wait_timeout_s: float = 300.0,
                 worker_timeout_s: float = 0.0):
        self.shard_id, self.num_shards = shard_id, num_shards
        self.memory_cap_bytes = int(memory_cap_bytes or 0)
        self.wait_timeout_s = wait_timeout_s
        self.worker_timeout_s = worker_timeout_s   # > 0: evict live workers silent for longer than this
        self.cond = threading.Condition()
        self.tables: dict[str, ShardTable] = {}
        self.world_size = 0
        self.sync = "bsp"
        self.live: set[int] = set()
        self.last_seen: dict[int, float] = {}  # worker -> monotonic time of its last embedding RPC
        self.version = 0                      # steps fully applied
        self.pushed: dict[int, int] = {}      # worker -> next expected step
        self._agg: dict[int, dict] = {}       # worker -> {table: [(ids, grads)]} for the current step
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._reaper: threading.Thread | None = None

    # -- membership --
    def register(self, worker: int, world_size: int, num_shards: int, sync: str, specs: list[TableSpec]) -> int:
        if num_shards != self.num_shards:
            raise EmbeddingError("FAILED_PRECONDITION", f"worker {worker} expects {num_shards} shards, this server "
                                                        f"is shard {self.shard_id} of {self.num_shards}")
        check_world_size(world_size)
        if not 0 <= worker < world_size:
            raise EmbeddingError("INVALID_ARGUMENT", f"worker id {worker} outside world size {world_size}")
        unique_keys([s.name for s in specs], "a RegisterEmbedding", "table")
        if sync not in ("bsp", "asp"):
            raise EmbeddingError("INVALID_ARGUMENT", f"embedding tables support sync bsp or asp, not {sync!r}")
        for s in specs:
            try:
                s.validate()
            except ValueError as e:
                raise EmbeddingError("INVALID_ARGUMENT", str(e)) from None
        with self.cond:
            if self.world_size and (world_size, sync) != (self.world_size, self.sync):
                raise EmbeddingError("FAILED_PRECONDITION",
                                     f"worker {worker}: job is world {self.world_size} sync {self.sync}, "
                                     f"worker says world {world_size} sync {sync}")
            for s in specs:
                have = self.tables.get(s.name)
                if have is not None and have.spec != s:
                    raise EmbeddingError("FAILED_PRECONDITION", f"table {s.name}: worker {worker} registers "
                                                                f"{s}, shard holds {have.spec}")
            new = {s.name: self._new_table(s) for s in specs if s.name not in self.tables}   # first: may fail
            if not self.world_size:
                self.world_size, self.sync = world_size, sync
                self.live = set(range(world_size))
                self.pushed = {w: 0 for w in self.live}
                now = time.monotonic()
                self.last_seen = {w: now for w in self.live}   # not-yet-started workers get a full timeout
            self.tables.update(new)
            self._admit(worker)
            version = self.version
        self.start_reaper()
        return version

    def _new_table(self, spec: TableSpec) -> ShardTable:
        try:
            return (DynamicTable if spec.dynamic else ShardTable)(spec, self.shard_id, self.num_shards)
        except (RuntimeError, MemoryError) as e:      # a fixed table's row index is dense: num_rows / shards slots
            raise EmbeddingError("RESOURCE_EXHAUSTED", f"table {spec.name}: no memory for its row index "
                                                       f"({spec.num_rows} rows over {self.num_shards} shards): {e}") from None

    def _admit(self, worker: int) -> None:
        """(Re)join `worker` at the current version (cond held): its next step is at least the version."""
        self.pushed[worker] = max(self.pushed.get(worker, 0), self.version)
        self.last_seen[worker] = time.monotonic()
        if worker not in self.live:
            self.live.add(worker)
            self.counters["rejoins"] += 1
            log.warning("shard %d: worker %d (re)joined the embedding tables at step %d; live workers %s",
                        self.shard_id, worker, self.pushed[worker], sorted(self.live))

    def admit(self, worker: int) -> None:
        """Rejoin hook of the shard's membership (a dense Register re-admits the worker here too)."""
        with self.cond:
            if self.world_size and 0 <= worker < self.world_size:
                self._admit(worker)

    def evict(self, worker: int, reason: str = "") -> bool:
        """Drop a worker from the live set: a bsp step waiting only for it completes with the workers who
        pushed (mean over them, as the dense path); asp stops waiting for its clock."""
        with self.cond:
            if worker not in self.live:
                return False
            self.live.discard(worker)
            self.counters["evictions"] += 1
            if self.sync == "asp":
                if self.live:
                    self.version = max(self.version, min(self.pushed.get(w, 0) for w in self.live))
            else:
                self._maybe_complete()
            self.cond.notify_all()
        log.warning("shard %d: evicted worker %d from the embedding tables (%s); live workers now %s",
                    self.shard_id, worker, reason or "evicted", sorted(self.live))
        return True

    def evict_silent(self) -> list[int]:
        """Evict every live worker silent (no embedding RPC, none waiting) for longer than worker_timeout_s."""
        if self.worker_timeout_s <= 0:
            return []
        gone = []
        with self.cond:
            now = time.monotonic()
            for w in sorted(self.live):
                silent = now - self.last_seen.get(w, now)
                if silent > self.worker_timeout_s and self.evict(w, f"silent for {silent:.1f}s > --worker-timeout "
                                                                    f"{self.worker_timeout_s:g}s"):
                    gone.append(w)
        return gone

    def start_reaper(self) -> None:
        """Background thread running evict_silent() (no-op without a worker timeout)."""
        if self.worker_timeout_s <= 0 or self._reaper is not None:
            return
        self._reaper = start_reaper(f"shard{self.shard_id}-emb-reaper", reaper_tick(self.worker_timeout_s),
                                    self.evict_silent, log)

    def _wait(self, ready, timeout: float, worker: int, alive=None) -> bool:
        """cond.wait_for(ready, timeout), the waiting worker counting as alive meanwhile (cond held); a caller that
        went away (alive(): the RPC's is_active) ends the wait with CANCELLED."""
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.cond.wait(min(left, 0.5))
            if alive is not None and not alive():
                raise EmbeddingError("CANCELLED", "the waiting client went away")
            self.last_seen[worker] = time.monotonic()
        return True

    # -- pull --
    def pull(self, worker: int, requests: list[tuple[str, torch.Tensor]], min_version: int,
             timeout_s: float = 0.0, peek: bool = False, alive=None) -> tuple[list[torch.Tensor], int, float]:
        """Values of the requested rows (allocating missing ones), after the shard reached min_version. peek (an
        evaluation): the table is left as it is — missing rows are served their init value, nothing touched.
        Each table once per request (its missing rows are allocated once)."""
        t0 = time.perf_counter()
        timeout = wait_seconds(timeout_s, self.wait_timeout_s)
        unique_keys([name for name, _ in requests], "a pull", "table")
        with self.cond:
            self.last_seen[worker] = time.monotonic()
            tables = [self.table(name) for name, _ in requests]
            for t, (_, ids) in zip(tables, requests):
                t.check_ids(ids)
            if not self._wait(lambda: self.version >= min_version, timeout, worker, alive):
                raise EmbeddingError("DEADLINE_EXCEEDED", f"shard {self.shard_id}: embedding rows still at version "
                                                          f"{self.version} < {min_version} after {timeout:.1f}s")
            waited = time.perf_counter() - t0
            if peek:
                self.counters["peeks"] += 1
                return [t.peek(ids) for t, (_, ids) in zip(tables, requests)], self.version, waited
            self._allocate(tables, [ids for _, ids in requests], "pull")
            out = [t.gather(ids) for t, (_, ids) in zip(tables, requests)]
            self.counters["pulls"] += 1
            self.counters["rows_pulled"] += sum(ids.numel() for _, ids in requests)
            return out, self.version, waited

    def _allocate(self, tables: list[ShardTable], id_lists: list[torch.Tensor], what: str) -> int:
        """Allocate the rows among id_lists not held yet, within the memory cap (cond held); returns how many."""
        missing = [t.missing(ids) for t, ids in zip(tables, id_lists)]
        extra = sum(m.numel() * t.spec.bytes_per_row for t, m in zip(tables, missing))
        if extra and self.memory_cap_bytes and self.nbytes + extra > self.memory_cap_bytes:
            self.counters["rejected_exhausted"] += 1
            desc = ", ".join(f"{t.spec.name}: {t.rows} rows held + {m.numel()} new x {t.spec.bytes_per_row} B"
                             for t, m in zip(tables, missing))
            raise EmbeddingError("RESOURCE_EXHAUSTED",
                                 f"shard {self.shard_id}: embedding memory cap {self.memory_cap_bytes} B exceeded "
                                 f"(holds {self.nbytes} B, {what} needs {extra} B more; {desc}); add shards or "
                                 f"raise --embedding-memory-cap")
        for t, m in zip(tables, missing):
            t.allocate(m)
        return sum(m.numel() for m in missing)

    # -- push --
    def push(self, worker: int, step: int, grads: list[tuple[str, torch.Tensor, torch.Tensor]],
             replay: bool = False, alive=None) -> tuple[bool, int]:
        """grads: (table, ids, grad rows [n, dim]), each table once. Returns (duplicate, version after). A replay
        (re-sent after a shard restart) may name rows the restored shard does not hold: they are allocated (their
        initial value is a pure function of the row), within the memory cap."""
        unique_keys([name for name, _, _ in grads], "a push", "table")
        with self.cond:
            if worker not in self.live:
                raise EmbeddingError("FAILED_PRECONDITION", f"worker {worker} is not a live worker of this job "
                                                            f"(evicted or never registered; register to rejoin)",
                                     reason=NOT_LIVE_MEMBER)
            self.last_seen[worker] = time.monotonic()
            for name, ids, g in grads:
                t = self.table(name)
                t.check_ids(ids)
                if g.shape != (ids.numel(), t.spec.dim):
                    raise EmbeddingError("INVALID_ARGUMENT", f"table {name}: grad shape {tuple(g.shape)} != "
                                                             f"({ids.numel()}, {t.spec.dim})")
                if not all_finite(g):
                    raise EmbeddingError("INVALID_ARGUMENT", f"table {name}: non-finite gradient")
                # a dynamic table drops (and counts) gradients of rows it does not hold: filtered or evicted
                if not replay and not t.spec.dynamic and ids.numel() and bool((t.slots(ids) < 0).any()):
                    raise EmbeddingError("FAILED_PRECONDITION", f"table {name}: gradient for rows never pulled")
            if step < self.pushed.get(worker, 0):
                self.counters["duplicates"] += 1
                return True, self.version
            if self.sync == "asp":
                if replay:   # only a replay may name rows not held (a fixed table checked above)
                    self._allocate_replayed(grads)
                self.pushed[worker] = step + 1
                self._apply({name: [(ids, g)] for name, ids, g in grads}, 1.0 / self.world_size)
                self.version = min(self.pushed[w] for w in self.live) if self.live else self.version
                self._count(grads)
                self.cond.notify_all()
                return False, self.version
            # bsp: step s is aggregated once step s-1 is applied (a replay of s+1 never mixes into s)
            if not self._wait(lambda: self.version >= step or worker not in self.live, self.wait_timeout_s, worker,
                              alive):
                raise EmbeddingError("DEADLINE_EXCEEDED", f"shard {self.shard_id}: push of step {step} waited for "
                                                          f"version {step}, still {self.version}")
            if worker not in self.live:
                raise EmbeddingError("FAILED_PRECONDITION", f"worker {worker} was evicted while its push of step "
                                                            f"{step} waited", reason=NOT_LIVE_MEMBER)
            if self.version > step or step < self.pushed.get(worker, 0):   # applied already / a concurrent retry
                self.counters["duplicates"] += 1
                return True, self.version
            if replay:   # only a replay may name rows not held (a fixed table checked above)
                self._allocate_replayed(grads)
            self._agg[worker] = {}
            for name, ids, g in grads:
                self._agg[worker].setdefault(name, []).append((ids, g))
            self.pushed[worker] = step + 1
            self._count(grads)
            self._maybe_complete()
            return False, self.version

    def _allocate_replayed(self, grads) -> None:
        if grads:
            tables = [self.table(name) for name, _, _ in grads]
            self.counters["rows_allocated_by_replay"] += self._allocate(tables, [ids for _, ids, _ in grads], "replay")
            for t, (_, ids, _) in zip(tables, grads):
                if t.spec.dynamic:    # stands in for the pull the lost incarnation served (frequency filter)
                    t.count_unheld(ids)

    def _count(self, grads) -> None:
        self.counters["pushes"] += 1
        self.counters["rows_pushed"] += sum(ids.numel() for _, ids, _ in grads)

    def _maybe_complete(self) -> None:
        """bsp: once every live worker pushed, apply the mean over the workers who pushed (an evicted
        worker's push of this step counts, as in the dense path), in worker order (deterministic sums)."""
        if not self._agg or not self.live.issubset(self._agg):
            return
        merged: dict[str, list] = {}
        for w in sorted(self._agg):
            for name, parts in self._agg[w].items():
                merged.setdefault(name, []).extend(parts)
        self._apply(merged, 1.0 / len(self._agg))
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

    # -- state (checkpoints: ps/durability.py) --
    def state_dict(self) -> dict:
        """A consistent copy (under the store's lock; plain types + cloned tensors, weights_only safe): tables
        (rows held, values, optimizer state, step counters), version, the pushed table (exactly-once), the
        live set, the in-progress bsp aggregation, counters and the memory cap in force."""
        with self.cond:
            return {
                "shard_id": self.shard_id, "num_shards": self.num_shards, "memory_cap_bytes": self.memory_cap_bytes,
                "world_size": self.world_size, "sync": self.sync, "live": sorted(self.live), "version": self.version,
                "pushed": {int(w): int(s) for w, s in self.pushed.items()},
                "agg": {int(w): {name: [[ids.clone(), g.clone()] for ids, g in parts] for name, parts in tabs.items()}
                        for w, tabs in self._agg.items()},
                "counters": {k: int(v) for k, v in self.counters.items()},
                "tables": {name: t.state_dict() for name, t in self.tables.items()},
            }

    def load_state_dict(self, state: dict) -> None:
        """Load state_dict() output (same shard id and count). The memory cap in force stays this store's
        (the command line's): a restored store over it serves the rows it holds and refuses new ones. Every
        live worker gets a full worker timeout to come back. Nothing changes if it raises."""
        self.adopt_state(self.parse_state(state))

    def parse_state(self, state: dict) -> dict:
        """state_dict() output checked against this store and built into its objects; raises before the store
        changes (ps/durability.py restore parses the dense part and this one before adopting either)."""
        if (state["shard_id"], state["num_shards"]) != (self.shard_id, self.num_shards):
            raise ValueError(f"embedding checkpoint is of shard {state['shard_id']}/{state['num_shards']}, "
                             f"this server is {self.shard_id}/{self.num_shards}")
        return {"tables": {name: (DynamicTable if t["spec"].get("dynamic") else ShardTable).from_state_dict(
                               t, self.shard_id, self.num_shards) for name, t in state["tables"].items()},
                "world_size": int(state["world_size"]), "sync": str(state["sync"]),
                "live": {int(w) for w in state["live"]}, "version": int(state["version"]),
                "pushed": {int(w): int(s) for w, s in state["pushed"].items()},
                "agg": {int(w): {name: [(p[0], p[1]) for p in parts] for name, parts in tabs.items()}
                        for w, tabs in state["agg"].items()},
                "counters": {**dict.fromkeys(COUNTERS, 0), **{k: int(v) for k, v in state["counters"].items()}}}

    def adopt_state(self, parsed: dict) -> None:
        """Take what parse_state built (assignments only)."""
        with self.cond:
            self.tables, self.world_size, self.sync = parsed["tables"], parsed["world_size"], parsed["sync"]
            self.live, self.version, self.pushed = parsed["live"], parsed["version"], parsed["pushed"]
            self._agg, self.counters = parsed["agg"], parsed["counters"]
            now = time.monotonic()
            self.last_seen = {w: now for w in self.live}
            self.cond.notify_all()
        if self.world_size:
            self.start_reaper()
        if self.memory_cap_bytes and self.nbytes > self.memory_cap_bytes:
            log.warning("shard %d: restored embedding rows hold %d B, over --embedding-memory-cap %d B: rows held "
                        "are served, new rows refused", self.shard_id, self.nbytes, self.memory_cap_bytes)

    def stats(self) -> dict:
        with self.cond:
            return {"shard_id": self.shard_id, "version": self.version, "memory_cap_bytes": self.memory_cap_bytes,
                    "bytes": self.nbytes, "live_workers": sorted(self.live), **self.counters,
                    "tables": {n: t.stats() for n, t in self.tables.items()}}
