"""Sync modes: bsp (apply when all live workers pushed), asp (apply on arrival), ssp:S (bounded staleness)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncMode:
    kind: str          # "bsp" | "asp" | "ssp"
    bound: int = 0     # ssp staleness bound S

    def __str__(self) -> str:
        return f"ssp:{self.bound}" if self.kind == "ssp" else self.kind

    def pull_min_version(self, clock: int) -> int:
        """Version a worker at `clock` (steps completed) must see before it computes its next step."""
        if self.kind == "bsp":
            return clock
        if self.kind == "ssp":
            return max(0, clock - self.bound)
        return 0


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
    raise ValueError(f"unknown sync mode {spec!r}; use bsp, asp or ssp:S")
