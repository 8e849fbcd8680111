"""Shard membership: who is live, joins and rejoins, eviction of silent workers (a mixin of ps.shard.Shard).

Kept apart from the push/pull path: it only touches the live set, the per-key pushed tables when a
worker (re)joins, and wakes waiters when a worker leaves.
"""
from __future__ import annotations

import contextlib
import logging
import time

from deltaps.errors import PAUSED, ShardError
from deltaps.pull_codec import resolve_pull_codec
from deltaps.sync import parse_sync
from ps.reaper import reaper_tick, start_reaper
from ps.request_checks import check_world_size, unique_keys

log = logging.getLogger("deltaps.shard")


PAUSE_LOG_EVERY_S = 30.0
ABSENT_BEATS = 4        # a worker that heartbeats (RegisterRequest.heartbeat_s) is evicted after this many beats of silence
                        # (or at once when its Attend stream ends: attend / unattend)


class Membership:
    """Needs from the shard: lock, members, keys, live, job, last_seen, beat_s, attending, _attend_tokens,
    shutting_down, counters, worker_timeout_s, _barriers,
    _barrier_cond, in_barrier, rounds, stopped, _reaper, checkpointing, durable_hist, shard_id, and the
    step-completion hooks _maybe_complete_step / _publish, require_job."""

    # ---- elastic membership ------------------------------------------------------------------
    @contextlib.contextmanager
    def _all_keys_locked(self):
        """Stop the world: every key's lock, in sorted key order (callers hold self.lock first)."""
        with contextlib.ExitStack() as stack:
            for name in sorted(self.keys):
                stack.enter_context(self.keys[name].cond)
            yield

    def _admit(self, worker: int) -> None:
        """(Re)join `worker` at the current version (self.lock held). A worker not live has its pushed count on
        each key raised to at least the key's version, so it is never "behind" and its next step is
        worker_step(). Under --sync quorum every re-registering worker keeps its counts, live (its connection
        dropped) or evicted (by mistake, its delta in flight): that late delta, still to be re-sent, must fold into
        the next round, not be taken for a duplicate."""
        store = getattr(self, "embedding", None)   # row-sparse tables (ps/embedding/): rejoin them too
        if store is not None:
            store.admit(worker)
        with self._all_keys_locked():
            if worker not in self.live:
                # under quorum the counts stay (worker_step starts a joiner at the version all the same): a worker
                # evicted while its round's delta was in flight re-sends it, and it folds in late, not as a duplicate
                if self.job is None or self.job.sync.kind != "quorum":
                    for ks in self.keys.values():
                        ks.pushed[worker] = max(ks.pushed.get(worker, 0), ks.version)
                self.live.add(worker)
                self.counters.add("rejoins")
                self.members.notify_all()
                log.warning("shard %d: worker %d (re)joined the job at step %d; live workers %s", self.shard_id,
                            worker, self.worker_step(worker), sorted(self.live))

    def _check_registration(self, worker, world_size, num_shards, sync, opt, keys, codec, pull_codec, min_workers,
                            max_workers, local_steps, heartbeat_s):
        """What a Register request must satisfy before it may define or join the job; returns its sync mode and
        pull codec."""
        if num_shards != self.num_shards:
            raise ShardError("FAILED_PRECONDITION",
                             f"worker {worker} expects {num_shards} shards, this server is one of {self.num_shards}")
        check_world_size(world_size, max_workers)
        if not 0 <= worker < max(world_size, max_workers):
            raise ShardError("INVALID_ARGUMENT", f"worker id {worker} outside world size {world_size}"
                                                 + (f" / --max-workers {max_workers}" if max_workers else ""))
        if not (min_workers or 1) <= world_size <= (max_workers or world_size) or min_workers < 0:
            raise ShardError("INVALID_ARGUMENT", f"want 1 <= --min-workers {min_workers} <= world size {world_size} "
                                                 f"<= --max-workers {max_workers} (0: 1 and the world size)")
        if local_steps < 0:
            raise ShardError("INVALID_ARGUMENT", f"--local-steps must be >= 0, got {local_steps}")
        if not 0 <= heartbeat_s < float("inf"):
            raise ShardError("INVALID_ARGUMENT", f"heartbeat_s must be a finite number >= 0, got {heartbeat_s}")
        try:
            mode = parse_sync(sync)
            opt.validate()
            pull_spec = resolve_pull_codec(pull_codec, codec)
        except ValueError as e:
            raise ShardError("INVALID_ARGUMENT", str(e)) from None
        if mode.kind == "quorum" and not local_steps:
            raise ShardError("INVALID_ARGUMENT", f"--sync {mode} is for local-update jobs (--local-steps H > 0): a "
                                                 f"round's late deltas fold into the next one, gradients would not")
        unique_keys([k.key for k in keys], "a Register")
        for k in keys:
            if k.shard != self.shard_id:
                raise ShardError("INVALID_ARGUMENT", f"key {k.key} belongs to shard {k.shard}, not {self.shard_id}")
        return mode, pull_spec

    def worker_step(self, worker: int) -> int:
        """The step this worker pushes next on this shard (min over keys); a (re)joining worker starts here. Under
        quorum a worker may skip to the open round (ps/rounds.py), so it starts at most there."""
        if self.job is not None and self.job.sync.kind == "quorum":
            return min((max(ks.pushed.get(worker, 0), ks.version) for ks in self.keys.values()), default=0)
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
        if self.job is not None and 0 <= worker < max(self.job.world_size, self.job.max_workers):
            self.last_seen[worker] = time.monotonic()

    def evict(self, worker: int, reason: str = "") -> bool:
        """Remove `worker` from the live set: bsp steps waiting only on it complete with the workers who
        pushed (mean over them), ssp/asp clocks stop waiting for it, barriers stop counting it."""
        store = getattr(self, "embedding", None)   # row-sparse tables (ps/embedding/): the same, there
        if store is not None:
            store.evict(worker, reason)
        with self.lock:
            if worker not in self.live:
                return False
            with self._all_keys_locked():
                self.live.discard(worker)
                for ks in self.keys.values():
                    if not ks.initialized:
                        continue
                    if self.job.sync.rounds:
                        self._maybe_complete_step(ks)
                    elif self.live:
                        version = min(ks.pushed.get(w, 0) for w in self.live)
                        if version > ks.version:
                            ks.version = version
                            self._publish(ks)
                    ks.cond.notify_all()
            self.counters.add("evictions")
        log.warning("shard %d: evicted worker %d (%s); live workers now %s", self.shard_id, worker, reason,
                    sorted(self.live))
        with self._barrier_cond:
            for b in self._barriers.values():
                if b["arrived"] and self.live <= b["arrived"]:
                    b["gen"] += 1
                    b["arrived"] = set()
            self._barrier_cond.notify_all()
        return True

    def silence_limit(self, worker: int) -> tuple[float, str]:
        """How long `worker` may be silent before it is evicted, and which rule says so: --worker-timeout, or
        ABSENT_BEATS of the heartbeat it registered with, whichever is shorter ((inf, "") when neither applies)."""
        limits = [(self.worker_timeout_s, f"--worker-timeout {self.worker_timeout_s:g}s")]
        beat = self.beat_s.get(worker, 0.0)
        limits.append((ABSENT_BEATS * beat, f"{ABSENT_BEATS} heartbeats of {beat:g}s"))
        return min(((t, why) for t, why in limits if t > 0), default=(float("inf"), ""))

    def evict_silent(self) -> list[int]:
        """Evict every live worker silent (no RPC, no waiting RPC, no heartbeat) for longer than its silence limit."""
        if self.job is None:
            return []
        now = time.monotonic()
        gone = []
        for w in sorted(self.live):
            silent, (limit, why) = now - self.last_seen.get(w, now), self.silence_limit(w)
            if silent > limit and self.evict(w, f"silent for {silent:.1f}s > {why}"):
                gone.append(w)
        return gone

    def start_reaper(self, limit_s: float | None = None) -> None:
        """Background thread running evict_silent(), ticking five times per limit_s (default: the worker timeout);
        a no-op without a limit or when it runs already."""
        limit_s = self.worker_timeout_s if limit_s is None else limit_s
        if limit_s <= 0 or self._reaper is not None:
            return
        self._reaper = start_reaper(f"shard{self.shard_id}-reaper", reaper_tick(limit_s), self.evict_silent, log)

    def _job_worker(self, worker: int, rpc: str) -> None:
        """An RPC naming `worker` needs a registered job and one of its worker ids (INVALID_ARGUMENT otherwise)."""
        job = self.require_job()
        if not 0 <= worker < max(job.world_size, job.max_workers):
            raise ShardError("INVALID_ARGUMENT", f"{rpc} from worker {worker}: outside the job's worker ids")

    def heartbeat(self, worker: int, leaving: bool = False) -> bool:
        """A worker's heartbeat: it is alive (touch). Returns whether it is a live member (False: evicted; it
        rejoins with its next push, which is refused with NOT_LIVE_MEMBER and re-registers). leaving: it closes
        its client, so the end of its Attend stream is a departure, not a death: no eviction for it (if the job
        goes on, its silence evicts it as a worker that never heartbeated would be)."""
        self._job_worker(worker, "Heartbeat")
        self.touch(worker)
        if leaving:
            with self.lock:
                self.attending.pop(worker, None)
        return worker in self.live

    def attend(self, worker: int) -> int:
        """An Attend stream opened: `worker` is alive (touch) while it lasts. Returns its token: only the end of a
        worker's newest stream evicts it (a reconnecting client opens a new one before the old one is reaped)."""
        self._job_worker(worker, "Attend")
        self.touch(worker)
        with self.lock:
            token = self.attending[worker] = next(self._attend_tokens)
        return token

    def unattend(self, worker: int, token: int) -> bool:
        """An Attend stream ended without a leaving heartbeat first: its worker's process died (its kernel closed the
        connection). Evict it now rather than after ABSENT_BEATS missed beats. A kept connection that silently stops
        carrying anything is still the heartbeats' and --worker-timeout's to catch. True if it evicted."""
        with self.lock:
            if self.attending.get(worker) != token:
                return False
            del self.attending[worker]
        return not self.shutting_down and self.evict(worker, "its Attend stream closed: the worker is gone")

    def resume_heartbeats(self) -> None:
        """After a restore: the reaper watches the heartbeats the checkpoint recorded, so a worker that died while the
        shard was down goes after ABSENT_BEATS of them, not after --worker-timeout (rounds wait for it till then)."""
        beats = [s for s in self.beat_s.values() if s > 0]
        if beats:
            self.start_reaper(ABSENT_BEATS * min(beats))

    def expect_heartbeats(self, worker: int, beat_s: float) -> None:
        """Register (checked there): `worker` heartbeats every beat_s (0: it does not; --worker-timeout alone applies)."""
        self.beat_s[worker] = beat_s
        if beat_s > 0:
            self.start_reaper(ABSENT_BEATS * beat_s)

    def _check_same_job(self, worker, world_size, mode, opt, digest, pull_codec="auto", min_workers=0,
                        max_workers=0, local_steps=0) -> None:
        job = self.job
        # --local-steps before the optimizer: a mismatch there explains an optimizer mismatch too
        checks = [("sync mode", str(job.sync), str(mode)), ("--local-steps", job.local_steps, local_steps),
                  ("optimizer", job.optimizer, opt),
                  ("key layout digest", job.digest, digest), ("pull codec", job.pull_codec, pull_codec or "auto"),
                  ("--min-workers", job.min_workers, min_workers or 1),
                  ("--max-workers", job.max_workers, max_workers or job.world_size)]
        if not self.elastic:   # an elastic job's joiners may have started with another count
            checks.insert(0, ("world size", job.world_size, world_size))
        for what, mine, theirs in checks:
            if mine != theirs:
                raise ShardError("FAILED_PRECONDITION",
                                 f"worker {worker} disagrees with the running job on {what}: "
                                 f"job has {mine}, worker sent {theirs}")

    def stop(self, worker: int, step: int, time_s: float, reason: str = "") -> bool:
        """A worker stopped the job (--sync quorum: its evaluation reached the target). Pulls waiting for a round
        return at once, every pull answer carries the stop from now on, and later pushes are acknowledged but not
        applied (`after_stop`): the job's model is the one its target was judged on. False: already stopped."""
        self._job_worker(worker, "Stop")
        if step < 0 or not time_s >= 0:
            raise ShardError("INVALID_ARGUMENT", f"Stop needs step >= 0 and time_s >= 0, got {step} and {time_s}")
        with self.lock:
            first = self.stopped is None
            if first:
                self.stopped = {"worker_id": worker, "step": step, "time_s": time_s, "reason": reason}
                log.warning("shard %d: worker %d stopped the job at its step %d (%.2f s): %s", self.shard_id, worker,
                            step, time_s, reason or "no reason given")
            keys = list(self.keys.values())
        for ks in keys:          # wake pulls waiting for a round that may never close
            with ks.cond:
                ks.cond.notify_all()
        return first

    # ---- elastic jobs -----------------------------------------------------------------------
    @property
    def elastic(self) -> bool:
        return self.job is not None and self.job.elastic

    @property
    def paused(self) -> bool:
        """Fewer live workers than --min-workers: no step completes until enough workers (re)join."""
        return self.elastic and len(self.live) < self.job.min_workers

    def check_capacity(self, worker: int) -> None:
        """A new member must have an id below --max-workers and find a free place (self.lock held)."""
        job = self.job
        if not 0 <= worker < job.max_workers:
            raise ShardError("INVALID_ARGUMENT", f"worker id {worker} outside the job's ids [0, {job.max_workers}) "
                                                 f"(--max-workers {job.max_workers})")
        if worker not in self.live and len(self.live) >= job.max_workers:
            raise ShardError("RESOURCE_EXHAUSTED", f"job full: {len(self.live)} live workers {sorted(self.live)} = "
                                                   f"--max-workers {job.max_workers}; worker {worker} not admitted")

    def resize_after_restore(self, world_size: int) -> None:
        """The first registration after a restore re-bases an elastic job on the registrant's worker count:
        ids at or above it leave (their half-done steps complete with the others), ids below it are expected
        (a full --worker-timeout to register), whoever the checkpoint had live."""
        job = self.job
        if not job.min_workers <= world_size <= job.max_workers:
            raise ShardError("FAILED_PRECONDITION", f"job restored with world size {job.world_size} cannot resume with "
                                                    f"{world_size} workers outside [--min-workers {job.min_workers}, "
                                                    f"--max-workers {job.max_workers}]")
        for w in sorted(w for w in self.live if w >= world_size):
            self.evict(w, f"job resumed with {world_size} workers")
        with self.lock:
            before = sorted(self.live)
            for w in range(world_size):
                if w not in self.live:
                    self._admit(w)
                self.last_seen[w] = time.monotonic()
            if before != sorted(self.live) or world_size != job.world_size:
                log.warning("shard %d: job resumed from a checkpoint with %d workers (was %d, live %s); live workers "
                            "%s", self.shard_id, world_size, job.world_size, before, sorted(self.live))
            job.world_size = world_size

    def wait_while_paused(self, worker: int, held_s: float | None = None) -> None:
        """Hold a push while the job is paused; past the wait timeout, or held_s (what the caller's own deadline
        leaves: answered before it, or the client would fail with DEADLINE_EXCEEDED), refuse it with reason PAUSED
        (the client retries: a paused job waits for workers, it does not fail)."""
        deadline = time.monotonic() + (self.wait_timeout_s if held_s is None else min(self.wait_timeout_s, held_s))
        with self.members:
            if not self.paused:
                return
            while self.paused:
                now = time.monotonic()
                if now - self._pause_logged >= PAUSE_LOG_EVERY_S:
                    self._pause_logged = now
                    log.warning("shard %d: job paused: %d live workers %s < --min-workers %d; waiting for workers "
                                "to join", self.shard_id, len(self.live), sorted(self.live), self.job.min_workers)
                if now >= deadline:
                    raise ShardError("UNAVAILABLE", f"job paused: {len(self.live)} live workers < --min-workers "
                                                    f"{self.job.min_workers}", reason=PAUSED)
                self.members.wait(min(0.5, deadline - now))
                self.touch(worker)
            log.warning("shard %d: job resumed with live workers %s", self.shard_id, sorted(self.live))
