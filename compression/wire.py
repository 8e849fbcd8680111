"""Body layout and validation helpers shared by the codecs.

A body is a concatenation of typed sections; each section starts at a multiple of its item size.
Decoders validate everything a malicious or truncated payload could get wrong and raise CodecError.
"""
from __future__ import annotations

import math
import warnings

import torch

from compression import buffers
from compression.base import CodecError, Payload, TORCH_DTYPES

MAX_NUMEL = (1 << 31) - 1  # indices travel as int32


def _layout(sections):
    offsets, off = [], 0
    for dtype, count in sections:
        size = torch.empty((), dtype=dtype).element_size()
        off = -(-off // size) * size
        offsets.append(off)
        off += size * int(count)
    return offsets, off


def body_size(sections) -> int:
    return _layout(sections)[1]


def new_body(sections) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A uint8 body plus typed 1-D views of its sections, to be filled in place."""
    offsets, total = _layout(sections)
    body = buffers.empty(total, torch.uint8)
    views = [body[o:o + torch.empty((), dtype=dt).element_size() * int(c)].view(dt)
             for o, (dt, c) in zip(offsets, sections)]
    return body, views


def to_wire(body: torch.Tensor) -> memoryview:
    return memoryview(body.numpy()).cast("B")


def read_body(payload: Payload, sections) -> list[torch.Tensor]:
    """Read-only typed views of a received body; raises CodecError when its size is wrong."""
    offsets, total = _layout(sections)
    data = payload.data
    try:
        nbytes = memoryview(data).nbytes
    except TypeError:
        raise CodecError(f"{payload.codec}: body is {type(data).__name__}, not bytes") from None
    if nbytes != total:
        raise CodecError(f"{payload.codec}: body has {nbytes} bytes, expected {total} "
                         f"(truncated or corrupt payload)")
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: we never write to these views
        for o, (dt, c) in zip(offsets, sections):
            if int(c) == 0:
                out.append(torch.empty(0, dtype=dt))
            else:
                out.append(torch.frombuffer(data, dtype=dt, count=int(c), offset=o))
    return out


def check_payload(payload: Payload) -> int:
    """Validate shape/dtype; return numel."""
    shape = payload.shape
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                        and s >= 0 for s in shape):
        raise CodecError(f"{payload.codec}: bad shape {shape!r}")
    if payload.dtype not in TORCH_DTYPES or payload.dtype.startswith("int"):
        raise CodecError(f"{payload.codec}: unsupported dtype {payload.dtype!r}")
    if not isinstance(payload.header, dict):
        raise CodecError(f"{payload.codec}: header is not a dict")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise CodecError(f"{payload.codec}: {numel} elements exceed the int32 index range")
    return numel


def header_int(payload: Payload, name: str, lo: int, hi: int | None = None) -> int:
    v = payload.header.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CodecError(f"{payload.codec}: header field {name!r}={v!r} is not an int in {rng}")
    return v


def header_float(payload: Payload, name: str) -> float:
    v = payload.header.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise CodecError(f"{payload.codec}: header field {name!r}={v!r} is not a finite number")
    return float(v)


def value_dtype(payload: Payload) -> torch.dtype:
    return TORCH_DTYPES[payload.dtype]
