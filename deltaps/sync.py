"""Sync modes: bsp (apply when all live workers pushed), asp (apply on arrival), ssp:S (bounded staleness),
quorum:Q[:grace=G] (local-update rounds applied at Q contributions plus a grace window: ps/rounds.py)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GRACE = 0.25      # quorum: the grace window as a share of the recent rounds' open-to-quorum time
LATE_WEIGHTS = ("equal", "discount")   # quorum: a late delta's weight, 1 or 1 / (1 + its staleness)
ROUND_KINDS = ("bsp", "quorum")   # modes whose versions are rounds every pusher contributes to


@dataclass(frozen=True)
class SyncMode:
    kind: str                  # "bsp" | "asp" | "ssp" | "quorum"
    bound: int = 0             # ssp: the staleness bound S; quorum: Q, the contributions that close a round
    grace: float = 0.0         # quorum: the grace window, a share of recent round time (grace_in_s: seconds)
    grace_in_s: bool = False
    late: str = "equal"        # quorum: weight of a late delta (LATE_WEIGHTS)

    def __str__(self) -> str:
        if self.kind == "ssp":
            return f"ssp:{self.bound}"
        if self.kind == "quorum":
            late = f":late={self.late}" if self.late != "equal" else ""
            return f"quorum:{self.bound}:grace={self.grace:g}{'s' if self.grace_in_s else ''}{late}"
        return self.kind

    def weight(self, staleness: int) -> float:
        """The weight of a contribution computed `staleness` rounds before the round it lands in."""
        return 1.0 / (1 + staleness) if self.late == "discount" else 1.0

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
    usage = (f"bad sync mode {spec!r}: use quorum:Q[:grace=G][:late=equal|discount] (Q >= 1 workers; G >= 0, a "
             f"share of recent round time, or Gs seconds)")
    try:
        q = int(parts[0])
    except (ValueError, IndexError):
        raise ValueError(usage) from None
    grace, in_s, late = DEFAULT_GRACE, False, "equal"
    for opt in parts[1:]:
        name, _, value = opt.partition("=")
        if name == "late" and value in LATE_WEIGHTS:
            late = value
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
    return SyncMode("quorum", q, grace, in_s, late)


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
