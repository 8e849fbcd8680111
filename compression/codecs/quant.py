"""Dense per-chunk quantisers: int8 (absmax scale) and QSGD (stochastic rounding, unbiased).

Body: float32 per-chunk scale, then one int8 per element. Decoded value = q * multiplier(chunk),
with multiplier = scale for int8 and max|g| / levels for qsgd.
"""
from __future__ import annotations

import numpy as np
import torch

from compression import buffers, cuda, rng
from compression.base import Codec, CodecError, Payload, register
from compression.codecs.common import chunk_blocks, decode_target, flat_float, make_payload, nchunks
from compression.wire import body_size, check_payload, header_int, new_body, read_body

INV127 = float(np.float32(1.0 / 127.0))
MAX_CHUNK = 2**31 - 1    # the header's int (msgpack, the shard's header_int): larger ones would not encode


class _ChunkQuantCodec(Codec):
    decodes_on_device = True

    def __init__(self, chunk: int = 4096):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_CHUNK:
            raise CodecError(f"{self.name}: chunk must be an int in [1, {MAX_CHUNK}], got {chunk!r}")
        self.chunk = chunk

    def _sections(self, n: int, chunk: int):
        return [(torch.float32, nchunks(n, chunk)), (torch.int8, n)]

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return body_size(self._sections(numel, self.chunk))

    def _read(self, payload: Payload):
        n = check_payload(payload)
        chunk = header_int(payload, "chunk", 1)
        scale, q = read_body(payload, self._sections(n, chunk))
        # a NaN / Inf scale is a non-finite gradient (the shard's --nonfinite policy judges it); a negative one or a
        # code the encoder never writes is a corrupt payload (a flipped sign, or a value past the chunk's max)
        bound = self._max_code(payload)
        lo, hi = torch.aminmax(q) if n else (torch.tensor(0), torch.tensor(0))
        if bool((scale < 0).any()) or int(lo) < -bound or int(hi) > bound:
            raise CodecError(f"{payload.codec}: a negative scale or a code outside [-{bound}, {bound}]: corrupt payload")
        return n, chunk, self._multiplier(payload, scale), q

    def _max_code(self, payload: Payload) -> int:
        return 127

    def _multiplier(self, payload: Payload, scale: torch.Tensor) -> torch.Tensor:
        return scale

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        n, chunk, mult, q = self._read(payload)
        flat, finish = decode_target(payload, n, out)
        mult, q = mult.to(flat.device), q.to(flat.device)     # a GPU target: the int8 body crosses, then decodes
        for a, b, r0, rows, w in chunk_blocks(n, chunk):
            ob = flat[a:b].view(rows, w)
            ob.copy_(q[a:b].view(rows, w)).mul_(mult[r0:r0 + rows, None])
        return finish()

    def accumulate(self, payload: Payload, out: torch.Tensor, alpha: float = 1.0) -> None:
        n, chunk, mult, q = self._read(payload)
        dst = out.view(-1)
        if dst.numel() != n:
            raise CodecError(f"{payload.codec}: accumulate into {dst.numel()} elements, payload has {n}")
        mult, q = mult.to(dst.device), q.to(dst.device)
        tmp = torch.empty(min(n, max(buffers.BLOCK, chunk)), device=dst.device)
        for a, b, r0, rows, w in chunk_blocks(n, chunk):
            t = tmp[:b - a].view(rows, w)
            t.copy_(q[a:b].view(rows, w)).mul_(mult[r0:r0 + rows, None])
            dst[a:b].add_(t.view(-1), alpha=alpha)


@register("int8")
class Int8Codec(_ChunkQuantCodec):
    """q = rint(g / s), s = max|g| / 127 per chunk; |g - q*s| <= s/2."""

    name = "int8"

    def spec(self) -> str:
        return f"int8:chunk={self.chunk}"

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        x = flat_float(tensor)
        n, chunk = x.numel(), self.chunk
        body, (scale, q) = new_body(self._sections(n, chunk))
        if cuda.wants(x):
            s, qq = cuda.int8_encode(x, chunk, INV127)
            scale.copy_(s)
            q.copy_(qq)
        else:
            tmp = torch.empty(min(n, max(buffers.BLOCK, chunk)))
            for a, b, r0, rows, w in chunk_blocks(n, chunk):
                xb = x[a:b].view(rows, w)
                t = torch.abs(xb, out=tmp[:b - a].view(rows, w))
                s = scale[r0:r0 + rows]
                torch.amax(t, dim=1, out=s)
                s.mul_(INV127)
                safe = torch.where(s == 0, 1.0, s)
                torch.div(xb, safe[:, None], out=t).round_()
                q[a:b].copy_(t.view(-1))
        return make_payload(self.name, tensor, body, {"chunk": chunk})


@register("qsgd")
class QSGDCodec(_ChunkQuantCodec):
    """QSGD (Alistarh et al.) with the max-norm per chunk (order-independent, so both back ends
    agree): l = floor(|g|/m * levels + u), u ~ U[0,1) from a counter hash; E[l*m/levels] = |g|."""

    name = "qsgd"

    def __init__(self, levels: int = 16, chunk: int = 4096):
        super().__init__(chunk)
        if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= 127:
            raise CodecError(f"qsgd: levels must be an int in [1, 127], got {levels!r}")
        self.levels = levels

    def spec(self) -> str:
        return f"qsgd:levels={self.levels},chunk={self.chunk}"

    def _multiplier(self, payload: Payload, scale: torch.Tensor) -> torch.Tensor:
        return scale / float(self._max_code(payload))

    def _max_code(self, payload: Payload) -> int:
        return header_int(payload, "levels", 1, 127)

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        x = flat_float(tensor)
        n, chunk, levels = x.numel(), self.chunk, self.levels
        hkey = rng.seed32(seed)
        body, (m, q) = new_body(self._sections(n, chunk))
        if cuda.wants(x):
            mm, qq = cuda.qsgd_encode(x, chunk, levels, hkey)
            m.copy_(mm)
            q.copy_(qq)
        else:
            tmp = torch.empty(min(n, max(buffers.BLOCK, chunk)))
            for a, b, r0, rows, w in chunk_blocks(n, chunk):
                xb = x[a:b].view(rows, w)
                t = torch.abs(xb, out=tmp[:b - a].view(rows, w))
                mb = m[r0:r0 + rows]
                torch.amax(t, dim=1, out=mb)
                safe = torch.where(mb == 0, 1.0, mb)
                t.div_(safe[:, None]).mul_(float(levels))
                t.add_(rng.uniform(a, b - a, hkey).view(rows, w)).floor_().clamp_max_(float(levels))
                t = torch.where(xb < 0, -t, t)
                q[a:b].copy_(t.view(-1))
        return make_payload(self.name, tensor, body, {"chunk": chunk, "levels": levels})
