"""sign: 1 bit per element (set = negative, little-endian bit order), scaled by mean |g|
(EF-signSGD, Karimireddy et al. 2019). The mean is computed in fixed point so it is identical on
every back end."""
from __future__ import annotations

import numpy as np
import torch

from compression import cuda
from compression.base import Codec, CodecError, Payload, register
from compression.codecs.common import decode_target, det_abs_mean, flat_float, make_payload
from compression.wire import check_padding, check_payload, new_body, read_body


@register("sign")
class SignCodec(Codec):
    name = "sign"
    default_error_feedback = True
    decodes_on_device = True

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return (numel + 7) // 8

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        x = flat_float(tensor)
        n = x.numel()
        scale = float(np.float32(det_abs_mean(x)))
        body, (bits,) = new_body([(torch.uint8, (n + 7) // 8)])
        if cuda.wants(x):
            bits.copy_(cuda.sign_bits(x))
        else:
            neg = (x < 0).numpy()
            bits.numpy()[:] = np.packbits(neg, bitorder="little")
        return make_payload(self.name, tensor, body, {"scale": scale})

    def _read(self, payload: Payload):
        n = check_payload(payload)
        scale = payload.header.get("scale")
        # mean |g| of a gradient holding NaN / Inf is NaN / Inf: it decodes so, for the shard's --nonfinite policy
        # (skip acknowledges it unapplied); only a negative scale or one that is no number is a corrupt payload
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale < 0:
            raise CodecError(f"sign: header field 'scale'={scale!r} is not a number >= 0")
        (bits,) = read_body(payload, [(torch.uint8, (n + 7) // 8)])
        check_padding("sign", bits, n, "sign bits")
        return n, scale, bits

    @staticmethod
    def _negatives(bits: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        """The sign bits as a bool mask on `device` (a GPU unpacks them itself: 1 bit per element crosses)."""
        if device.type == "cpu":
            return torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little").view(np.bool_))
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        return ((bits.to(device)[:, None] >> shifts) & 1).view(-1)[:n].bool()

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        n, scale, bits = self._read(payload)
        flat, finish = decode_target(payload, n, out)
        flat.fill_(scale).masked_fill_(self._negatives(bits, n, flat.device), -scale)
        return finish()
