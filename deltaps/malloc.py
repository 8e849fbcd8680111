"""glibc malloc tuning for processes that allocate many large, short-lived tensors.

By default glibc serves allocations above 128 KiB with fresh mmap()s and returns them on free, so every
gradient copy, codec buffer and decoded delta page-faults its memory in again (profiling a worker of
the bench model showed ~40 % of its busy time in first-touch copies). Raising the mmap and trim
thresholds keeps freed blocks in the heap for reuse. Opt out with DELTAPS_MALLOC_TUNING=0.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def tune_malloc(mmap_threshold: int = 1 << 30, trim_threshold: int = 4 << 30) -> bool:
    """Apply the thresholds; False where not glibc or opted out."""
    if os.environ.get("DELTAPS_MALLOC_TUNING", "1") == "0":
        return False
    try:    # the running interpreter's own symbols (no find_library: it spawns ldconfig/gcc)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # M_MMAP_THRESHOLD is capped by glibc at HEAP_MAX / 2 (32 MiB on 64-bit); ask, accept what it takes.
    ok = bool(mallopt(M_MMAP_THRESHOLD, min(mmap_threshold, 32 << 20)))
    ok &= bool(mallopt(M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)))
    return ok
