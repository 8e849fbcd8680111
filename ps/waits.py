"""Where a shard's workers wait on each other (a mixin of ps.shard.Shard): barriers, and a replayed push waiting for
its round. Under --sync quorum a worker waiting in either pushes nothing for the open round, so rounds stop counting
on it (counted_live): the last worker still training is never stuck on one that is waiting.

Needs from the shard: keys, live, rounds, wait_timeout_s, _barriers, _barrier_cond, in_barrier, ahead, touch,
require_job, _maybe_complete_step.
"""
from __future__ import annotations

import threading
import time

from deltaps.errors import ShardError
from ps.request_checks import wait_seconds


class Waits:
    # barriers: every live worker arrives (an eviction releases the others)
    def barrier(self, worker: int, name: str, timeout_s: float = 0.0, alive=None) -> float:
        """Wait until every live worker arrived at barrier `name`. Meanwhile the worker pushes nothing: quorum
        rounds stop counting on it (ps/rounds.py), so the last worker still training is never stuck on it."""
        self.require_job()
        self.touch(worker)
        with self._barrier_cond:
            self.in_barrier.add(worker)
        try:
            if self.rounds is not None:
                self._close_due_rounds()
            return self._wait_barrier(worker, name, timeout_s, alive)
        finally:
            with self._barrier_cond:
                self.in_barrier.discard(worker)

    def _wait_for_step(self, ks, worker: int, step: int) -> None:
        """bsp: a push of step s is aggregated only once the key finished step s-1 (ks.cond held). Normal
        training never waits here (a worker pulls version s before pushing step s); a replay after a shard
        restart does, so one worker's replayed step s+1 never mixes into step s's aggregation. Under quorum a
        worker waiting here pushes nothing for the open round, which stops counting on it (as on one in a barrier):
        a replayed push of a round the worker had skipped ahead to would otherwise hold a round that needs it."""
        if ks.version >= step or ks.pushed.get(worker, 0) > step:
            return
        deadline = time.monotonic() + self.wait_timeout_s
        if self.rounds is not None:
            with self._barrier_cond:     # a worker's batches of one push may wait on several keys at once
                self.ahead[worker] += 1
            threading.Thread(target=self._close_due_rounds, daemon=True).start()   # other keys: their own locks
            self._maybe_complete_step(ks)
        try:
            while ks.version < step and ks.pushed.get(worker, 0) <= step:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardError("DEADLINE_EXCEEDED", f"key {ks.spec.key!r}: push of step {step} by worker {worker} "
                                                          f"waited {self.wait_timeout_s:.1f}s for step {ks.version}")
                ks.cond.wait(min(left, 0.5))
                self.touch(worker)
        finally:
            if self.rounds is not None:
                with self._barrier_cond:
                    self.ahead[worker] -= 1
                    if self.ahead[worker] <= 0:
                        del self.ahead[worker]

    def counted_live(self) -> set[int]:
        """The live workers a quorum round counts on: not those in a barrier or waiting for a later round."""
        return self.live - self.in_barrier - set(self.ahead)

    def _close_due_rounds(self) -> None:
        for ks in list(self.keys.values()):
            with ks.cond:
                self._maybe_complete_step(ks)

    def _wait_barrier(self, worker: int, name: str, timeout_s: float, alive) -> float:
        timeout = wait_seconds(timeout_s, self.wait_timeout_s)
        t0 = time.monotonic()
        with self._barrier_cond:
            b = self._barriers.setdefault(name, {"gen": 0, "arrived": set()})
            gen = b["gen"]
            b["arrived"].add(worker)
            if self.live <= b["arrived"]:
                b["gen"] += 1
                b["arrived"] = set()
                self._barrier_cond.notify_all()
            while b["gen"] == gen:
                left = t0 + timeout - time.monotonic()
                if left <= 0:
                    b["arrived"].discard(worker)
                    raise ShardError("DEADLINE_EXCEEDED", f"barrier {name!r} timed out after {timeout:.1f}s")
                self._barrier_cond.wait(min(left, 0.5))
                if alive is not None and not alive():
                    b["arrived"].discard(worker)
                    raise ShardError("CANCELLED", "the client waiting in the barrier went away")
                self.touch(worker)
        return time.monotonic() - t0
