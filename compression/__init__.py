"""Gradient codecs: compress(tensor) -> Payload, decompress(Payload) -> tensor, plus error feedback."""
from compression.base import Codec, Payload, CodecError, get_codec, parse_spec, register, available_codecs

__all__ = ["Codec", "Payload", "CodecError", "get_codec", "parse_spec", "register", "available_codecs"]
