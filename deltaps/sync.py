"""Sync modes: bsp (apply when all live workers pushed), asp (apply on arrival), ssp:S (bounded staleness),
quorum:Q[:grace=G] (local-update rounds applied at Q contributions plus a grace window: ps/rounds.py)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GRACE = 0.25      # quorum: the grace window as a share of the recent rounds' open-to-quorum time
LATE_WEIGHTS = ("equal", "discount")   # quorum: a late delta's weight, 1 or 1 / (1 + its staleness)
INNER_STEPS = ("fixed", "adaptive")    # quorum: every round H inner steps, or fewer for a worker slower than the quorum
ROUND_KINDS = ("bsp", "quorum")   # modes whose versions are rounds every pusher contributes to


@dataclass(frozen=True)
class SyncMode:
    kind: str                  # "bsp" | "asp" | "ssp" | "quorum"
    bound: int = 0             # ssp: the staleness bound S; quorum: Q, the contributions that close a round
    grace: float = 0.0         # quorum: the grace window, a share of recent round time (grace_in_s: seconds)
    grace_in_s: bool = False
    late: str = "equal"        # quorum: weight of a late delta (LATE_WEIGHTS)
    inner: str = "fixed"       # quorum: a worker's inner steps per round (INNER_STEPS; worker/local_updates.py)

    def __str__(self) -> str:
        if self.kind == "ssp":
            return f"ssp:{self.bound}"
        if self.kind == "quorum":
            late = f":late={self.late}" if self.late != "equal" else ""
            inner = f":inner={self.inner}" if self.inner != "fixed" else ""
            return f"quorum:{self.bound}:grace={self.grace:g}{'s' if self.grace_in_s else ''}{late}{inner}"
        return self.kind

    @staticmethod
    def share(inner_steps: int = 0, local_steps: int = 0) -> float:
        """The samples a round's contribution covers as a share of a full round's: inner_steps of the job's
        local_steps (0: all of them; a worker slower than the quorum takes fewer under inner=adaptive)."""
        return inner_steps / local_steps if inner_steps and local_steps else 1.0

    def weight(self, staleness: int, inner_steps: int = 0, local_steps: int = 0) -> float:
        """The weight of a contribution computed `staleness` rounds before the round it lands in: its share, times
        the late discount."""
        share = self.share(inner_steps, local_steps)
        return share / (1 + staleness) if self.late == "discount" else share

    def counted(self, contributors: int, shares: float) -> float:
        """How far a round is towards its quorum: its contributing workers, or under inner=adaptive the shares of a
        full round their contributions cover (a slow worker's few steps do not stand in for a full round)."""
        return shares if self.inner == "adaptive" else contributors

    @property
    def rounds(self) -> bool:
        """Versions are rounds a push contributes to (bsp, quorum), not per-worker clocks (asp, ssp)."""
        return self.kind in ROUND_KINDS

    def pull_min_version(self, clock: int) -> int:
        """Version a worker at `clock` (steps completed) must see before it computes its next step."""
        if self.rounds:
            return clock
        if self.kind == "ssp":
            return max(0, clock - self.bound)
        return 0

    def quorum_of(self, live: int) -> int:
        """Contributions that close a round with `live` live workers (bsp: all of them)."""
        return min(self.bound, live) if self.kind == "quorum" else live


def _parse_quorum(spec: str, s: str) -> SyncMode:
    parts = s.split(":")[1:]
    usage = (f"bad sync mode {spec!r}: use quorum:Q[:grace=G][:late=equal|discount][:inner=fixed|adaptive] (Q >= 1 "
             f"workers; G >= 0, a share of recent round time, or Gs seconds)")
    try:
        q = int(parts[0])
    except (ValueError, IndexError):
        raise ValueError(usage) from None
    grace, in_s, late, inner = DEFAULT_GRACE, False, "equal", "fixed"
    for opt in parts[1:]:
        name, _, value = opt.partition("=")
        if name == "late" and value in LATE_WEIGHTS:
            late = value
            continue
        if name == "inner" and value in INNER_STEPS:
            inner = value
            continue
        if name != "grace" or not value:
            raise ValueError(f"{usage}; unknown option {opt!r}")
        in_s = value.endswith("s")
        try:
            grace = float(value[:-1] if in_s else value)
        except ValueError:
            raise ValueError(f"{usage}; grace {value!r} is not a number") from None
    if q < 1 or not grace >= 0 or grace == float("inf"):
        raise ValueError(usage)
    return SyncMode("quorum", q, grace, in_s, late, inner)


def parse_sync(spec: str) -> SyncMode:
    s = (spec or "").strip().lower()
    if s in ("bsp", "asp"):
        return SyncMode(s)
    if s.startswith("ssp:"):
        try:
            bound = int(s[4:])
        except ValueError:
            bound = -1
        if bound < 0:
            raise ValueError(f"bad sync mode {spec!r}: ssp needs a non-negative integer bound, e.g. ssp:2")
        return SyncMode("ssp", bound)
    if s.startswith("quorum:") or s == "quorum":
        return _parse_quorum(spec, s)
    raise ValueError(f"unknown sync mode {spec!r}; use bsp, asp, ssp:S or quorum:Q[:grace=G]")
