"""CuPy back end, used for CUDA tensors. It repeats the CPU arithmetic exactly (IEEE ops via
__f*_rn intrinsics so nothing is contracted into an FMA; the same integer hash), so payload bytes
match the CPU path. cupy is imported lazily; without it CUDA tensors are compressed on the CPU.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from compression import rng

_HASH = r"""
__device__ __forceinline__ unsigned long long h32(unsigned long long x) {
    x ^= x >> 16; x = (x * 0x7FEB352DULL) & 0xFFFFFFFFULL;
    x ^= x >> 15; x = (x * 0x5BD1E995ULL) & 0xFFFFFFFFULL;
    x ^= x >> 16; return x;
}
"""


@functools.cache
def _cupy():
    try:
        import cupy
        return cupy if cupy.is_available() else None
    except Exception:  # ImportError, or a broken CUDA install
        return None


def wants(tensor: torch.Tensor) -> bool:
    """True when `tensor` lives on a GPU and the CuPy back end can run."""
    return tensor.device.type == "cuda" and _cupy() is not None


def to_cupy(t: torch.Tensor):
    return _cupy().from_dlpack(t.detach().contiguous())


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


@functools.cache
def _kernels():
    cp = _cupy()
    ek = cp.ElementwiseKernel
    return {
        "int8": ek("float32 x, raw float32 scale, int64 chunk", "int8 q", """
            float s = scale[i / chunk]; if (s == 0.0f) s = 1.0f;
            q = (signed char) rintf(__fdiv_rn(x, s));""", "deltaps_int8"),
        "qsgd": ek("float32 x, raw float32 m, int64 chunk, float32 levels, uint64 key", "int8 q", """
            float mm = m[i / chunk]; if (mm == 0.0f) mm = 1.0f;
            unsigned long long h = h32(((unsigned long long) i * 0x9E3779B1ULL + key) & 0xFFFFFFFFULL);
            float u = (float) (h >> 8) * 5.9604644775390625e-08f;
            float l = floorf(__fadd_rn(__fmul_rn(__fdiv_rn(fabsf(x), mm), levels), u));
            if (l > levels) l = levels;
            q = (signed char) (x < 0.0f ? -l : l);""", "deltaps_qsgd", preamble=_HASH),
        "fixsum1": ek("float32 x, float32 c", "int64 t",
                      "t = (long long) truncf(__fmul_rn(fabsf(x), c));", "deltaps_fix1"),
        "fixsum2": ek("float32 x, float32 c", "int64 t",
                      "float y = __fmul_rn(fabsf(x), c); t = (long long) truncf(__fmul_rn(y, y));",
                      "deltaps_fix2"),
        "signbits": ek("raw float32 x, int64 n", "uint8 b", """
            unsigned int v = 0;
            for (int j = 0; j < 8; ++j) { long long e = (long long) i * 8 + j; if (e < n && x[e] < 0.0f) v |= 1u << j; }
            b = (unsigned char) v;""", "deltaps_signbits"),
        "bf16": ek("float32 x", "int16 y", """
            unsigned int u = __float_as_uint(x);
            y = (short) (isnan(x) ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);""",
                   "deltaps_bf16"),
        "feistel": ek("int64 j, int64 n, int32 h, uint64 mask, raw uint64 keys", "int64 out", """
            unsigned long long x = (unsigned long long) j;
            do {
                unsigned long long L = x >> h, R = x & mask;
                for (int r = 0; r < 4; ++r) {
                    unsigned long long t = L ^ (h32((R ^ keys[r]) & 0xFFFFFFFFULL) & mask); L = R; R = t;
                }
                x = (L << h) | R;
            } while (x >= (unsigned long long) n);
            out = (long long) x;""", "deltaps_feistel", preamble=_HASH),
        # one output word per thread: OR in every value overlapping stream bits [64i, 64i + 64)
        "bitpack": ek("raw uint64 d, int64 m, int64 bits", "uint64 w", """
            long long lo = (long long) i * 64;
            long long j = lo / bits, last = (lo + 63) / bits;
            if (last > m - 1) last = m - 1;
            unsigned long long acc = 0;
            for (; j <= last; ++j) {
                long long s = j * bits - lo;
                acc |= s >= 0 ? d[j] << s : d[j] >> (-s);
            }
            w = acc;""", "deltaps_bitpack"),
    }


def _chunk_absmax(x, chunk: int):
    cp = _cupy()
    n = x.size
    nfull, tail = divmod(n, chunk)
    out = cp.empty(nfull + (tail > 0), dtype=cp.float32)
    if nfull:
        out[:nfull] = cp.abs(x[:nfull * chunk].reshape(nfull, chunk)).max(axis=1)
    if tail:
        out[nfull] = cp.abs(x[nfull * chunk:]).max()
    return out


def int8_encode(x: torch.Tensor, chunk: int, inv127: float):
    """(scales float32, q int8) as torch CUDA tensors."""
    xc = to_cupy(x)
    scale = _chunk_absmax(xc, chunk) * np.float32(inv127)
    q = _kernels()["int8"](xc, scale, np.int64(chunk))
    return to_torch(scale), to_torch(q)


def qsgd_encode(x: torch.Tensor, chunk: int, levels: int, key: int):
    xc = to_cupy(x)
    m = _chunk_absmax(xc, chunk)
    q = _kernels()["qsgd"](xc, m, np.int64(chunk), np.float32(levels), np.uint64(key))
    return to_torch(m), to_torch(q)


def fixed_sum(x: torch.Tensor, c: float, power: int) -> int:
    """sum(trunc((|x|*c)**power)) exactly (integer sum: order-independent)."""
    t = _kernels()["fixsum1" if power == 1 else "fixsum2"](to_cupy(x), np.float32(c))
    return int(t.sum())


def absmax(x: torch.Tensor) -> float:
    return float(_cupy().abs(to_cupy(x)).max()) if x.numel() else 0.0


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    cp = _cupy()
    n = x.numel()
    out = cp.empty((n + 7) // 8, dtype=cp.uint8)
    _kernels()["signbits"](to_cupy(x), np.int64(n), out)
    return to_torch(out)


def to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return to_torch(_kernels()["bf16"](to_cupy(x)))


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    return to_torch(to_cupy(x).astype(_cupy().float16))


def random_subset(n: int, k: int, seed: int, device) -> torch.Tensor:
    cp = _cupy()
    h, mask = rng.feistel_params(n)
    keys = cp.asarray(np.array([rng.seed32(seed, r + 1) for r in range(rng.FEISTEL_ROUNDS)], dtype=np.uint64))
    out = _kernels()["feistel"](cp.arange(k, dtype=cp.int64), np.int64(n), np.int32(h), np.uint64(mask), keys)
    return to_torch(cp.sort(out))


def topk_select(x: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Same contract as codecs.sparse.topk_indices: exact k largest |x|, ties to the lower index,
    ascending int64. Threshold from a sample, then exact refinement among the candidates."""
    cp = _cupy()
    a = cp.abs(to_cupy(x))
    n = a.size
    if k >= n:
        return to_torch(cp.arange(n, dtype=cp.int64))
    cand = None
    if n > 4 * 65536:
        s = 65536
        sample = a[cp.random.RandomState(seed).randint(0, n, size=s)]
        ks = min(s, int(s * k / n * 1.25 + 3 * (s * k / n) ** 0.5) + 2)
        while ks < s:
            t = cp.partition(sample, s - ks)[s - ks]
            cand = cp.flatnonzero(a >= t)
            if cand.size >= k:
                break
            cand, ks = None, ks * 4
    if cand is None:
        cand = cp.arange(n, dtype=cp.int64)
    ca = a[cand]
    m = ca.size
    vk = cp.partition(ca, m - k)[m - k]
    gt = ca > vk
    eq = ca == vk
    keep = gt | (eq & (cp.cumsum(eq) <= k - int(gt.sum())))
    return to_torch(cand[keep])


def bitpack_words(d, bits: int, nwords: int):
    """wire.bitpack's stream as little-endian uint64 words (cupy), d: cupy uint64 values."""
    cp = _cupy()
    out = cp.empty(nwords, dtype=cp.uint64)
    _kernels()["bitpack"](d, np.int64(d.size), np.int64(bits), out)
    return out


def encode_indices(idx: torch.Tensor, n: int) -> tuple[dict, torch.Tensor]:
    """Same contract and bytes as wire.encode_indices, for CUDA int64 indices: (header fields,
    uint8 CUDA tensor)."""
    from compression import wire
    cp = _cupy()
    a = to_cupy(idx)
    k = int(a.size)
    gaps = cp.diff(a) - 1 if k > 1 else cp.zeros(0, dtype=cp.int64)
    i0 = int(a[0]) if k else 0
    enc, bits, nbytes = wire.choose_index_encoding(n, k, int(gaps.max()) if gaps.size else 0, i0)
    if enc == "u16":
        return {"enc": "u16"}, to_torch(a.astype(cp.uint16).view(cp.uint8))
    if k == 1:
        return {"enc": "bp", "bits": bits, "i0": i0}, torch.empty(0, dtype=torch.uint8, device=idx.device)
    words = bitpack_words(gaps.astype(cp.uint64), bits, -(-((k - 1) * bits) // 64))
    return {"enc": "bp", "bits": bits, "i0": i0}, to_torch(words.view(cp.uint8)[:nbytes])
