"""Payload <-> TensorChunk conversion and gRPC channel/server options shared by both ends."""
from __future__ import annotations

import msgpack
import torch

from compression.base import CodecError, Payload, tensor_bytes, dtype_name
from protos import pb

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def chunk_from_payload(key: str, p: Payload) -> pb.TensorChunk:
    return pb.TensorChunk(key=key, dtype=p.dtype, shape=list(p.shape), codec=p.codec,
                          header=msgpack.packb(p.header) if p.header else b"", data=bytes(p.data))


def chunk_from_tensor(key: str, t: torch.Tensor) -> pb.TensorChunk:
    return pb.TensorChunk(key=key, dtype=dtype_name(t.dtype), shape=list(t.shape), codec="none",
                          data=bytes(tensor_bytes(t)))


def payload_from_chunk(c: pb.TensorChunk) -> Payload:
    try:
        header = msgpack.unpackb(c.header) if c.header else {}
    except Exception as e:  # msgpack raises several types for garbage
        raise CodecError(f"key {c.key!r}: codec header is not valid msgpack ({e})") from None
    if not isinstance(header, dict):
        raise CodecError(f"key {c.key!r}: codec header must be a map")
    return Payload(c.codec or "none", tuple(c.shape), c.dtype or "float32", c.data, header)


def decode_chunk(c: pb.TensorChunk) -> torch.Tensor:
    """Dense tensor from a received chunk; CodecError names the key and the problem."""
    from compression import decode_payload
    try:
        return decode_payload(payload_from_chunk(c))
    except CodecError as e:
        raise CodecError(f"key {c.key!r}: {e}") from None


def accumulate_chunk(c: pb.TensorChunk, out: torch.Tensor) -> None:
    """out += the chunk's decoded tensor, block by block (no tensor-sized temporary)."""
    from compression import accumulate_payload
    try:
        accumulate_payload(payload_from_chunk(c), out)
    except CodecError as e:
        raise CodecError(f"key {c.key!r}: {e}") from None


def unpack_chunk(c: pb.TensorChunk):
    """Validated gradient (compression.Decoded): sparse payloads stay indices + values."""
    from compression import unpack_payload
    try:
        return unpack_payload(payload_from_chunk(c))
    except CodecError as e:
        raise CodecError(f"key {c.key!r}: {e}") from None


def chunk_nbytes(c: pb.TensorChunk) -> int:
    return len(c.data) + len(c.header)
