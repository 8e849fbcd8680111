"""Log lines about refused requests, at most one per (peer, reason) per interval, with the count of the lines
it held back: a client with a bug, or anyone who can reach the port, cannot flood the log."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict


class RefusalLog:
    def __init__(self, logger: logging.Logger, every_s: float = 10.0, max_keys: int = 1024):
        self.log, self.every_s, self.max_keys = logger, every_s, max_keys
        self._lock = threading.Lock()
        self._last: OrderedDict[tuple[str, str], list] = OrderedDict()   # key -> [last logged, held back]
        self.suppressed = 0                                               # lines held back, all keys

    def refused(self, peer: str, reason: str, message: str) -> bool:
        """Log `message` unless this (peer, reason) logged within every_s; True when a line was written."""
        key, now = (peer, reason), time.monotonic()
        with self._lock:
            entry = self._last.get(key)
            if entry is not None and now - entry[0] < self.every_s:
                entry[1] += 1
                self.suppressed += 1
                return False
            held = entry[1] if entry is not None else 0
            self._last[key] = [now, 0]
            self._last.move_to_end(key)
            while len(self._last) > self.max_keys:      # many peers: forget the least recent
                self._last.popitem(last=False)
        self.log.warning("%s%s", message, f" (+{held} more from {peer} not logged)" if held else "")
        return True
