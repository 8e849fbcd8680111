"""Client side of the failure semantics (docs/failure-semantics.md): one ShardSession per shard.

* Reconnect: UNAVAILABLE / CANCELLED (connection refused or lost) is retried with exponential backoff
  and jitter until `reconnect_deadline_s` has passed since the first failure of the outage (a recovery ends
  it); then a PSError naming the shard and its address ends the job cleanly instead of hanging. One call
  recovers at most MAX_RECOVERIES times.
* Restart detection: Register returns the shard's `server_id` (random per server process). Every
  Push/Pull carries it; a restarted shard refuses requests meant for its predecessor with ABORTED.
* Replay: every PushRequest is kept in a per-shard buffer until the shard reports it durable
  (`durable_step` in PushResponse: a retained checkpoint holds the worker's pushes below it). When the
  shard comes back with a new server_id, the session re-registers and re-sends the buffered pushes in
  their original order: the shard's per-(key, worker) dedup acknowledges those its checkpoint already
  holds and applies the rest. Only then do the interrupted calls (pushes, pulls) go out again.
* The buffer holds at most `replay_steps` distinct steps. Past that the oldest are dropped; should the
  shard then restart from a checkpoint older than the oldest kept push, recovery fails with DATA_LOSS
  (never silently): raise replay_steps or checkpoint more often.
* Pause: an elastic job below --min-workers holds pushes and pulls; past the server's wait it answers
  UNAVAILABLE with reason PAUSED, and the call is sent again (no reconnect deadline: pausing is not failing).
* Eviction: a push refused because the worker is no longer live (evicted for silence) re-registers,
  which puts the worker back at the current version, and is retried (duplicates are acknowledged).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from deltaps.errors import NOT_LIVE_MEMBER, PAUSED, PSError, from_rpc_error

log = logging.getLogger("deltaps.client")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
PAUSED_RETRY_S = 0.2    # between a push the paused job refused and its next attempt
MAX_RECOVERIES = 8      # recoveries one call may need (each a restart or eviction seen after the last one)


def backoff_delays(base: float = 0.05, cap: float = 2.0):
    """Exponential backoff with jitter: base * 2^i capped, times a random factor in [0.5, 1.5)."""
    i = 0
    while True:
        yield min(cap, base * (2 ** i)) * (0.5 + random.random())
        i = min(i + 1, 30)


@dataclass(frozen=True)
class SessionPolicy:
    """What a session needs to know of its client: who it is and how long to wait, retry and buffer."""
    worker_id: int
    timeout_s: float
    reconnect_deadline_s: float
    replay_steps: int


class ShardSession:
    """Connection state of one client to one shard: incarnation, registration, replay buffer.

    It holds no reference to the client: the stub, the policy, the client's `closed` event and a callback
    for a shard restart are all it gets."""

    REGISTER = "Register"                  # the RPC that (re)joins the job
    PUSHES = ("Push", "PushPull")          # RPCs whose NOT_LIVE_MEMBER refusal means "re-register and retry"

    def __init__(self, stub, addr: str, shard: int, policy: SessionPolicy, closed: threading.Event,
                 on_restart: Callable[[int, object], None]):
        self.stub, self.addr, self.shard = stub, addr, shard
        self.policy, self.closed, self.on_restart = policy, closed, on_restart
        self.lock = threading.RLock()       # held during recovery; guards the buffer
        self.server_id = ""                  # incarnation registered with ("" = not yet)
        self.epoch = 0                       # bumped by every recovery
        self.register_req = None
        self.buffer: deque = deque()         # (step, seq, PushRequest) not yet durable, in send order
        self.buffering = True                # False once the shard says it does not checkpoint
        self.dropped_below = 0               # pushes with step < this were dropped for the size bound
        self.restarts = 0
        self.replayed = 0

    # ---- plumbing -------------------------------------------------------------------------------
    def _stub_call(self, method: str, req, timeout: float):
        try:
            return getattr(self.stub, method)(req, timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _unreachable(self, t0: float, err) -> "Exception":
        return PSError(grpc.StatusCode.UNAVAILABLE,
                       f"shard {self.shard} at {self.addr} unreachable for {time.monotonic() - t0:.1f}s "
                       f"(reconnect deadline {self.policy.reconnect_deadline_s:g}s): {err}")

    def _with_backoff(self, fn, t0: float | None = None):
        """fn() retried on connection errors until the reconnect deadline (from t0, default now)."""
        t0 = time.monotonic() if t0 is None else t0
        delays = backoff_delays()
        while True:
            try:
                return fn()
            except PSError as e:
                if e.code not in RETRYABLE:
                    raise
                if self.closed.is_set() or time.monotonic() - t0 > self.policy.reconnect_deadline_s:
                    raise self._unreachable(t0, e) from None
                time.sleep(min(next(delays), max(0.0, t0 + self.policy.reconnect_deadline_s - time.monotonic())))

    # ---- registration and recovery ----------------------------------------------------------------
    def register(self, req):
        """First registration (setup)."""
        self.register_req = req
        rep = self._with_backoff(lambda: self._stub_call(self.REGISTER, req, 30.0))
        with self.lock:
            self.server_id = rep.server_id
            self.buffering = rep.durable_step >= 0
        return rep

    def recover(self, epoch_seen: int, t0: float, cause) -> None:
        """After a failure seen at `epoch_seen`: re-register (reconnecting with backoff), and if the shard
        restarted, replay the buffered pushes. A no-op when another thread already recovered."""
        with self.lock:
            if self.epoch != epoch_seen:
                return
            rep = self._with_backoff(lambda: self._stub_call("Register", self.register_req, 30.0), t0)
            self.buffering = rep.durable_step >= 0
            if rep.server_id == self.server_id:
                self.epoch += 1
                return
            self.restarts += 1
            if not rep.initialized:
                raise PSError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shard {self.shard} at {self.addr} restarted without its state (server_id "
                              f"{rep.server_id}; was it started with --restore?); cannot continue")
            pending = list(self.buffer)
            log.warning("worker %d: shard %d (%s) restarted (server_id %s -> %s) at step %d; replaying %d "
                        "buffered pushes (%s)", self.policy.worker_id, self.shard, self.addr, self.server_id or "-",
                        rep.server_id, rep.step, len(pending), cause)
            if rep.step < self.dropped_below and (not pending or rep.step < pending[0][0]):
                raise PSError(grpc.StatusCode.DATA_LOSS,
                              f"shard {self.shard} at {self.addr} restarted at step {rep.step} but the replay buffer "
                              f"starts at step {self.dropped_below} (replay_steps={self.policy.replay_steps}); "
                              f"pushes of steps {rep.step}..{self.dropped_below - 1} are lost: raise replay_steps "
                              f"or checkpoint more often")
            for _, _, req in pending:
                req.server_id = rep.server_id
                try:
                    resp = self._with_backoff(lambda req=req: self._stub_call("Push", req, self.policy.timeout_s), t0)
                except PSError as e:
                    raise PSError(e.code, f"shard {self.shard} at {self.addr}: replaying step {req.step} "
                                          f"(seq {req.seq}) after a restart failed: {e}") from None
                self.replayed += 1
                self._trim(resp.durable_step)
            self.server_id = rep.server_id
            self.epoch += 1
            self.on_restart(self.shard, rep)

    def call(self, method: str, build, timeout: float):
        """Send build() (rebuilt per attempt, with the current server_id); recover and retry on connection
        loss, a restarted shard (ABORTED) or eviction (pushes only). The reconnect deadline runs from the
        first failure of an outage: a recovery ends it, and a failure after that starts a new one."""
        t0, recoveries = None, 0
        while True:
            with self.lock:
                epoch = self.epoch
                req = build()
                if hasattr(req, "server_id"):
                    req.server_id = self.server_id
            try:
                return self._stub_call(method, req, timeout)
            except PSError as e:
                if e.reason == PAUSED and not self.closed.is_set():   # an elastic job waits for workers
                    log.warning("worker %d: shard %d: %s; waiting", self.policy.worker_id, self.shard, e)
                    t0 = None
                    self.closed.wait(PAUSED_RETRY_S)     # the shard held it as long as our deadline let it
                    continue
                evicted = (method in self.PUSHES and e.code == grpc.StatusCode.FAILED_PRECONDITION
                           and e.reason == NOT_LIVE_MEMBER)
                if e.code not in RETRYABLE and e.code != grpc.StatusCode.ABORTED and not evicted:
                    # said once more, naming the shard it came from
                    raise PSError(e.code, f"shard {self.shard} at {self.addr}: {method}: {e.message}", e.reason) from e
                if self.closed.is_set():
                    raise
                t0 = time.monotonic() if t0 is None else t0
                if time.monotonic() - t0 > self.policy.reconnect_deadline_s:
                    raise self._unreachable(t0, e) from None
                if recoveries >= MAX_RECOVERIES:   # a shard that restarts (or evicts us) as often as we come back
                    raise PSError(e.code, f"shard {self.shard} at {self.addr}: {method} failed again after "
                                          f"{recoveries} recoveries within one call: {e.message}", e.reason) from e
                if evicted:
                    log.warning("worker %d: shard %d evicted us; re-registering", self.policy.worker_id, self.shard)
                self.recover(epoch, t0, e)
                t0, recoveries = None, recoveries + 1

    # ---- pushes ---------------------------------------------------------------------------------
    def push(self, req, timeout: float):
        """Send one PushRequest exactly once from the job's point of view (buffered for replay)."""
        with self.lock:
            if self.buffering:
                self.buffer.append((req.step, req.seq, req))
                self._bound()
        rep = self.call("Push", lambda: req, timeout)
        with self.lock:
            self._trim(rep.durable_step)
        return rep

    def push_pull(self, req, build_pull, timeout: float):
        """A PushPullRequest whose push half is filled: that half is buffered for replay exactly like
        push(); the pull half is rebuilt per attempt (a restarted shard needs full values again). A retry
        after a lost answer gets the push acknowledged as a duplicate, never applied twice."""
        push_req = req.push
        with self.lock:
            if self.buffering:
                self.buffer.append((push_req.step, push_req.seq, push_req))
                self._bound()

        def build():
            req.pull.CopyFrom(build_pull())     # small: keys and versions only
            push_req.server_id = req.pull.server_id = self.server_id
            return req
        rep = self.call("PushPull", build, timeout)
        with self.lock:
            self._trim(rep.push.durable_step)
        return rep

    def _trim(self, durable_step: int) -> None:
        if durable_step < 0:
            self.buffering = False
            self.buffer.clear()
            return
        while self.buffer and self.buffer[0][0] < durable_step:
            self.buffer.popleft()

    def _bound(self) -> None:
        limit = self.policy.replay_steps
        while self.buffer and self.buffer[-1][0] - self.buffer[0][0] >= limit:
            step = self.buffer.popleft()[0]
            if step + 1 > self.dropped_below:
                log.warning("worker %d: replay buffer of shard %d exceeds replay_steps=%d; dropping step %d",
                            self.policy.worker_id, self.shard, limit, step)
            self.dropped_below = max(self.dropped_below, step + 1)
