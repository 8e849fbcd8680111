"""Helpers shared by the codec modules (CPU paths; CUDA tensors dispatch to compression.cuda)."""
from __future__ import annotations

import numpy as np
import torch

from compression import buffers, cuda
from compression.base import CodecError, Payload, dtype_name
from compression.wire import MAX_NUMEL, value_dtype

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_bits(codec: str, bits, allowed: tuple[int, ...]) -> int:
    """A codec's bits option: an int (not a float or bool that compares equal) among `allowed`."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in allowed:
        raise CodecError(f"{codec}: bits must be an int, one of {allowed}, got {bits!r}")
    return bits


def check_scales(codec: str, scales: torch.Tensor) -> None:
    """Scales are the encoder's max |x| per chunk or column: finite and >= 0, or the payload is corrupt (a negative
    one flips its values' signs, a NaN or Inf poisons the shard's sum)."""
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError(f"{codec}: a scale in the payload is negative, NaN or Inf: corrupt payload")


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """1-D view/copy of a gradient, on the CPU unless the CuPy back end can take it;
    rejects non-float or oversized tensors."""
    if tensor.dtype not in FLOATS:
        raise CodecError(f"cannot compress a {tensor.dtype} tensor (floating point only)")
    if tensor.numel() > MAX_NUMEL:
        raise CodecError(f"tensor of {tensor.numel()} elements exceeds the int32 index range")
    x = tensor.detach().reshape(-1)
    if x.device.type != "cpu" and not cuda.wants(x):
        x = x.cpu()  # no CuPy back end: compress on the CPU (same bytes)
    return x


def flat_float(tensor: torch.Tensor) -> torch.Tensor:
    """flat() as contiguous float32."""
    x = flat(tensor)
    return (x if x.dtype == torch.float32 else x.float()).contiguous()


def make_payload(codec: str, tensor: torch.Tensor, body: torch.Tensor, header: dict) -> Payload:
    from compression.wire import to_wire
    return Payload(codec, tuple(tensor.shape), dtype_name(tensor.dtype), to_wire(body), header)


def chunk_blocks(n: int, chunk: int):
    """Row blocks of whole chunks: (elem_start, elem_stop, row_start, rows, width); the ragged tail
    chunk comes last as its own 1-row block."""
    nfull = n // chunk
    per = max(1, buffers.BLOCK // chunk)
    for r0 in range(0, nfull, per):
        r1 = min(nfull, r0 + per)
        yield r0 * chunk, r1 * chunk, r0, r1 - r0, chunk
    if n % chunk:
        yield nfull * chunk, n, nfull, 1, n - nfull * chunk


def nchunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def padded_rows(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """A flat float32 tensor zero-padded to whole chunks, as an (nchunks, chunk) grid: one row per scale (a view of x
    when it holds whole chunks: read it, do not write it)."""
    if x.numel() % chunk == 0 and x.is_contiguous():
        return x.view(-1, chunk)
    grid = torch.zeros(nchunks(x.numel(), chunk) * chunk)
    grid[:x.numel()] = x
    return grid.view(-1, chunk)


def decode_target(payload: Payload, n: int, out: torch.Tensor | None):
    """float32 1-D buffer to decode into, and a finisher giving the tensor to return."""
    dt = value_dtype(payload)
    if out is not None and out.numel() != n:
        raise CodecError(f"{payload.codec}: out has {out.numel()} elements, need {n}")
    if out is not None and out.dtype == torch.float32 and out.is_contiguous():
        flat = out.view(-1)
        return flat, lambda: out.view(payload.shape) if dt == torch.float32 else flat.to(dt).view(payload.shape)
    # decoding on a GPU: the decoded values stay there (only the payload sections cross)
    flat = buffers.empty(n) if out is None or out.device.type == "cpu" else torch.empty(n, device=out.device)

    def finish():
        if out is not None:
            out.view(-1).copy_(flat)
            return out
        return (flat if dt == torch.float32 else flat.to(dt)).view(payload.shape)
    return flat, finish


def absmax(x: torch.Tensor) -> float:
    if cuda.wants(x):
        return cuda.absmax(x)
    return float(x.abs().max()) if x.numel() else 0.0


def fixed_sum(x: torch.Tensor, c: float, power: int) -> int:
    """sum(trunc((|x|*c)**power)) computed exactly, hence identical on every back end."""
    if cuda.wants(x):
        return cuda.fixed_sum(x, c, power)
    total = 0
    for a, b in buffers.blocks(x.numel()):
        y = x[a:b].abs().mul_(c)
        if power == 2:
            y.mul_(y)
        total += int(y.trunc_().sum(dtype=torch.float64))  # block sums of ints < 2**53: exact
    return total


def det_abs_mean(x: torch.Tensor) -> float:
    """mean |x| in a back-end-independent way (fixed point relative to max |x|, 24 bits)."""
    m = absmax(x)
    if m == 0.0 or not np.isfinite(m):
        return 0.0 if m == 0.0 else m
    c = float(np.float32(2.0 ** 24) / np.float32(m))
    return fixed_sum(x, c, 1) / x.numel() / c


def det_l2norm(x: torch.Tensor) -> float:
    m = absmax(x)
    if m == 0.0 or not np.isfinite(m):
        return m
    c = float(np.float32(2.0 ** 12) / np.float32(m))
    return float(np.sqrt(fixed_sum(x, c, 2))) / c


def odd_level_codes(x: torch.Tensor, scales: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes in [0, levels] of x on `levels` odd multiples of scale / levels (no zero level): round((x / scale x L +
    L) / 2). A zero scale, or a subnormal one whose reciprocal overflows float32 (a dead unit's rows after many Adam
    steps: 0 x inf would be NaN), gives the middle codes, which decode to +-scale / L; error feedback keeps the rest."""
    half = levels / 2
    per_unit = (half / torch.where(scales > 0, scales, 1.0)).nan_to_num_(posinf=0.0)
    return (x * per_unit).add_(half).round_().clamp_(0, levels)   # one copy of x


def odd_level_values(codes: torch.Tensor, scales: torch.Tensor, levels: int) -> torch.Tensor:
    """The float32 values odd_level_codes stand for (encoder and decoder alike: a worker's error feedback subtracts
    exactly what the shards add)."""
    return (2 * codes - levels).to(torch.float32) / levels * scales
