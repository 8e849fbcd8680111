"""One parameter-server shard: key state, aggregation, sync-mode gating, staleness, idempotency.

Versions are clocks: a key's version is the number of steps whose updates are fully in it. In bsp it
goes up once per step (after all live workers pushed); in asp/ssp it is the minimum, over live workers,
of pushes applied from that worker. Staleness of a push = the pushing worker's clock (the version the
key would be at if every worker kept pace) - the version its gradient was computed on: how many clocks
of other workers' updates the gradient missed. 0 under bsp, at most S under ssp:S, unbounded under asp.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import Counter, deque

import torch

from compression.server import Decoded
from deltaps.errors import NOT_LIVE_MEMBER, PAUSED, ShardError
from deltaps.layout import Key
from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import resolve_pull_codec
from ps import buffers
from ps.membership import Membership
from ps.optimizer import KeyOptimizer
from ps.pull_views import PullView, answer_key, check_offers
from ps.request_checks import request_keys, unique_keys, wait_seconds
from ps.rounds import QuorumRounds, realigned_pull
from ps.shard_stats import Tally, shard_stats
from ps.state import Job, KeyState, parse_shard_state
from ps.waits import Waits

log = logging.getLogger("deltaps.shard")

NONFINITE_POLICIES = ("reject", "skip")


class Shard(Membership, Waits):
    def __init__(self, shard_id: int, num_shards: int, wait_timeout_s: float = 300.0, *,
                 worker_timeout_s: float = 0.0, nonfinite: str = "reject"):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.wait_timeout_s = wait_timeout_s
        # ---- reliability (ps/durability.py, docs/failure-semantics.md) ----
        self.server_id = secrets.token_hex(8)      # new on every process start: clients detect restarts
        self.worker_timeout_s = worker_timeout_s   # > 0: evict live workers silent for longer than this
        self.nonfinite = nonfinite                 # reject (INVALID_ARGUMENT) | skip (ack, not applied)
        self.last_seen: dict[int, float] = {}      # worker -> monotonic time of its last RPC
        self.beat_s: dict[int, float] = {}         # worker -> its heartbeat interval (Register; 0: none)
        self.attending: dict[int, int] = {}        # worker -> token of its open Attend stream (the newest)
        self._attend_tokens = itertools.count(1)
        self.shutting_down = False                 # the server is stopping: streams it cancels are not deaths
        self.checkpointing = False                 # set by ps.durability.Checkpointer
        self.durable_hist: deque = deque(maxlen=2)  # {worker: durable step} of the newest 2 checkpoints
        self.checkpoint_version = -1               # min key version of the latest checkpoint (-1: none)
        self._reaper: threading.Thread | None = None
        self.job: Job | None = None
        self.rounds: QuorumRounds | None = None    # --sync quorum: when rounds close (ps/rounds.py)
        self.stopped: dict | None = None           # Stop: {worker, step, time_s, reason} of the first stop
        self.keys: dict[str, KeyState] = {}
        self.live: set[int] = set()
        self.lock = threading.Lock()
        self.members = threading.Condition(self.lock)   # notified when a worker joins (ends a pause)
        self._pause_logged = -1e18
        self.restored = False                      # until the first registration after load_state_dict
        self.step_contributors = Tally()           # bsp: workers averaged per completed key-step -> count
        self.codec = "none"
        self.codec_epoch = 0
        self.pull_spec = "none"
        self.counters = Tally()
        self.staleness = Tally()
        self._barriers: dict[str, dict] = {}
        self.in_barrier: set[int] = set()          # workers waiting in a barrier: quorum rounds do not wait for them
        self.ahead: Counter = Counter()            # worker -> its pushes waiting for a later round (nor for them)
        self._barrier_cond = threading.Condition()

    # ---- membership -------------------------------------------------------------------------
    def register(self, worker: int, world_size: int, num_shards: int, sync: str, opt: OptimizerConfig,
                 keys: list[Key], digest: str, codec: str, pull_codec: str = "auto", min_workers: int = 0,
                 max_workers: int = 0, *, local_steps: int = 0, heartbeat_s: float = 0.0) -> bool:
        """Admit a worker (the first one defines the job). local_steps > 0: a local-update job; its pushes
        are parameter deltas (anchor - local model) and opt is the outer optimizer (docs/local-updates.md)."""
        mode, pull_spec = self._check_registration(worker, world_size, num_shards, sync, opt, keys, codec, pull_codec,
                                                   min_workers, max_workers, local_steps, heartbeat_s)
        if self.restored and self.job is not None and self.elastic:
            self.resize_after_restore(world_size)
        with self.lock:
            if self.job is None:
                states = {k.key: KeyState(k, self._zeros(k)) for k in keys}     # first: a failure defines no job
                self.job = Job(world_size, mode, opt, digest, codec, pull_codec or "auto", min_workers, max_workers,
                               local_steps=local_steps)
                self.codec = codec
                self.pull_spec = pull_spec
                self._start_rounds()
                self.keys = states
                self.live = set(range(world_size))
                now = time.monotonic()
                self.last_seen = {w: now for w in self.live}   # not-yet-started workers get a full timeout
            else:
                self._check_same_job(worker, world_size, mode, opt, digest, pull_codec, min_workers, max_workers,
                                     local_steps)
                self.check_capacity(worker)
                self._admit(worker)
            self.restored = False
            self.touch(worker)
            self.expect_heartbeats(worker, heartbeat_s)
            return all(ks.initialized for ks in self.keys.values())

    @staticmethod
    def _zeros(k: Key) -> torch.Tensor:
        try:
            return torch.zeros(k.numel, dtype=torch.float32)
        except (RuntimeError, MemoryError) as e:
            raise ShardError("RESOURCE_EXHAUSTED", f"key {k.key!r}: no memory for its {k.numel} values ({e})") from None

    def _start_rounds(self) -> None:
        self.rounds = QuorumRounds(self.job.sync, self._maybe_complete_step) if self.job.sync.kind == "quorum" else None

    def require_job(self) -> Job:
        if self.job is None:
            raise ShardError("FAILED_PRECONDITION", "no job registered on this shard yet; call Register first")
        return self.job

    def key_state(self, key: str) -> KeyState:
        ks = self.keys.get(key)
        if ks is None:
            raise ShardError("INVALID_ARGUMENT", f"unknown key {key!r} on shard {self.shard_id}")
        return ks

    # ---- init ------------------------------------------------------------------------------
    def init(self, values: list[tuple[str, torch.Tensor]]) -> int:
        job = self.require_job()
        unique_keys([k for k, _ in values], "an Init")
        checked = [(self.key_state(k), self._check_numel(k, v)) for k, v in values]
        done = 0
        for ks, v in checked:
            with ks.cond:
                if ks.initialized:
                    continue
                ks.value.copy_(v.view(-1).to(torch.float32))
                if not ks.spec.is_buffer:       # buffers: assigned, not optimised, pulled exactly (ps/buffers.py)
                    ks.opt = KeyOptimizer(ks.value, job.optimizer)
                    ks.view = ks.pull_view(self.pull_spec)
                ks.initialized = True
                if self.rounds is not None:
                    self.rounds.initialized(ks)    # the job's first round opens now
                done += 1
                ks.cond.notify_all()
        return done

    def _check_numel(self, key: str, t: torch.Tensor) -> torch.Tensor:
        ks = self.key_state(key)
        if t.numel() != ks.spec.numel:
            raise ShardError("INVALID_ARGUMENT",
                             f"key {key!r}: tensor has {t.numel()} elements, layout says {ks.spec.numel}")
        if not bool(torch.isfinite(t).all()):     # an initial value is kept as is: a NaN could never be repaired
            raise ShardError("INVALID_ARGUMENT", f"key {key!r}: the initial value contains NaN or Inf")
        return t

    # ---- push ------------------------------------------------------------------------------
    def push(self, worker: int, step: int, grads: list[tuple[str, "Decoded | torch.Tensor"]], pulled_versions: list[int],
             inner_steps: int = 0, held_s: float | None = None) -> tuple[list[bool], list[int], int]:
        job = self.require_job()
        if inner_steps and not 0 < inner_steps <= job.local_steps:
            raise ShardError("INVALID_ARGUMENT", f"inner_steps {inner_steps}: a round's delta covers 1 .. --local-steps "
                                                 f"{job.local_steps} inner steps (0: all of them)")
        if worker not in self.live:
            raise ShardError("FAILED_PRECONDITION", f"worker {worker} is not a live member of the job "
                                                    f"(evicted or never registered; Register to rejoin)",
                             reason=NOT_LIVE_MEMBER)
        self.wait_while_paused(worker, held_s)   # after the membership check: an evicted worker must hear it
        if step < 0:
            raise ShardError("INVALID_ARGUMENT", f"step must be >= 0, got {step}")
        self.touch(worker)
        if pulled_versions and len(pulled_versions) != len(grads):
            raise ShardError("INVALID_ARGUMENT", "pulled_versions must have one entry per gradient")
        unique_keys([k for k, _ in grads], "a push")     # a second copy would be acknowledged as a duplicate, unapplied
        checked = []
        for i, (key, g) in enumerate(grads):
            ks = self.key_state(key)
            if isinstance(g, torch.Tensor):
                g = Decoded(g.numel(), dense=g)
            if g.numel != ks.spec.numel:
                raise ShardError("INVALID_ARGUMENT",
                                 f"key {key!r}: gradient has {g.numel} elements, layout says {ks.spec.numel}")
            if not ks.initialized:
                raise ShardError("FAILED_PRECONDITION", f"key {key!r} has no value yet; rank 0 must Init first")
            if not g.all_finite():
                if self.nonfinite != "skip":
                    raise ShardError("INVALID_ARGUMENT", f"gradient for key {key!r} contains NaN or Inf")
                g = None     # --nonfinite skip: acknowledged and counted as pushed, never applied
            expected = ks.pushed.get(worker, 0)
            if job.sync.kind == "quorum":    # a worker that pulled version v may skip to round v (ps/rounds.py)
                expected = max(expected, ks.version)
            if step > expected:
                raise ShardError("FAILED_PRECONDITION",
                                 f"worker {worker} pushed step {step} for key {key!r} but its next step is {expected}")
            checked.append((ks, g, pulled_versions[i] if pulled_versions else step))
        applied = [self._apply(job, ks, worker, step, g, pulled, inner_steps) for ks, g, pulled in checked]
        dup, versions, landed = (list(col) for col in zip(*applied)) if applied else ([], [], [])
        self.counters.add("pushes")
        # the version a PushPull's pull waits for: a worker whose whole push landed late waits to be back in phase
        return dup, versions, realigned_pull(landed) if job.sync.kind == "quorum" else 0

    def _apply(self, job: Job, ks: KeyState, worker: int, step: int, g: Decoded, pulled: int, inner_steps: int = 0):
        with ks.cond:
            if job.sync.rounds:
                self._wait_for_step(ks, worker, step)
            if step < ks.pushed.get(worker, 0):
                self.counters.add("duplicates")
                # a replay of the last push (its answer lost) is realigned as the original was, if it landed late
                return True, ks.version, ks.landed.get(worker) if step == ks.pushed[worker] - 1 else None
            # rounds the gradient or delta missed (quorum: a late delta lands on the open round)
            lag = max(0, (ks.version if job.sync.kind == "quorum" else step) - pulled)
            self.staleness.add(lag)
            ks.pushed[worker] = step + 1
            ks.landed.pop(worker, None)      # set again below if this push lands late
            if g is None:
                self.counters.add("nonfinite_skipped")
            if self.stopped is not None:     # the job's model is the one its target was judged on
                self.counters.add("after_stop")
            elif job.sync.rounds:
                late_in = ks.version if step < ks.version else None     # the open round a late delta lands in
                if late_in is not None:
                    ks.landed[worker] = late_in
                self._contribute(ks, worker, step, g, job.sync.weight(lag, inner_steps, job.local_steps),
                                 job.sync.share(inner_steps, job.local_steps))
                return False, ks.version, late_in
            else:
                if ks.spec.is_buffer:
                    buffers.assign(ks, worker, g, self.live)
                elif g is not None:
                    dense = torch.zeros_like(ks.value)
                    g.add_to(dense, 1.0 / max(1, len(self.live)))
                    ks.opt.apply(dense)
                    self._count_update()
                version = min((ks.pushed.get(w, 0) for w in self.live), default=ks.version)
                if version != ks.version:
                    ks.version = version
                    self._publish(ks)
                ks.cond.notify_all()
            return False, ks.version, None

    def _contribute(self, ks: KeyState, worker: int, step: int, g: Decoded | None, weight: float = 1.0,
                    share: float = 1.0) -> None:
        """bsp / quorum: add a push to the open round's weighted sum (ks.cond held); a skipped gradient counts as
        zero. weight: 1, or under quorum the share of a round's inner steps it covers and its late discount
        (SyncMode.weight)."""
        if ks.agg is None:
            ks.agg = torch.zeros_like(ks.value)
        if ks.spec.is_buffer:
            buffers.take(ks, worker, g)
        elif g is not None:
            g.add_to(ks.agg, weight)
            ks.opt.note_push(g)      # all-top-k steps are applied lazily (ps/optimizer.py)
        if step < ks.version:
            self.counters.add("late_contributions")
        if self.rounds is not None:    # share: of a full round's inner steps (SyncMode.share)
            self.rounds.contributed(ks, share)
        ks.agg_from.add(worker)
        ks.agg_weight += weight
        self._maybe_complete_step(ks)

    def _maybe_complete_step(self, ks: KeyState) -> None:
        """Apply the open round of `ks` if it is complete: bsp, every live worker pushed; quorum, ps/rounds.py."""
        if not ks.agg_from or self.paused:
            return
        if not (self.live <= ks.agg_from if self.rounds is None else self.rounds.due(ks, self.counted_live())):
            return
        self.step_contributors.add(len(ks.agg_from))
        if ks.spec.is_buffer:
            buffers.finish(ks)
        else:
            if ks.view is not None and self.job.drops_pull_residual(self.pull_spec):
                ks.value.copy_(ks.view.view)     # the outer step starts from the model the workers hold
            ks.opt.apply_step(ks.agg / ks.agg_weight)   # the weighted mean over contributions
            self._count_update()
        ks.agg.zero_()
        ks.agg_from.clear()
        ks.agg_weight = 0.0
        ks.version += 1
        if self.rounds is not None:
            self.rounds.closed(ks, self.live)
        self._publish(ks)
        ks.cond.notify_all()

    def _count_update(self) -> None:
        self.counters.add("grads_applied")
        if self.job.local_steps:      # a local-update job's optimizer is its outer optimizer
            self.counters.add("outer_updates")

    @staticmethod
    def _publish(ks: KeyState) -> None:
        if ks.view is not None:
            ks.view.publish(ks.value, ks.version)

    # ---- pull ------------------------------------------------------------------------------
    def pull(self, keys: list[str], min_version: int, timeout_s: float = 0.0, have_versions=None, *,
             worker: int | None = None, alive=None, have_digests=None):
        """[(key, kind, tensor-or-payload, version)], server-side wait. Without have_versions every
        value is the exact parameter (kind FULL); with them, see deltaps/pull_codec.py.

        worker/alive: while the pull waits, `worker` counts as alive (not evicted) as long as alive()
        (the RPC context's is_active) is true; a caller that went away ends the wait with CANCELLED."""
        check_offers(len(keys), have_versions, have_digests)
        states = request_keys(self, keys, "a pull")
        timeout = wait_seconds(timeout_s, self.wait_timeout_s)
        t0 = time.monotonic()
        deadline = t0 + timeout
        out = []
        for i, ks in enumerate(states):
            with ks.cond:
                while not (ks.initialized and (ks.version >= min_version or self.stopped)):
                    left = deadline - time.monotonic()
                    if left <= 0 and self.paused:   # the client retries: a paused job waits
                        raise ShardError("UNAVAILABLE", f"job paused: {len(self.live)} live workers < --min-workers "
                                                        f"{self.job.min_workers}", reason=PAUSED)
                    if left <= 0:
                        raise ShardError("DEADLINE_EXCEEDED",
                                         f"key {ks.spec.key!r} still at version {ks.version} (want {min_version}, "
                                         f"initialized={ks.initialized}) after {timeout:.1f}s")
                    ks.cond.wait(min(left, 0.5))
                    if alive is not None and not alive():
                        raise ShardError("CANCELLED", "the pulling client went away")
                    if worker is not None:
                        self.touch(worker)
                out.append((ks.spec.key, *answer_key(ks, have_versions[i] if have_versions else None,
                                                     have_digests[i] if have_digests else b""), ks.version))
        self.counters.add("pulls")
        return out, time.monotonic() - t0

    # ---- control ---------------------------------------------------------------------------
    def set_codec(self, spec: str, epoch: int = 0) -> tuple[str, int]:
        """Switch the job's codec (at the next epoch, or at `epoch` when it is newer than this shard's: a restored
        shard catching up); an 'auto' pull codec follows it (off when pushes go uncompressed)."""
        with self.lock:
            if 0 < epoch <= self.codec_epoch:
                return self.codec, self.codec_epoch
            pull_spec = resolve_pull_codec(self.job.pull_codec, spec) if self.job else "none"
            self.codec = spec
            self.codec_epoch = epoch or self.codec_epoch + 1
            if pull_spec != self.pull_spec:
                for ks in self.keys.values():
                    with ks.cond:
                        if pull_spec == "none":
                            ks.view, ks.exact_since = None, ks.version
                        elif ks.view is None:
                            ks.view = ks.pull_view(pull_spec) if ks.initialized else None
                        else:   # keep the shared view; only the delta codec changes
                            ks.view.codec = PullView(pull_spec, ks.value[:0]).codec
                self.pull_spec = pull_spec
            return self.codec, self.codec_epoch

    # ---- state (checkpoints: ps/durability.py) --------------------------------------------------
    def state_dict(self) -> dict:
        """A consistent copy of everything needed to resume exactly here: taken with the shard lock and
        every key lock held (sorted key order), so no push is half in it; tensors are cloned."""
        with self.lock, self._all_keys_locked():
            return {
                "shard_id": self.shard_id, "num_shards": self.num_shards,
                "job": None if self.job is None else self.job.state_dict(),
                "codec": self.codec, "codec_epoch": self.codec_epoch, "pull_spec": self.pull_spec,
                "live": sorted(self.live), "keys": {name: ks.state_dict() for name, ks in self.keys.items()},
                "counters": {k: int(v) for k, v in self.counters.items()},
                "staleness": {int(k): int(v) for k, v in self.staleness.items()},
                # a restored shard evicts a worker that died meanwhile after its heartbeats, not --worker-timeout
                "beat_s": {int(w): float(s) for w, s in self.beat_s.items()},
                "stopped": None if self.stopped is None else dict(self.stopped),   # the job stays stopped
            }

    def load_state_dict(self, state: dict) -> None:
        """Load state_dict() output into this shard (same shard id and count); it keeps its new server_id
        and gives every live worker a full --worker-timeout to come back. Nothing changes if it raises."""
        self.adopt_state(parse_shard_state(state, self.shard_id, self.num_shards))

    def adopt_state(self, parsed: dict) -> None:
        """Take the objects ps/state.py parse_shard_state built (assignments only: cannot fail half way)."""
        with self.lock:
            self.job, self.keys, self.live = parsed["job"], parsed["keys"], parsed["live"]
            if self.job is not None:
                self._start_rounds()
            self.codec, self.codec_epoch, self.pull_spec = parsed["codec"], parsed["codec_epoch"], parsed["pull_spec"]
            self.counters, self.staleness = Tally(parsed["counters"]), Tally(parsed["staleness"])
            self.beat_s, self.stopped = parsed["beat_s"], parsed["stopped"]
            self.last_seen, self.restored = dict.fromkeys(self.live, time.monotonic()), True
        self.resume_heartbeats()

    def stats(self) -> dict:
        return shard_stats(self)
