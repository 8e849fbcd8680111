"""A shard's counters and state as the Stats RPC reports them (one dict; StatsResponse's fields)."""
from __future__ import annotations

import threading
from collections import Counter


class Tally(Counter):
    """A Counter many server threads add to (a shard's counters, staleness and contributor tallies): `add` is one
    locked read-modify-write, where `c[k] += 1` from two threads can lose one of the increments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def add(self, key, n: int = 1) -> None:
        with self._lock:
            self[key] += n


def shard_stats(shard) -> dict:
    versions = [ks.version for ks in shard.keys.values()] or [0]
    hist = [0] * (max(shard.staleness, default=0) + 1)
    for s, n in shard.staleness.items():
        hist[s] = n
    return {
        "shard_id": shard.shard_id, "num_keys": len(shard.keys),
        "min_version": min(versions), "max_version": max(versions),
        "pushes": shard.counters["pushes"], "grads_applied": shard.counters["grads_applied"],
        "duplicates": shard.counters["duplicates"], "pulls": shard.counters["pulls"],
        "bytes_received": shard.counters["bytes_received"], "bytes_sent": shard.counters["bytes_sent"],
        "max_staleness": max(shard.staleness, default=0), "staleness_counts": hist,
        "sync": str(shard.job.sync) if shard.job else "", "live_workers": sorted(shard.live),
        "server_id": shard.server_id, "evictions": shard.counters["evictions"],
        "nonfinite_skipped": shard.counters["nonfinite_skipped"], "checkpoints": shard.counters["checkpoints"],
        "checkpoint_version": shard.checkpoint_version,
        "step_contributors": [shard.step_contributors.get(n, 0) for n in range(max(shard.step_contributors, default=-1) + 1)],
        "min_workers": shard.job.min_workers if shard.job else 0, "max_workers": shard.job.max_workers if shard.job else 0,
        "paused": shard.paused, "joins": shard.counters["rejoins"],
        "local_steps": shard.job.local_steps if shard.job else 0, "outer_updates": shard.counters["outer_updates"],
        "late_contributions": shard.counters["late_contributions"], "stopped": shard.stopped is not None,
    }
