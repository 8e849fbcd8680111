"""Shard checkpoints: consistent snapshots of a Shard, restore, and the periodic/final checkpointer.

A snapshot is Shard.state_dict() (which composes Job.state_dict and KeyState.state_dict, ps/state.py):
parameters, optimizer state, versions, the per-(key, worker) pushed table (idempotency) and the rounds late
pushes landed in (a replay's realignment), any in-progress bsp aggregation, the pull views, codec + codec_epoch,
the live set and the counters, taken under the shard's locks; it is serialised after they are released. The
file format (atomic, checksummed, newest valid one wins) is ps/checkpoint.py.

Row-sparse embedding tables (ps/embedding/) are part of the snapshot too ("embedding": the store's
state_dict: rows held, optimizer state, version, pushed table, live set, in-progress bsp aggregation).

Durability feeds exactly-once across a crash: after each checkpoint the shard knows, per worker, the
step up to which that worker's pushes are in it (min over keys, and over the embedding tables, of
pushed[worker]); PushResponse and SparsePushResponse report it (durable_step) so clients can drop older
pushes from their replay buffers.
"""
from __future__ import annotations

import logging
import threading
import time

from ps.checkpoint import intact_checkpoints, write_checkpoint
from ps.embedding import store_of
from ps.shard import Shard
from ps.state import parse_shard_state

log = logging.getLogger("deltaps.durability")
FORMAT = 1


def snapshot(shard: Shard) -> dict:
    """A consistent, self-contained copy of the shard's state (plain types + tensors: weights_only safe)."""
    state = {"format": FORMAT, **shard.state_dict(), "saved_at": time.time()}
    store = _embedding(shard)
    if store is not None:
        state["embedding"] = store.state_dict()
    return state


def _embedding(shard: Shard):
    """The shard's embedding store once a job registered tables with it, else None."""
    store = getattr(shard, "embedding", None)
    return store if store is not None and store.world_size else None


def durable_steps(state: dict) -> dict[int, int]:
    """worker -> min over keys (and the embedding tables) of its pushed steps in this snapshot: its pushes
    below that are durable."""
    out: dict[int, int] = {}
    job = state["job"]
    if job is not None and state["keys"]:
        ids = range(max(job["world_size"], job.get("max_workers", 0)))   # elastic joiners push too
        out = {w: min(k["pushed"].get(w, 0) for k in state["keys"].values()) for w in ids}
    emb = state.get("embedding")
    if emb is not None and emb["world_size"]:
        for w in range(emb["world_size"]):
            step = emb["pushed"].get(w, 0)
            out[w] = min(out[w], step) if w in out else step
    return out


def min_version(state: dict) -> int:
    versions = [k["version"] for k in state["keys"].values()]
    emb = state.get("embedding")
    if emb is not None and emb["world_size"]:
        versions.append(emb["version"])
    return min(versions, default=0)


def progress_version(shard: Shard) -> int | None:
    """The shard's min version over its keys and embedding tables (None before any job)."""
    versions = [ks.version for ks in shard.keys.values()] if shard.job is not None else []
    store = _embedding(shard)
    if store is not None:
        versions.append(store.version)
    return min(versions) if versions else None


def restore(shard: Shard, state: dict) -> None:
    """Load a snapshot into a fresh shard (same shard id and count). The shard keeps its new server_id.
    Both parts (dense keys, embedding tables) are built before either is adopted: if it raises, nothing changed."""
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {state.get('format')!r} not supported (want {FORMAT})")
    parsed = parse_shard_state(state, shard.shard_id, shard.num_shards)
    store = None if state.get("embedding") is None else store_of(shard)   # the store attach() made keeps its cap
    parsed_embedding = None if store is None else store.parse_state(state["embedding"])
    shard.adopt_state(parsed)
    if store is not None:
        store.adopt_state(parsed_embedding)
    shard.durable_hist.clear()
    shard.durable_hist.append(durable_steps(state))
    shard.checkpoint_version = min_version(state)


def restore_latest(shard: Shard, directory: str) -> str | None:
    """Restore the newest checkpoint of this shard from `directory` that reads back intact and loads;
    corrupt/truncated ones, and ones that do not load (another format, another shard, missing fields), are
    skipped with an error log line. Returns the path used, or None when there is none."""
    for state, path in intact_checkpoints(directory, shard.shard_id):
        try:
            restore(shard, state)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
            log.error("skipping checkpoint %s: it does not load (%s: %s); trying the previous one", path,
                      type(e).__name__, e)
            continue
        store = _embedding(shard)
        log.warning("shard %d: restored from %s (min version %d, live workers %s%s)", shard.shard_id, path,
                    shard.checkpoint_version, sorted(shard.live),
                    "" if store is None else f"; embedding tables at version {store.version}, live workers "
                                             f"{sorted(store.live)}, {sum(t.rows for t in store.tables.values())} rows")
        return path
    log.warning("shard %d: no checkpoint in %s reads back and loads; starting empty", shard.shard_id, directory)
    return None


class Checkpointer:
    """Writes checkpoints every `every_steps` steps (by min key version) and/or every `every_s` seconds
    (only when something changed), and once more at stop() (SIGTERM)."""

    def __init__(self, shard: Shard, directory: str, every_steps: int = 0, every_s: float = 0.0, keep: int = 3):
        if keep < 2:
            raise ValueError("keep at least 2 checkpoints (a corrupt newest one falls back to the previous)")
        self.shard, self.directory = shard, directory
        self.every_steps, self.every_s, self.keep = every_steps, every_s, keep
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_version = shard.checkpoint_version
        self._last_t = time.monotonic()
        self._last_mark = None
        shard.checkpointing = True

    def _mark(self):
        c = self.shard.counters
        store = _embedding(self.shard)
        emb = None if store is None else (store.counters["pushes"], store.counters["evictions"],
                                          store.counters["rejoins"], store.version, len(store.live),
                                          sum(t.rows for t in store.tables.values()))
        return (c["pushes"], c["grads_applied"], c["evictions"], c["rejoins"], self.shard.codec_epoch,
                sum(ks.initialized for ks in self.shard.keys.values()), len(self.shard.live), emb)

    def checkpoint(self, reason: str = "manual") -> str | None:
        """Take a snapshot and write it; returns the file path (None before any job exists)."""
        with self._lock:
            if self.shard.job is None and _embedding(self.shard) is None:
                return None
            mark = self._mark()
            state = snapshot(self.shard)
            t0 = time.perf_counter()
            path = write_checkpoint(self.directory, self.shard.shard_id, state, keep=self.keep)
            self.shard.durable_hist.append(durable_steps(state))
            self.shard.checkpoint_version = self._last_version = min_version(state)
            self.shard.counters.add("checkpoints")
            self._last_t, self._last_mark = time.monotonic(), mark
            log.info("shard %d: checkpoint %s (%s, min version %d, %.0f ms)", self.shard.shard_id, path, reason,
                     self._last_version, (time.perf_counter() - t0) * 1e3)
            return path

    def due(self) -> str | None:
        """Why a checkpoint is due now, or None."""
        v = progress_version(self.shard)
        if v is None:
            return None
        if self.every_steps > 0:
            if v >= max(self._last_version, 0) + self.every_steps:
                return f"step {v}"
        if self.every_s > 0 and time.monotonic() - self._last_t >= self.every_s and self._mark() != self._last_mark:
            return f"{self.every_s:g}s elapsed"
        return None

    def start(self) -> None:
        if self.every_steps <= 0 and self.every_s <= 0:
            return

        def loop():
            while not self._stop.wait(0.02):
                try:
                    reason = self.due()
                    if reason:
                        self.checkpoint(reason)
                except Exception:  # noqa: BLE001 - keep serving; the next tick retries
                    log.exception("shard %d: checkpoint failed", self.shard.shard_id)
        self._thread = threading.Thread(target=loop, name=f"shard{self.shard.shard_id}-ckpt", daemon=True)
        self._thread.start()

    def stop(self, final: bool = True) -> str | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return self.checkpoint("final (shutdown)") if final else None
