"""Gradient codecs: compress(tensor) -> Payload, decompress(Payload) -> tensor, plus error feedback."""
from compression.base import Codec, CodecError, Payload, available_codecs, get_codec, parse_spec, register
from compression.feedback import ErrorFeedback
from compression.policy import Compressor
from compression.server import Decoded, accumulate_payload, decode_payload, unpack_payload

__all__ = ["Decoded", "unpack_payload", "Codec", "Payload", "CodecError", "get_codec", "parse_spec", "register",
           "available_codecs", "ErrorFeedback", "Compressor", "decode_payload", "accumulate_payload"]
