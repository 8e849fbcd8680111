"""Counter-based random numbers, defined by integer arithmetic so every back end agrees bit for bit.

hash32 is a 32-bit xorshift-multiply mixer (lowbias32 shape) with multipliers below 2**31, so on
the CPU it runs in torch int64 without overflow; the CuPy kernels in compression.cuda repeat it in
uint64. Element i of stream `s` maps to hash32((i * GOLDEN + s) mod 2**32).
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
C1 = 0x7FEB352D
C2 = 0x5BD1E995
FEISTEL_ROUNDS = 4


def seed32(seed: int, stream: int = 0) -> int:
    """32-bit key from a (seed, stream) pair (splitmix64 finaliser, pure Python)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(stream) * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & M32


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """In-place mix of int64 values in [0, 2**32)."""
    x ^= x >> 16
    x.mul_(C1).bitwise_and_(M32)
    x ^= x >> 15
    x.mul_(C2).bitwise_and_(M32)
    x ^= x >> 16
    return x


def uniform(start: int, count: int, key: int, device="cpu") -> torch.Tensor:
    """float32 U[0,1) (multiples of 2**-24) for elements start..start+count-1 of stream `key`."""
    x = torch.arange(start, start + count, dtype=torch.int64, device=device)
    x.mul_(GOLDEN).add_(key).bitwise_and_(M32)
    hash32_(x)
    return (x >> 8).to(torch.float32).mul_(2.0 ** -24)


def feistel_params(n: int) -> tuple[int, int]:
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    return bits // 2, (1 << (bits // 2)) - 1


def feistel(x: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """A seeded bijection on [0, 4**h) >= [0, n) (balanced Feistel network, int64 in [0, 2**32))."""
    h, mask = feistel_params(n)
    left, right = x >> h, x & mask
    for r in range(FEISTEL_ROUNDS):
        f = hash32_((right ^ seed32(seed, r + 1)).bitwise_and_(M32)).bitwise_and_(mask)
        left, right = right, left ^ f
    return (left << h) | right


def random_subset(n: int, k: int, seed: int, device="cpu") -> torch.Tensor:
    """k distinct indices of [0, n), ascending int64: a seeded permutation (cycle-walked) of 0..k-1."""
    if n >= 1 << 32:
        raise ValueError("random_subset supports n < 2**32")
    x = feistel(torch.arange(k, dtype=torch.int64, device=device), n, seed)
    while True:
        out = x >= n
        if not bool(out.any()):
            break
        x[out] = feistel(x[out], n, seed)
    return torch.sort(x).values
