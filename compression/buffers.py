"""Allocation and blocking helpers for the CPU back end.

Fresh multi-MiB tensors pay a page fault per 4 KiB page (~15 ms for 64 MiB); asking the kernel for
transparent huge pages (what torch's THP_MEM_ALLOC_ENABLE does) makes them several times cheaper.
"""
from __future__ import annotations

import ctypes
import sys

import torch

BLOCK = 1 << 18          # elements per block: temporaries of a block stay in L2
_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
_libc = None


def _madvise_huge(ptr: int, nbytes: int) -> None:
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
        end = (ptr + nbytes) & ~(_HUGE - 1)
        if end > start:
            _libc.madvise(start, end - start, _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        _libc = False  # not available: plain pages


def empty(numel: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """Uninitialised 1-D tensor; large CPU ones are backed by huge pages when the OS allows."""
    t = torch.empty(numel, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel() * t.element_size() >= 4 * _HUGE and _libc is not False:
        _madvise_huge(t.data_ptr(), t.numel() * t.element_size())
    return t


def zeros(numel: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    return empty(numel, dtype, device).zero_()


def blocks(n: int, block: int = BLOCK):
    """(start, stop) ranges covering [0, n)."""
    for a in range(0, n, block):
        yield a, min(n, a + block)
