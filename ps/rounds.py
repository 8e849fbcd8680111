"""Quorum rounds (`--sync quorum:Q[:grace=G]`, local-update jobs): a round never waits for the slowest or the dead.

Per key, as bsp: version v is the number of rounds applied, and round v collects the deltas pushed while it is
open. It closes when every live worker has contributed (at once, as bsp; a worker that joined while it was open is
not waited for: its first delta, for the round it pulled, folds into the next round as a late one, instead of the
others idling for the part of a round it missed), or when Q workers have and the
grace window since the Q-th has passed: G x the median of the key's recent open-to-quorum spans (adaptive: a
slower cluster waits longer; the job's first round opens at the key's Init, so its span is a round plus the
workers' start-up — never the start-up skew between the first deltas, which sized 1 s windows on lm's 3 s rounds),
or G seconds with `grace=Gs`.
A delta pushed for an older round (a straggler's, or one that missed its round's close) is *late*: it folds into
the open round instead of being dropped, and counts toward its quorum. A round that cannot reach its quorum (more
dead workers than Q allows, not yet evicted by --worker-timeout) closes with what it has once it has been open
STARVED x the recent open-to-quorum span (at least STARVED_MIN_S and twice the grace window), and a span (at least
STARVED_MIN_S) has passed since its first contribution.
Every contribution has the same weight: each covers H inner steps of the same batch
size, i.e. the same samples; the mean is over contributions (late=discount: a late one's is 1 / (1 + staleness);
inner=adaptive: a slow worker's delta covering fewer inner steps weighs that share of H, and the quorum counts
those shares, so a few steps of a slow worker never close a round in place of a full one).
Every pull carries the quorum's pace (pace_s: the median open-to-quorum span of recent rounds a close opened), which
such a worker fits its round to: the close-to-close pace would include the grace window it holds a round open for.
A worker that pulled version v may push round v
next, skipping the rounds it missed (a joiner does the same). A dead worker costs its own contribution; its
eviction (--worker-timeout) only shrinks the set that closes a round at once. With Q = all and G = 0 a
round is exactly a bsp step.

The shard calls `due(ks, live)` with the key's lock held; a grace window ends through a timer that calls
back into the shard (`close`), which re-checks the round under the lock (it may have closed meanwhile).
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from deltaps.sync import SyncMode
from ps.state import KeyState

RECENT_ROUNDS = 8       # spans the adaptive grace window takes its median over
STARVED = 3.0           # a round short of its quorum closes after this many recent spans with what it has,
STARVED_MIN_S = 1.0     # and never sooner than this nor than twice its grace window


def realigned_pull(landed: list[int | None]) -> int:
    """PushPull under quorum: the version its pull waits for beyond the usual next one (0: none). `landed`, per key
    pushed: the open round a late delta landed in (None: on time, or a replay of an on-time or older push; a replay
    of the last push, late: where it landed). When every key's delta landed late, the worker is already in those
    rounds; handed the current model at once it would train a round the others are halfway through, land late again,
    and stay a round behind for good, every delta discounted as stale (a joiner, a worker that missed a close).
    Waiting for the earliest of them to close puts it back in phase: at most the rest of one round, once
    (docs/local-updates.md#quorum-rounds-never-wait-for-the-slowest-or-the-dead)."""
    return min(landed) + 1 if landed and all(r is not None for r in landed) else 0


class QuorumRounds:
    def __init__(self, sync: SyncMode, close: Callable[[KeyState], None]):
        self.sync = sync
        self.close = close                      # the shard's step completion, called with ks.cond held
        self.opened_at: dict[str, float] = {}   # key -> monotonic time its open round opened
        self.waits_for: dict[str, set[int]] = {}    # key -> the live workers when a close opened its open round
        # keys whose open round opened at its first contribution (no Init seen: a restored shard): its span is
        # start-up skew, not a round. A window or a starvation wait sized from it closed lm rounds of ~3 s within
        # 1 s, each on one late delta (measured: bench compare's `rounds`), so it sizes nothing
        self.skewed: set[str] = set()
        # key -> recent open-to-quorum times (the job's first round opens at the key's Init: its span is a round and
        # the workers' start-up, an over-estimate that errs towards waiting)
        self.spans: dict[str, deque] = {}
        self.paces: dict[str, deque] = {}       # key -> the same, of rounds a close opened (start-up left out)
        self.pace: dict[str, float] = {}        # key -> their median (pace_s), kept here rather than on every pull
        self.deadline: dict[str, float] = {}    # key -> end of the open round's grace window (quorum reached)
        self.starve_at: dict[str, float] = {}   # key -> when its open round closes short of its quorum
        self.shares: dict[str, float] = {}      # key -> shares of a full round its open round's contributions cover

    def initialized(self, ks: KeyState) -> None:
        """The key got its value (Init): the job's first round opens now."""
        self.opened_at[ks.spec.key] = time.monotonic()

    def contributed(self, ks: KeyState, share: float = 1.0) -> None:
        """A contribution covering `share` of a full round arrived (the first of a round opens it, if neither an Init
        nor a close did); the round's first contribution arms the starvation timer."""
        key = ks.spec.key
        if key not in self.opened_at:
            self.opened_at[key] = time.monotonic()
            self.skewed.add(key)
        self.shares[key] = self.shares.get(key, 0.0) + share
        if len(ks.agg_from) == 0 and self.spans.get(key):
            span = statistics.median(self.spans[key])
            wait = max(STARVED * span, STARVED_MIN_S, 2 * self.grace_s(key))
            # and at least a span after this first delta: after a pause that held every worker (elastic, a long
            # evaluation) the round opened long ago, and would close at once on one delta with the others alive
            self.starve_at[key] = max(self.opened_at[key] + wait, time.monotonic() + max(span, STARVED_MIN_S))
            self._timer(max(0.0, self.starve_at[key] - time.monotonic()), ks, self.starve_at)

    def due(self, ks: KeyState, live: set[int]) -> bool:
        """Whether the open round of `ks` closes now (the caller holds ks.cond and has checked that it has
        contributions): every live worker in, or the quorum reached and its grace window over. Reaching the
        quorum starts the window (a timer closes the round when it ends)."""
        # every worker live since the round opened is in (one that joined meanwhile is not waited for)
        if (live & self.waits_for.get(ks.spec.key, live) or live) <= ks.agg_from:
            return True
        if self.sync.counted(len(ks.agg_from), self.shares.get(ks.spec.key, 0.0)) < self.sync.quorum_of(len(live)) - 1e-9:
            return time.monotonic() >= self.starve_at.get(ks.spec.key, float("inf"))   # the dead hold no round
        key, now = ks.spec.key, time.monotonic()
        if key in self.skewed and self.sync.grace > 0 and not self.sync.grace_in_s:
            return False     # no round's span to size its window by: it waits for every live worker
        if key not in self.deadline:
            if key not in self.skewed:
                spans = self.spans.setdefault(key, deque(maxlen=RECENT_ROUNDS))
                spans.append(now - self.opened_at[key])
                if key in self.waits_for:
                    paces = self.paces.setdefault(key, deque(maxlen=RECENT_ROUNDS))
                    paces.append(spans[-1])
                    self.pace[key] = statistics.median(paces)
            grace = self.grace_s(key)
            self.deadline[key] = now + grace
            if grace > 0:
                self._timer(grace, ks, self.deadline)
        return now >= self.deadline[key]

    def _timer(self, delay: float, ks: KeyState, ends: dict[str, float]) -> None:
        """Close the round of `ks` open now once `delay` has passed (ends: the deadlines the wait is on)."""
        timer = threading.Timer(delay, self._wait_over, (ks, ks.version, ends))
        timer.daemon = True
        timer.start()

    def pace_s(self, key: str) -> float:
        """The quorum's pace: the median open-to-quorum span of the key's recent rounds a close opened (0 before
        one reached its quorum). A slow worker fits its round to it (inner=adaptive); the grace window a straggler
        stretches a round by does not enter it, nor does the first round's start-up skew."""
        return self.pace.get(key, 0.0)

    def grace_s(self, key: str) -> float:
        if self.sync.grace_in_s:
            return self.sync.grace
        spans = self.spans.get(key)
        return self.sync.grace * statistics.median(spans) if spans else 0.0

    def closed(self, ks: KeyState, live: set[int]) -> None:
        """The open round of `ks` was applied: the next one opens now, waiting for the `live` workers at most."""
        self.deadline.pop(ks.spec.key, None)
        self.starve_at.pop(ks.spec.key, None)
        self.shares.pop(ks.spec.key, None)
        self.opened_at[ks.spec.key] = time.monotonic()
        self.skewed.discard(ks.spec.key)
        self.waits_for[ks.spec.key] = set(live)

    def _wait_over(self, ks: KeyState, version: int, ends: dict[str, float]) -> None:
        """A grace window or a starvation wait ended: close the round if it is still open (and due)."""
        with ks.cond:
            if ks.version == version and ks.agg_from and ks.spec.key in ends:
                ends[ks.spec.key] = min(ends[ks.spec.key], time.monotonic())   # a timer may fire a hair early
                self.close(ks)
