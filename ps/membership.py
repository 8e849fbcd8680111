"""Shard membership: who is live, joins and rejoins, eviction of silent workers (a mixin of ps.shard.Shard).

Kept apart from the push/pull path: it only touches the live set, the per-key pushed tables when a
worker (re)joins, and wakes waiters when a worker leaves.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from deltaps.errors import ShardError

log = logging.getLogger("deltaps.shard")


class Membership:
    """Needs from the shard: lock, keys, live, job, last_seen, counters, worker_timeout_s, _barriers,
    _barrier_cond, _reaper, checkpointing, durable_hist, shard_id, and the step-completion hooks
    _maybe_complete_step / _publish."""

    # ---- elastic membership ------------------------------------------------------------------
    @contextlib.contextmanager
    def _all_keys_locked(self):
        """Stop the world: every key's lock, in sorted key order (callers hold self.lock first)."""
        with contextlib.ExitStack() as stack:
            for name in sorted(self.keys):
                stack.enter_context(self.keys[name].cond)
            yield

    def _admit(self, worker: int) -> None:
        """(Re)join `worker` at the current version (self.lock held). Its pushed count on each key becomes
        at least the key's version, so it is never "behind" and its next step is worker_step()."""
        with self._all_keys_locked():
            for ks in self.keys.values():
                ks.pushed[worker] = max(ks.pushed.get(worker, 0), ks.version)
            if worker not in self.live:
                self.live.add(worker)
                self.counters["rejoins"] += 1
                log.warning("shard %d: worker %d (re)joined the job at step %d; live workers %s", self.shard_id,
                            worker, self.worker_step(worker), sorted(self.live))

    def worker_step(self, worker: int) -> int:
        """The step this worker pushes next on this shard (min over keys); a (re)joining worker starts here."""
        return min((ks.pushed.get(worker, 0) for ks in self.keys.values()), default=0)

    def durable_step(self, worker: int) -> int:
        """Steps of `worker` contained in the older of the two newest checkpoints (-1: no checkpointing).
        Keeping pushes back to the older one lets a restart survive one corrupt newest checkpoint."""
        if not self.checkpointing:
            return -1
        if not self.durable_hist:
            return 0
        return self.durable_hist[0].get(worker, 0)

    def touch(self, worker: int) -> None:
        if self.job is not None and 0 <= worker < self.job.world_size:
            self.last_seen[worker] = time.monotonic()

    def evict(self, worker: int, reason: str = "") -> bool:
        """Remove `worker` from the live set: bsp steps waiting only on it complete with the workers who
        pushed (mean over them), ssp/asp clocks stop waiting for it, barriers stop counting it."""
        with self.lock:
            if worker not in self.live:
                return False
            with self._all_keys_locked():
                self.live.discard(worker)
                for ks in self.keys.values():
                    if not ks.initialized:
                        continue
                    if self.job.sync.kind == "bsp":
                        self._maybe_complete_step(ks)
                    elif self.live:
                        version = min(ks.pushed.get(w, 0) for w in self.live)
                        if version > ks.version:
                            ks.version = version
                            self._publish(ks)
                    ks.cond.notify_all()
            self.counters["evictions"] += 1
        log.warning("shard %d: evicted worker %d (%s); live workers now %s", self.shard_id, worker, reason,
                    sorted(self.live))
        with self._barrier_cond:
            for b in self._barriers.values():
                if b["arrived"] and self.live <= b["arrived"]:
                    b["gen"] += 1
                    b["arrived"] = set()
            self._barrier_cond.notify_all()
        return True

    def evict_silent(self) -> list[int]:
        """Evict every live worker silent (no RPC, no waiting RPC) for longer than worker_timeout_s."""
        if self.worker_timeout_s <= 0 or self.job is None:
            return []
        now = time.monotonic()
        gone = [w for w in sorted(self.live) if now - self.last_seen.get(w, now) > self.worker_timeout_s]
        return [w for w in gone
                if self.evict(w, f"silent for {now - self.last_seen.get(w, now):.1f}s > --worker-timeout "
                                 f"{self.worker_timeout_s:g}s")]

    def start_reaper(self) -> None:
        """Background thread running evict_silent() (no-op without a worker timeout)."""
        if self.worker_timeout_s <= 0 or self._reaper is not None:
            return
        tick = max(0.05, min(0.5, self.worker_timeout_s / 5))

        def loop():
            while True:
                time.sleep(tick)
                try:
                    self.evict_silent()
                except Exception:  # noqa: BLE001 - the reaper must never die
                    log.exception("eviction check failed")
        self._reaper = threading.Thread(target=loop, name=f"shard{self.shard_id}-reaper", daemon=True)
        self._reaper.start()

    def _check_same_job(self, worker, world_size, mode, opt, digest, pull_codec="auto") -> None:
        job = self.job
        for what, mine, theirs in (("world size", job.world_size, world_size), ("sync mode", str(job.sync), str(mode)),
                                   ("optimizer", job.optimizer, opt), ("key layout digest", job.digest, digest),
                                   ("pull codec", job.pull_codec, pull_codec or "auto")):
            if mine != theirs:
                raise ShardError("FAILED_PRECONDITION",
                                 f"worker {worker} disagrees with the running job on {what}: "
                                 f"job has {mine}, worker sent {theirs}")
