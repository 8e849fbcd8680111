"""Receiver side: decode or accumulate a payload knowing only payload.codec and payload.header."""
from __future__ import annotations

import functools

import torch

from compression.base import Codec, CodecError, Payload, codec_factory
from compression.wire import check_payload

_CORRUPT = (RuntimeError, ValueError, TypeError, IndexError, KeyError, OverflowError)


@functools.cache
def decoder(name: str) -> Codec:
    """A default-constructed codec used only for decoding (decoders read parameters from headers)."""
    return codec_factory(name)()


def _checked(payload: Payload) -> Codec:
    if not isinstance(payload, Payload):
        raise CodecError(f"expected a Payload, got {type(payload).__name__}")
    codec = decoder(payload.codec)
    check_payload(payload)
    return codec


def decode_payload(payload: Payload) -> torch.Tensor:
    """Dense CPU tensor (payload.shape, payload.dtype); CodecError on any malformed payload."""
    codec = _checked(payload)
    try:
        return codec.decompress(payload)
    except CodecError:
        raise
    except _CORRUPT as e:
        raise CodecError(f"corrupt {payload.codec} payload: {e}") from None


def accumulate_payload(payload: Payload, out: torch.Tensor, alpha: float = 1.0) -> None:
    """out += alpha * decoded payload (sparse codecs scatter-add; nothing is densified)."""
    codec = _checked(payload)
    if out.numel() != payload.numel:
        raise CodecError(f"{payload.codec}: payload has {payload.numel} elements, out has {out.numel()}")
    try:
        codec.accumulate(payload, out, alpha)
    except CodecError:
        raise
    except _CORRUPT as e:
        raise CodecError(f"corrupt {payload.codec} payload: {e}") from None


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in t. One aminmax pass (NaN propagates into both ends, +-Inf shows up in one), ~10x
    cheaper than isfinite(t).all(), which allocates a bool tensor as large as t."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


class Decoded:
    """A received gradient, dense or sparse (indices + values), validated but not densified."""

    __slots__ = ("numel", "dense", "indices", "values", "codec")

    def __init__(self, numel: int, dense=None, indices=None, values=None, codec: str | None = None):
        self.numel, self.dense, self.indices, self.values = numel, dense, indices, values
        self.codec = codec      # the payload's codec name (None: built from a plain tensor)

    @property
    def sparse(self) -> bool:
        return self.dense is None

    def all_finite(self) -> bool:
        return all_finite(self.values if self.sparse else self.dense)

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        """out += alpha * gradient; a scatter-add of k values for sparse payloads."""
        flat = out.view(-1)
        if self.sparse:
            flat.index_add_(0, self.indices, self.values.to(flat.dtype), alpha=alpha)
        else:
            flat.add_(self.dense.reshape(-1).to(flat.dtype), alpha=alpha)


def unpack_payload(payload: Payload) -> Decoded:
    """Validate a payload; sparse codecs keep (indices, values), others decode densely."""
    from compression.codecs.sparse import SparseCodec

    codec = _checked(payload)
    try:
        if isinstance(codec, SparseCodec):
            n, idx, vals = codec._read(payload)
            return Decoded(n, indices=idx, values=vals, codec=payload.codec)
        # float32, whatever the payload's dtype: what the sender's error feedback took off its memory (a 16-bit
        # payload decoded to its own dtype would round away part of every push)
        dense = codec.decode_float32(payload, torch.device("cpu"))
        return Decoded(dense.numel(), dense=dense, codec=payload.codec)
    except CodecError:
        raise
    except _CORRUPT as e:
        raise CodecError(f"corrupt {payload.codec} payload: {e}") from None
