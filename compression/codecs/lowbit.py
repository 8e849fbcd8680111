"""lowbit: dense 2- or 4-bit codes with a per-chunk absmax scale, error feedback on the sender (Streaming DiLoCo's
FP4-class outer gradients, MuLoCo's 2-bit deltas): 1/8 (4 bits) or 1/16 (2 bits) of fp32 plus a scale per chunk,
for local-update rounds where int8's 1/4 is still what the link waits for, and none of top-k's selection passes.

Values sit on the 2**bits odd multiples of scale / L, L = 2**bits - 1 (no zero level, as chunktopk's codes:
odd_level_codes), scale = max |x| of the chunk, so |x - decoded| <= scale / L; what a round's rounding leaves
stays in the sender's residual. Body: float32 scale per chunk, then the codes packed LSB first (wire.bitpack's
stream; 2 codes a byte at 4 bits, 4 at 2 bits), the last byte zero-padded.
"""
from __future__ import annotations

import torch

from compression.base import Codec, CodecError, Payload, register
from compression.codecs.common import (
    check_bits,
    check_scales,
    decode_target,
    flat_float,
    make_payload,
    nchunks,
    odd_level_codes,
    padded_rows,
)
from compression.wire import body_size, check_padding, check_payload, header_int, new_body, read_body

BITS = (2, 4)
MAX_CHUNK = 1 << 16     # values per scale: larger chunks only coarsen the levels (and a decoder pads to one)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2**bits) -> bytes, code i at bit i * bits of the LSB-first stream."""
    per = 8 // bits
    grid = torch.nn.functional.pad(codes, (0, -codes.numel() % per)).view(-1, per)
    out = grid[:, 0].clone()
    for j in range(1, per):
        out.bitwise_or_(grid[:, j].bitwise_left_shift(bits * j))
    return out


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """pack_codes' inverse: the first n codes, uint8."""
    per, mask = 8 // bits, (1 << bits) - 1
    grid = torch.stack([packed.bitwise_right_shift(bits * j).bitwise_and_(mask) for j in range(per)], dim=1)
    return grid.view(-1)[:n]


@register("lowbit")
class LowBitCodec(Codec):
    name = "lowbit"
    default_error_feedback = True

    def __init__(self, bits: int = 4, chunk: int = 512):
        check_bits("lowbit", bits, BITS)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_CHUNK:
            raise CodecError(f"lowbit: chunk must be an int in [1, {MAX_CHUNK}], got {chunk!r}")
        self.bits, self.chunk = bits, chunk

    def spec(self) -> str:
        return f"lowbit:bits={self.bits},chunk={self.chunk}"

    @staticmethod
    def _sections(n: int, chunk: int, bits: int):
        return [(torch.float32, nchunks(n, chunk)), (torch.uint8, -(-n * bits // 8))]

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return body_size(self._sections(numel, self.chunk, self.bits))

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        return self._encode(tensor)[0]

    def compress_leaving(self, tensor: torch.Tensor, residual: torch.Tensor, *, seed: int = 0,
                         key: str | None = None) -> Payload:
        payload, values = self._encode(tensor)      # the decoded values, without parsing the payload again
        residual.view(-1).sub_(values.to(residual.device, residual.dtype))
        return payload

    def _encode(self, tensor: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        x = flat_float(tensor).cpu()
        n, c, levels = x.numel(), self.chunk, (1 << self.bits) - 1
        grid = padded_rows(x, c)
        scale = grid.abs().amax(dim=1) if n else torch.zeros(0)
        if not bool(torch.isfinite(scale).all()):     # a chunk's max |x| is NaN or Inf exactly when one of its values is
            raise CodecError("lowbit: the tensor holds NaN or Inf values; refusing to send them")
        codes = odd_level_codes(grid, scale[:, None], levels)
        body, (scales, packed) = new_body(self._sections(n, c, self.bits))
        scales.copy_(scale)
        packed.copy_(pack_codes(codes.view(-1)[:n].to(torch.uint8), self.bits))
        values = codes.mul_(2).sub_(levels).mul_(scale[:, None] / levels).view(-1)[:n]   # what the receiver decodes
        return make_payload(self.name, tensor, body, {"chunk": c, "bits": self.bits}), values

    def _read(self, payload: Payload) -> tuple[int, torch.Tensor]:
        """(numel, decoded float32 values) of a received payload; CodecError naming what is wrong."""
        n = check_payload(payload)
        chunk, bits = header_int(payload, "chunk", 1, MAX_CHUNK), header_int(payload, "bits", 2, 4)
        if bits not in BITS:
            raise CodecError(f"lowbit: header bits={bits}, must be 2 or 4")
        scale, packed = read_body(payload, self._sections(n, chunk, bits))
        check_scales("lowbit", scale)
        check_padding("lowbit", packed, n * bits, "codes")
        levels = (1 << bits) - 1
        codes = torch.nn.functional.pad(unpack_codes(packed, n, bits), (0, -n % chunk)).view(-1, chunk)
        return n, codes.float().mul_(2).sub_(levels).mul_(scale[:, None] / levels).view(-1)[:n]   # as _encode's values

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        n, values = self._read(payload)
        flat, finish = decode_target(payload, n, out)
        flat.copy_(values)
        return finish()

    def accumulate(self, payload: Payload, out: torch.Tensor, alpha: float = 1.0) -> None:
        n, values = self._read(payload)
        dst = out.view(-1)
        if dst.numel() != n:
            raise CodecError(f"lowbit: accumulate into {dst.numel()} elements, payload has {n}")
        dst.add_(values.to(dst.device, dst.dtype), alpha=alpha)
