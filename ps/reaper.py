"""A daemon thread that calls a check every tick for the life of the process (silent-worker eviction)."""
from __future__ import annotations

import logging
import threading
import time


def start_reaper(name: str, tick_s: float, check, log: logging.Logger) -> threading.Thread:
    """Run check() every tick_s seconds; an exception is logged and the next tick retries (it never dies)."""
    def loop():
        while True:
            time.sleep(tick_s)
            try:
                check()
            except Exception:  # noqa: BLE001 - the reaper must never die
                log.exception("%s: check failed", name)
    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def reaper_tick(worker_timeout_s: float) -> float:
    """Check five times per timeout, between 50 ms and 0.5 s."""
    return max(0.05, min(0.5, worker_timeout_s / 5))
