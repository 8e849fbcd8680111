"""CommStats: the byte and time counters a client keeps (read by its metrics and its run's result)."""
from __future__ import annotations

import threading
from collections import defaultdict


class CommStats:
    """Thread-safe byte and time counters of one client."""

    def __init__(self):
        self.lock = threading.Lock()
        self.c = defaultdict(float)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                self.c[k] += v

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.c)
