"""Payload <-> TensorChunk conversion shared by both ends."""
from __future__ import annotations

import msgpack
import torch

from compression.base import CodecError, Payload, dtype_name, tensor_bytes
from protos import pb

# Bodies are large: build messages in place (repeated.add(), sub-message fields) rather than passing
# messages as constructor arguments, which upb merges by serializing and re-parsing them; and read
# a chunk's `data` once, since every attribute read of a bytes field copies it.

def fill_chunk(c: pb.TensorChunk, key: str, p: Payload) -> int:
    """Write payload p into chunk c in place; returns its wire bytes (body + header)."""
    header = msgpack.packb(p.header) if p.header else b""
    data = p.data if isinstance(p.data, bytes) else bytes(p.data)
    c.key, c.dtype, c.codec, c.header, c.data = key, p.dtype, p.codec, header, data
    c.shape.extend(p.shape)
    return len(data) + len(header)


def fill_chunk_from_tensor(c: pb.TensorChunk, key: str, t: torch.Tensor) -> int:
    data = bytes(tensor_bytes(t))
    c.key, c.dtype, c.codec, c.data = key, dtype_name(t.dtype), "none", data
    c.shape.extend(t.shape)
    return len(data)


def chunk_from_tensor(key: str, t: torch.Tensor) -> pb.TensorChunk:
    c = pb.TensorChunk()
    fill_chunk_from_tensor(c, key, t)
    return c


def read_chunk(c: pb.TensorChunk) -> tuple[Payload, int]:
    """(payload, wire bytes) of a received chunk, its body read once."""
    raw_header = c.header
    try:
        header = msgpack.unpackb(raw_header) if raw_header else {}
    except Exception as e:  # msgpack raises several types for garbage
        raise CodecError(f"key {c.key!r}: codec header is not valid msgpack ({e})") from None
    if not isinstance(header, dict):
        raise CodecError(f"key {c.key!r}: codec header must be a map")
    data = c.data
    return Payload(c.codec or "none", tuple(c.shape), c.dtype or "float32", data, header), len(data) + len(raw_header)


def payload_from_chunk(c: pb.TensorChunk) -> Payload:
    return read_chunk(c)[0]


def decode_chunk(c: pb.TensorChunk) -> torch.Tensor:
    """Dense tensor from a received chunk; CodecError names the key and the problem."""
    from compression import decode_payload
    try:
        return decode_payload(payload_from_chunk(c))
    except CodecError as e:
        raise CodecError(f"key {c.key!r}: {e}") from None


def accumulate_payload_into(key: str, p: Payload, out: torch.Tensor) -> None:
    """out += a received payload's decoded tensor, block by block (no tensor-sized temporary);
    CodecError names the key."""
    from compression import accumulate_payload
    try:
        accumulate_payload(p, out)
    except CodecError as e:
        raise CodecError(f"key {key!r}: {e}") from None


def unpack_chunk(c: pb.TensorChunk):
    """(validated gradient, wire bytes): the gradient is a compression.Decoded (sparse payloads stay
    indices + values)."""
    from compression import unpack_payload
    try:
        p, nbytes = read_chunk(c)
        return unpack_payload(p), nbytes
    except CodecError as e:
        raise CodecError(f"key {c.key!r}: {e}") from None
