"""One dynamic embedding table's rows on one shard: raw 64-bit ids, rows allocated on first touch, evicted by
TTL, admitted by a frequency filter.

Ids are any int64 >= 0 (hashed feature ids); the shard of id x is splitmix64(x) % num_shards
(deltaps.embedding.shard_of, which clients route with). Rows live in slots of growing value / optimizer
state tensors; a sorted index (numpy, vectorised lookups) maps raw id -> slot, and slots freed by eviction
are reused before the tensors grow, so a drifting id stream under a TTL holds memory flat.

Table steps are the optimizer steps applied (apply() calls: bsp, one per version). A pull or a push of a
row touches it at the current step; after each step a row untouched for more than `ttl_steps` steps is
evicted (its slot freed; a later touch starts it again from its deterministic init value).

Frequency filter (`min_count` > 1): an id is allocated on its min_count-th pull (each pull request naming
it counts once). Until then a pull returns its deterministic init value (the value the row will start
from, so admission causes no jump) and gradients pushed for it are dropped and counted (filtered_pushes).
The ids being counted are bounded: a count not bumped for `ttl_steps` steps is forgotten (with a TTL),
and at most MAX_PENDING counts are kept per table per shard (over it, the least recently seen are
forgotten down to 3/4 of it). Counts are not charged to the memory cap (about 24 B per id counted).

A push that names a row not held (filtered, or evicted since the pull under asp) is dropped and counted,
unless it is a replay after a restart: then it counts as the occurrence its lost pull was (pulls are not
replayed) and allocates the row if that admits it. A restore from a checkpoint taken between steps thus
replays exactly (every worker pushes the rows it pulled); one taken between a pull and its push counts
that pull twice, so such a row may be admitted one occurrence early.
"""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch

from deltaps.embedding import STATE_TENSORS, TableSpec, init_rows, shard_of
from deltaps.errors import EmbeddingError
from ps.embedding.table import ShardTable, peek_rows

INT64_MIN = -(1 << 63)
MAX_PENDING = 1 << 20
_EMPTY = np.empty(0, dtype=np.int64)

MIN_GROW_BYTES = 1 << 20      # a table's first growth: 1,024 rows, or as many as fit this (one row at least)


class DynamicTable(ShardTable):
    """Same interface as ShardTable (the store drives both); apply() also runs eviction."""

    max_pending = MAX_PENDING   # per instance in tests

    def __init__(self, spec: TableSpec, shard_id: int, num_shards: int):   # not ShardTable's: no id range
        self.spec, self.shard_id, self.num_shards = spec, shard_id, num_shards
        self.local_rows = None                          # unbounded
        self.keys, self.kslot = _EMPTY, _EMPTY          # sorted raw ids held, their slots
        self.free = _EMPTY                              # slots freed by eviction, reused first
        self.used = 0                                   # slots ever handed out (high-water mark)
        self.values = torch.empty(0, spec.dim)
        self.state = [torch.empty(0, spec.dim) for _ in range(STATE_TENSORS[spec.optimizer])]
        self.last = torch.empty(0, dtype=torch.int64)   # per slot: table step of its last touch
        self.pend_ids, self.pend_count, self.pend_seen = _EMPTY, _EMPTY, _EMPTY   # frequency filter
        self.steps = 0
        self.opt_steps = 0
        self.rows_applied = 0
        self.rows_evicted = self.filtered_pushes = self.filtered_pulls = 0

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    # -- state (checkpoints) --
    def state_dict(self) -> dict:
        """Rows in id order (ids, values, optimizer state, last touch), counters, step counters and the
        filter's pending counts: everything to resume exactly."""
        s = torch.from_numpy(self.kslot)
        return {"spec": asdict(self.spec), "ids": torch.from_numpy(self.keys.copy()),
                "values": self.values.index_select(0, s), "state": [t.index_select(0, s) for t in self.state],
                "last": self.last.index_select(0, s), "steps": self.steps, "opt_steps": self.opt_steps,
                "rows_applied": self.rows_applied, "rows_evicted": self.rows_evicted,
                "filtered_pushes": self.filtered_pushes, "filtered_pulls": self.filtered_pulls,
                "pending": [torch.from_numpy(a.copy()) for a in (self.pend_ids, self.pend_count, self.pend_seen)]}

    @classmethod
    def from_state_dict(cls, d: dict, shard_id: int, num_shards: int) -> "DynamicTable":
        t = cls(TableSpec(**d["spec"]), shard_id, num_shards)
        ids = d["ids"].to(torch.int64)
        n = ids.numel()
        if (d["values"].shape != (n, t.spec.dim) or len(d["state"]) != len(t.state) or d["last"].numel() != n
                or (n > 1 and not bool((ids[1:] > ids[:-1]).all()))):
            raise ValueError(f"table {t.spec.name}: checkpointed rows do not match its spec")
        t.check_ids(ids)
        t.keys, t.kslot, t.used = ids.numpy().copy(), np.arange(n, dtype=np.int64), n
        t.values, t.state = d["values"].clone(), [s.clone() for s in d["state"]]
        t.last = d["last"].to(torch.int64).clone()
        t.pend_ids, t.pend_count, t.pend_seen = (p.to(torch.int64).numpy().copy() for p in d["pending"])
        for k in ("steps", "opt_steps", "rows_applied", "rows_evicted", "filtered_pushes", "filtered_pulls"):
            setattr(t, k, int(d[k]))
        return t

    # -- ids --
    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        lo = int(ids.min())
        if lo < 0:
            why = " (the int64 NaN casts to)" if lo == INT64_MIN else ""
            raise EmbeddingError("INVALID_ARGUMENT", f"table {self.spec.name}: negative row id {lo}{why}; a "
                                                     f"dynamic table's ids are 0..2**63-1")
        if bool((shard_of(ids, self.num_shards, True) != self.shard_id).any()):
            raise EmbeddingError("INVALID_ARGUMENT", f"table {self.spec.name}: row ids not owned by shard "
                                                     f"{self.shard_id} (owner = splitmix64(id) % {self.num_shards})")

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._lookup(self.keys, self.kslot, ids.numpy()))

    @staticmethod
    def _lookup(keys: np.ndarray, vals: np.ndarray, q: np.ndarray) -> np.ndarray:
        """vals[i] where keys[i] == q (keys sorted), -1 where absent."""
        if len(keys) == 0:
            return np.full(len(q), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
        return np.where(keys[pos] == q, vals[pos], -1)

    def _counts(self, ids: np.ndarray) -> np.ndarray:
        c = self._lookup(self.pend_ids, self.pend_count, ids)
        return np.maximum(c, 0)

    def missing(self, ids: torch.Tensor) -> torch.Tensor:
        """Unique ids not held that this occurrence admits (pure: gather() records the occurrence)."""
        u = torch.unique(ids)
        new = u[self.slots(u) < 0]
        if self.spec.min_count > 1 and new.numel():
            new = new[torch.from_numpy(self._counts(new.numpy()) + 1 >= self.spec.min_count)]
        return new

    # -- rows --
    def allocate(self, new_ids: torch.Tensor) -> None:
        n = new_ids.numel()
        if n == 0:
            return
        new = np.sort(new_ids.numpy())
        reuse = self.free[-n:] if n <= len(self.free) else self.free
        self.free = self.free[:len(self.free) - len(reuse)]
        fresh = np.arange(self.used, self.used + n - len(reuse), dtype=np.int64)
        self.used += len(fresh)
        if self.used > self.capacity:
            # amortised doubling (at most 2**20 rows a step) from 1,024 rows, or fewer where they pass MIN_GROW_BYTES:
            # 1,024 rows held 512 MiB for one 64k-wide adagrad row, 8x a 64 MiB cap that charges rows held
            first = max(1, min(1024, MIN_GROW_BYTES // self.spec.bytes_per_row))
            self._grow(max(self.used, min(self.capacity * 2, self.capacity + (1 << 20)), first))
        slots = np.concatenate([reuse, fresh])
        st = torch.from_numpy(slots)
        self.values[st] = init_rows(self.spec, new)
        for i, s in enumerate(self.state):
            s[st] = self.spec.initial_accumulator if self.spec.optimizer == "adagrad" and i == 0 else 0.0
        self.last[st] = self.steps
        pos = np.searchsorted(self.keys, new)
        self.keys, self.kslot = np.insert(self.keys, pos, new), np.insert(self.kslot, pos, slots)
        if len(self.pend_ids):                          # admitted: no longer counted
            keep = self._lookup(new, new, self.pend_ids) < 0
            self.pend_ids, self.pend_count, self.pend_seen = (a[keep] for a in
                                                              (self.pend_ids, self.pend_count, self.pend_seen))

    def _grow(self, rows: int) -> None:
        def grow(t: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype)
            out[:t.shape[0]] = t
            return out
        self.values = grow(self.values, 0.0)
        self.state = [grow(s, 0.0) for s in self.state]
        self.last = grow(self.last, -1)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Values of `ids` (a pull): held rows are touched; ids not admitted yet get their init value and
        one more occurrence counted."""
        s = self.slots(ids)
        held = s >= 0
        if bool(held.all()):
            self.last[s] = self.steps
            return self.values.index_select(0, s)
        out = torch.empty(ids.numel(), self.spec.dim)
        out[held] = self.values.index_select(0, s[held])
        self.last[s[held]] = self.steps
        out[~held] = init_rows(self.spec, ids[~held].numpy())
        self.filtered_pulls += int((~held).sum())
        self._count(np.unique(ids[~held].numpy()))
        return out

    def peek(self, ids: torch.Tensor) -> torch.Tensor:
        """Values of `ids` for an evaluation: nothing touched, made or counted."""
        return peek_rows(self.spec, self.values, self.slots(ids), ids)

    def count_unheld(self, ids: torch.Tensor) -> None:
        """One occurrence of each id not held (a replayed push standing in for its lost pull)."""
        u = torch.unique(ids)
        u = u[self.slots(u) < 0]
        if u.numel() and self.spec.min_count > 1:
            self._count(u.numpy())

    def _count(self, ids: np.ndarray) -> None:
        """One more occurrence of each (unique, not held) id."""
        pos = self._lookup(self.pend_ids, np.arange(len(self.pend_ids), dtype=np.int64), ids)
        seen = pos >= 0
        self.pend_count[pos[seen]] += 1
        self.pend_seen[pos[seen]] = self.steps
        new = ids[~seen]
        if len(new):
            at = np.searchsorted(self.pend_ids, new)
            self.pend_ids = np.insert(self.pend_ids, at, new)
            self.pend_count = np.insert(self.pend_count, at, 1)
            self.pend_seen = np.insert(self.pend_seen, at, self.steps)
        if len(self.pend_ids) > self.max_pending:       # forget the least recently seen, with some slack
            keep = np.sort(np.argsort(-self.pend_seen, kind="stable")[:self.max_pending * 3 // 4])
            self.pend_ids, self.pend_count, self.pend_seen = (a[keep] for a in
                                                              (self.pend_ids, self.pend_count, self.pend_seen))

    @torch.no_grad()
    def apply(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on the held rows among `ids` (others dropped and counted), then eviction."""
        if ids.numel():
            s = self.slots(ids)
            held = s >= 0
            if not bool(held.all()):
                self.filtered_pushes += int((~held).sum())
                ids, grad, s = ids[held], grad[held], s[held]
            self.last[s] = self.steps
        super().apply(ids, grad)
        self.steps += 1
        self._evict()

    def _evict(self) -> None:
        ttl = self.spec.ttl_steps
        if ttl <= 0:
            return
        if len(self.keys):
            stale = (self.steps - self.last.numpy()[self.kslot]) > ttl
            if stale.any():
                gone = self.kslot[stale]
                self.free = np.concatenate([self.free, gone])
                self.last[torch.from_numpy(gone)] = -1
                self.keys, self.kslot = self.keys[~stale], self.kslot[~stale]
                self.rows_evicted += len(gone)
        if len(self.pend_ids):
            keep = (self.steps - self.pend_seen) <= ttl
            if not keep.all():
                self.pend_ids, self.pend_count, self.pend_seen = (a[keep] for a in
                                                                  (self.pend_ids, self.pend_count, self.pend_seen))

    def stats(self) -> dict:
        return {**super().stats(), "dynamic": True, "capacity": self.capacity, "steps": self.steps,
                "rows_evicted": self.rows_evicted, "filtered_pushes": self.filtered_pushes,
                "filtered_pulls": self.filtered_pulls, "pending_ids": len(self.pend_ids)}
