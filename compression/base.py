"""The codec seam (as in GRACE): a codec turns a tensor into a Payload and back.

A Payload is self-describing: its header carries every parameter the receiver needs (ratio, scale,
seed, ...), so a parameter server decodes it without knowing the sender's spec string.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


class CodecError(ValueError):
    """A payload or spec is malformed (truncated body, unknown codec, bad parameter)."""


@dataclass
class Payload:
    codec: str                      # registry name, e.g. "topk"
    shape: tuple[int, ...]          # shape of the original tensor
    dtype: str                      # dtype of the original tensor, e.g. "float32"
    data: bytes | memoryview        # the body that travels
    header: dict = field(default_factory=dict)  # small, msgpack-able

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class Codec:
    """Base class. Subclasses set `name` and implement compress/decompress."""

    name = "base"
    lossy = True
    default_error_feedback = False
    stateful = False    # keeps per-key state on the sender (compress(..., key=...)); see DGC. Not a pull codec
    # "whole" | "balanced": compresses a matrix key as (rows, cols) (lowrank), so the layout cuts matrices at whole rows:
    # only past the key size (whole) or also into row blocks that even out the shards' bytes (balanced, weighed by
    # shaped_wire_nbytes); "": flat keys
    matrix_keys = ""

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Dense CPU tensor of payload.shape / payload.dtype."""
        raise NotImplementedError

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int | None:
        """Body size compress() would produce (None: unknown until compressed)."""
        return None

    def shaped_wire_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int | None:
        """Body size of a tensor of `shape` — a matrix codec's depends on the shape, not only the count (the
        layout balances a matrix-keyed job's shards by it); None: unknown until compressed."""
        return self.wire_nbytes(math.prod(shape), dtype)

    def accumulate(self, payload: Payload, out: torch.Tensor, alpha: float = 1.0) -> None:
        """out.view(-1) += alpha * decompress(payload), decoded where `out` lives. Sparse codecs override with a
        scatter-add."""
        out.view(-1).add_(self.decode_float32(payload, out.device).view(-1).to(out.dtype), alpha=alpha)

    def decode_float32(self, payload: Payload, device: torch.device) -> torch.Tensor:
        """The payload's values in float32 on `device`, not rounded to the payload's dtype: what error feedback
        takes off its memory and what a float32 sum (the shard's, a pull's) adds must be the same numbers."""
        if payload.dtype == "float32":
            return self.decompress_on(payload, device)
        where = device if device.type == "cpu" or self.decodes_on_device else torch.device("cpu")
        buf = torch.empty(payload.shape, dtype=torch.float32, device=where)
        self.decompress(payload, out=buf)     # fills buf (what it returns may be cast to the payload's dtype)
        return buf.to(device)

    def compress_leaving(self, tensor: torch.Tensor, residual: torch.Tensor, *, seed: int = 0,
                         key: str | None = None) -> Payload:
        """compress(tensor), and residual.view(-1) -= what the payload decodes to (error feedback's memory update).
        Codecs that know their decoded values without parsing their own payload override it."""
        payload = self.compress(tensor, seed=seed, key=key)
        self.accumulate(payload, residual, alpha=-1.0)
        return payload

    decodes_on_device = False   # decompress(payload, out=<a GPU tensor>) decodes there: only the payload crosses

    def decompress_on(self, payload: Payload, device: torch.device) -> torch.Tensor:
        """decompress(payload) as a tensor on `device` (a GPU worker's error feedback, a GPU pull target)."""
        if device.type == "cpu":
            return self.decompress(payload)
        if self.decodes_on_device:
            return self.decompress(payload, out=torch.empty(payload.shape, device=device))
        return self.decompress(payload).to(device)

    def spec(self) -> str:
        return self.name


TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise CodecError(f"unsupported dtype {dtype}")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise CodecError(f"unsupported dtype {name!r}") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a tensor (contiguous CPU copy only when needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)      # flat: memoryview cannot cast a shape such as (4, 0)
    if t.dtype == torch.bfloat16:
        return memoryview(t.view(torch.int16).numpy()).cast("B")
    return memoryview(t.numpy()).cast("B")


def tensor_from_bytes(data, dtype: str, shape) -> torch.Tensor:
    """Zero-copy view of received bytes as a tensor (read-only buffers are copied once)."""
    dt = torch_dtype(dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if len(data) != numel * itemsize:
        raise CodecError(f"body has {len(data)} bytes, expected {numel * itemsize} for {dtype}{list(shape)}")
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dt)
    buf = bytearray(data) if isinstance(data, bytes) else data
    return torch.frombuffer(buf, dtype=dt).view(tuple(shape))


class NoneCodec(Codec):
    """Identity: raw bytes of the tensor."""

    name = "none"
    lossy = False

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        return Payload(self.name, tuple(tensor.shape), dtype_name(tensor.dtype), tensor_bytes(tensor))

    def decompress(self, payload: Payload) -> torch.Tensor:
        return tensor_from_bytes(payload.data, payload.dtype, payload.shape)

    def decode_float32(self, payload: Payload, device: torch.device) -> torch.Tensor:
        return self.decompress(payload).to(device, torch.float32)     # raw values: exact in float32 from 16 bits

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * torch.empty((), dtype=dtype).element_size()


_REGISTRY: dict[str, Callable[..., Codec]] = {}


def register(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory
    return deco


register("none")(NoneCodec)


def available_codecs() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def parse_spec(spec: str) -> tuple[str, dict]:
    """'topk:ratio=0.01,seed=3' -> ('topk', {'ratio': 0.01, 'seed': 3})."""
    spec = (spec or "none").strip()
    name, _, rest = spec.partition(":")
    params: dict = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise CodecError(f"bad codec parameter {item!r} in spec {spec!r} (want key=value)")
        if k.strip() in params:
            raise CodecError(f"codec parameter {k.strip()!r} given twice in spec {spec!r}")
        params[k.strip()] = _parse_value(v.strip())
    return name.strip().lower(), params


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _load_builtin() -> None:
    # Codec modules register themselves on import; missing ones are simply not offered.
    import importlib
    for mod in ("compression.codecs",):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def codec_factory(name: str) -> Callable[..., Codec]:
    """The registered factory of a codec name; an unknown name raises CodecError listing the known ones."""
    _load_builtin()
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return factory


def get_codec(spec: str) -> Codec:
    """Build a codec from a spec string; unknown names or parameters raise CodecError."""
    name, params = parse_spec(spec)
    factory = codec_factory(name)
    try:
        return factory(**params)
    except TypeError as e:
        raise CodecError(f"bad parameters for codec {name!r}: {e}") from None
