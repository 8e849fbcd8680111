"""Sparse codecs: topk (indices + values) and randk (values only; indices regenerated from a seed).

topk body: the k values in the tensor's dtype (ascending index order), then the index section;
header {k, n, enc} plus {bits, i0} when enc == "bp". The index section is either
  enc="u16": k uint16 indices (only when n <= 65536), or
  enc="bp":  idx[0] in header["i0"], then the k-1 gaps minus one bit-packed at header["bits"] bits,
whichever is smaller (layout in compression.wire). randk body: the values; header {k, n, seed}.
dgc reuses the topk layout.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from compression import buffers, cuda, rng, wire
from compression.base import Codec, CodecError, Payload, register
from compression.codecs.common import flat, make_payload
from compression.wire import check_payload, header_int, new_body, read_body, value_dtype

SAMPLE = 65536


def k_for(ratio: float, n: int) -> int:
    return min(n, max(1, math.ceil(ratio * n)))


def check_ratio(name: str, ratio) -> float:
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise CodecError(f"{name}: ratio must be in (0, 1], got {ratio!r}")
    return float(ratio)


def _at_least(x: torch.Tensor, t: float) -> torch.Tensor:
    """Ascending int64 indices of |x| >= t. NumPy, block by block: its abs/compare/flatnonzero pass is
    ~3x cheaper than torch's nonzero on CPU, and the block temporaries stay in L2."""
    xn = x.numpy()
    n = xn.size
    tmp = np.empty(min(n, buffers.BLOCK), dtype=xn.dtype)
    mask = np.empty(tmp.size, dtype=bool)
    parts = []
    for a, b in buffers.blocks(n):
        m = np.greater_equal(np.abs(xn[a:b], out=tmp[:b - a]), t, out=mask[:b - a])
        hits = np.flatnonzero(m)
        if hits.size:
            parts.append(hits + a)
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.int64)


def topk_indices(x: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """Indices of exactly the k largest |x| (ties: lower index first), ascending int64.

    Threshold from the top of a random sample (a bit below the expected k-th value), candidates
    = |x| >= threshold block by block, then exact selection among the candidates. The result does
    not depend on the sample, so every back end returns the same indices."""
    if cuda.wants(x):
        return cuda.topk_select(x, k, seed)
    n = x.numel()
    if k >= n:
        return torch.arange(n)
    cand = None
    if n > 4 * SAMPLE:
        pick = np.random.default_rng(seed & ((1 << 63) - 1)).integers(0, n, SAMPLE)   # ~6x cheaper than torch's
        sample = torch.from_numpy(np.abs(x.numpy()[pick]))
        ks = min(SAMPLE, int(SAMPLE * k / n * 1.25 + 3 * (SAMPLE * k / n) ** 0.5) + 2)
        while ks < SAMPLE:
            t = float(torch.topk(sample, ks, sorted=False).values.min())
            cand = _at_least(x, t)
            if cand.numel() >= k:
                break
            cand, ks = None, ks * 4
    if cand is None:
        cand = torch.arange(n)
    ca = x[cand].abs_()
    m = ca.numel()
    vk = torch.kthvalue(ca, m - k + 1).values  # k-th largest
    gt = ca > vk
    eq = ca == vk
    keep = gt | (eq & (torch.cumsum(eq, 0) <= k - int(gt.sum())))
    return cand[keep]


class SparseCodec(Codec):
    """Decode/accumulate for index+value bodies; subclasses define compress."""

    default_error_feedback = True
    carries_indices = True
    decodes_on_device = True    # indices decode on the host, the scatter runs where the target lives

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Upper bound (exact for randk): values plus the worst-case index section."""
        k = k_for(self.ratio, numel) if numel else 0
        vals = k * torch.empty((), dtype=dtype).element_size()
        return vals + (wire.index_nbytes_bound(numel, k) if self.carries_indices else 0)

    def _encode(self, tensor: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, header: dict) -> Payload:
        k, n = idx.numel(), src.numel()
        sections = [(tensor.dtype, k)]
        if self.carries_indices:
            if idx.device.type == "cpu":
                ihdr, isec = wire.encode_indices(idx.numpy(), n)
                isec = torch.from_numpy(isec)
            else:
                ihdr, isec = cuda.encode_indices(idx, n)
            header = {**header, **ihdr}
            sections.append((torch.uint8, isec.numel()))
        body, views = new_body(sections)
        views[0].copy_(src[idx])
        if self.carries_indices:
            views[1].copy_(isec)
        return make_payload(self.name, tensor, body, {"k": k, "n": n, **header})

    def _index_sections(self, payload: Payload, n: int, k: int):
        """Index body sections after the values, and the validated header fields to decode them."""
        enc, bits, i0, nbytes = wire.index_section(payload, n, k)
        return [(torch.uint8, nbytes)], (enc, bits, i0)

    def indices(self, payload: Payload, n: int, k: int, body: list, info) -> torch.Tensor:
        return wire.decode_indices(payload, n, k, *info, body[1])

    def _read(self, payload: Payload):
        """(n, int64 indices, values) of a validated payload; CodecError on anything inconsistent."""
        n = check_payload(payload)
        if header_int(payload, "n", 0) != n:
            raise CodecError(f"{payload.codec}: header n={payload.header['n']} does not match shape {payload.shape}")
        k = header_int(payload, "k", 0, n)
        isections, info = self._index_sections(payload, n, k)
        body = read_body(payload, [(value_dtype(payload), k)] + isections)
        return n, self.indices(payload, n, k, body, info), body[0]

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        n, idx, vals = self._read(payload)
        dt = value_dtype(payload)
        if out is None:
            flat = buffers.zeros(n, dt)
        elif out.numel() != n:
            raise CodecError(f"{payload.codec}: out has {out.numel()} elements, need {n}")
        else:
            flat = out.view(-1).zero_()
        flat.index_copy_(0, idx.long().to(flat.device), vals.to(flat.device, flat.dtype))
        return flat.view(payload.shape) if out is None else out

    def accumulate(self, payload: Payload, out: torch.Tensor, alpha: float = 1.0) -> None:
        n, idx, vals = self._read(payload)
        if out.numel() != n:
            raise CodecError(f"{payload.codec}: accumulate into {out.numel()} elements, payload has {n}")
        scatter_add(out, idx, vals, alpha)


def scatter_add(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, alpha: float = 1.0) -> None:
    """out.view(-1)[idx] += alpha * vals, where `out` lives (a shard's sum, a worker's error-feedback residual)."""
    dst = out.view(-1)
    dst.index_add_(0, idx if dst.device.type == "cpu" else idx.to(dst.device), vals.to(dst.device, dst.dtype),
                   alpha=alpha)


@register("topk")
class TopKCodec(SparseCodec):
    """Exactly k = max(1, ceil(ratio*n)) largest |g|."""

    name = "topk"

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio("topk", ratio)

    def spec(self) -> str:
        return f"topk:ratio={self.ratio}"

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        x = flat(tensor)
        idx = topk_indices(x if x.dtype == torch.float32 else x.float(), k_for(self.ratio, x.numel()), seed)
        return self._encode(tensor, idx, x, {})


@register("randk")
class RandKCodec(SparseCodec):
    """k uniformly random distinct indices, regenerated by the receiver from header["seed"]."""

    name = "randk"
    carries_indices = False

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio("randk", ratio)

    def spec(self) -> str:
        return f"randk:ratio={self.ratio}"

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        x = flat(tensor)
        n = x.numel()
        seed = int(seed) & ((1 << 63) - 1)
        k = k_for(self.ratio, n)
        idx = cuda.random_subset(n, k, seed, x.device) if cuda.wants(x) else rng.random_subset(n, k, seed)
        return self._encode(tensor, idx, x, {"seed": seed})

    def _index_sections(self, payload: Payload, n: int, k: int):
        return [], None

    def indices(self, payload: Payload, n: int, k: int, body: list, info) -> torch.Tensor:
        seed = header_int(payload, "seed", 0)
        return rng.random_subset(n, k, seed) if n else torch.empty(0, dtype=torch.int64)
