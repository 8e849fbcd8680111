"""Failure handling of the embedding client (worker/embedding/client.py): one EmbeddingSession per shard, with the
dense path's semantics (worker/session.py, docs/failure-semantics.md) for SparsePull / SparsePush.

* Reconnect: UNAVAILABLE / CANCELLED is retried with backoff until `reconnect_deadline_s`.
* Restart detection: RegisterEmbedding returns the shard's `server_id`; every SparsePull / SparsePush
  carries it and a restarted shard refuses requests meant for its predecessor with ABORTED.
* Replay: every SparsePushRequest is kept until the shard reports it durable (`durable_step`). When the shard
  comes back with a new server_id the session re-registers and re-sends the kept pushes in order, flagged
  `replay` (rows the restored shard does not hold are allocated: their initial value is a pure function of
  the row); the store's pushed table acknowledges those its checkpoint already holds and applies the rest.
* Watch: a bsp step on the restored shard needs every worker's replay, and in hybrid mode a worker may sit in
  the dense allreduce, making no call to the shard, while its peer waits on that shard for the step. So a
  lost connection starts the recovery in the background (channel connectivity), not only on the next call.
* Pull, restart, push: rows a worker pulled from the shard's previous incarnation may be unknown to the
  restored one (allocated after its checkpoint). A push sent to another incarnation than the one that served
  this worker's last pull is flagged `replay` too, so the shard allocates them (the values the worker saw
  are the restored shard's after the replays: initial values are a pure function of the row).
* Eviction: a push refused with reason NOT_LIVE_MEMBER re-registers (the worker rejoins at the shard's
  current version) and is retried; a step already applied without it is acknowledged as a duplicate.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from deltaps.errors import PSError
from worker.session import ShardSession

log = logging.getLogger("deltaps.client")


class EmbeddingSession(ShardSession):
    """Connection state of one embedding client to one shard (reuses ShardSession's backoff, buffer, retry
    loop and registration; only the replay after a restart is its own)."""

    REGISTER = "RegisterEmbedding"
    PUSHES = ("SparsePush",)

    def __init__(self, stub, channel, addr: str, shard: int, policy, closed: threading.Event):
        super().__init__(stub, addr, shard, policy, closed, on_restart=lambda shard, rep: None)
        self.channel = channel
        self.next_step = 0            # 1 + the highest step pushed to this shard
        self.pulled_from = ""         # server_id of the incarnation that served this worker's last pull
        self._connected = False
        channel.subscribe(self._on_connectivity)

    def register(self, req):
        rep = super().register(req)
        with self.lock:
            self.next_step = max(self.next_step, rep.step)
        return rep

    def recover(self, epoch_seen: int, t0: float, cause) -> None:
        """Re-register (reconnecting with backoff); if the shard restarted, replay the kept pushes. A no-op
        when another thread already recovered since `epoch_seen`."""
        with self.lock:
            if self.epoch != epoch_seen:
                return
            rep = self._with_backoff(lambda: self._stub_call(self.REGISTER, self.register_req, 30.0), t0)
            if rep.server_id == self.server_id:
                self.epoch += 1
                return
            self.restarts += 1
            pending = [req for _, _, req in self.buffer]
            log.warning("worker %d: shard %d (%s) restarted (server_id %s -> %s) at embedding step %d; replaying %d "
                        "buffered embedding pushes (%s)", self.policy.worker_id, self.shard, self.addr,
                        self.server_id or "-", rep.server_id, rep.step, len(pending), cause)
            if rep.step < (pending[0].step if pending else self.next_step):
                raise PSError(grpc.StatusCode.DATA_LOSS,
                              f"shard {self.shard} at {self.addr} restarted at embedding step {rep.step} but this "
                              f"worker pushed up to step {self.next_step - 1} and keeps pushes from step "
                              f"{pending[0].step if pending else self.next_step} on (was the shard started with "
                              f"--restore? replay_steps={self.policy.replay_steps}); those pushes are lost")
            for req in pending:
                again = type(req)()
                again.CopyFrom(req)
                again.server_id, again.replay = rep.server_id, True
                try:
                    resp = self._with_backoff(
                        lambda again=again: self._stub_call("SparsePush", again, self.policy.timeout_s), t0)
                except PSError as e:
                    raise PSError(e.code, f"shard {self.shard} at {self.addr}: replaying embedding step {req.step} "
                                          f"after a restart failed: {e}") from None
                self.replayed += 1
                self._trim(resp.durable_step)
            self.server_id = rep.server_id
            self.buffering = self.buffering and rep.durable_step >= 0
            self.epoch += 1

    def pull(self, req, timeout: float):
        rep = self.call("SparsePull", lambda: req, timeout)
        with self.lock:
            self.pulled_from = req.server_id     # call() stamped the attempt that succeeded
        return rep

    def push(self, req, timeout: float):
        """Send one SparsePushRequest exactly once from the job's point of view (kept for replay)."""
        with self.lock:
            if self.buffering:
                self.buffer.append((req.step, 0, req))
                self._bound()
            self.next_step = max(self.next_step, req.step + 1)

        def build():   # (under the session lock) rows pulled from an earlier incarnation may be unknown here
            req.replay = req.replay or (self.pulled_from != "" and self.pulled_from != self.server_id)
            return req
        rep = self.call("SparsePush", build, timeout)
        with self.lock:
            self._trim(rep.durable_step)
        return rep

    # ---- watch ----------------------------------------------------------------------------------
    def _on_connectivity(self, state) -> None:
        """grpc's connectivity callback: a registered session whose connection dropped recovers in the
        background (a worker inside a collective may not call this shard again before its peers need it)."""
        if state == grpc.ChannelConnectivity.READY:
            self._connected = True
        elif (state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
              and self._connected and self.server_id and not self.closed.is_set()):
            self._connected = False
            threading.Thread(target=self._recover_in_background, args=(self.epoch,), daemon=True,
                             name=f"emb-watch{self.shard}").start()

    def _recover_in_background(self, epoch: int) -> None:
        try:
            self.recover(epoch, time.monotonic(), "connection lost")
        except Exception as e:  # noqa: BLE001 - the training thread's next call reports it
            if not self.closed.is_set():
                log.warning("worker %d: background recovery of shard %d failed: %s", self.policy.worker_id,
                            self.shard, e)

    def close(self) -> None:
        try:
            self.channel.unsubscribe(self._on_connectivity)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
