"""fp16 / bf16: cast to a 16-bit float (round to nearest even) and back."""
from __future__ import annotations

import torch

from compression import cuda
from compression.base import Codec, Payload, register
from compression.codecs.common import decode_target, flat, make_payload
from compression.wire import check_payload, new_body, read_body


class _CastCodec(Codec):
    wire_dtype = torch.float16
    decodes_on_device = True

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        x = flat(tensor)  # converted straight to the wire dtype (no double rounding)
        body, (view,) = new_body([(self.wire_dtype, x.numel())])
        if cuda.wants(x) and x.dtype == torch.float32:
            view.copy_(cuda.to_fp16(x) if self.wire_dtype == torch.float16
                       else cuda.to_bf16_bits(x).view(torch.bfloat16))
        else:
            view.copy_(x)
        return make_payload(self.name, tensor, body, {})

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        n = check_payload(payload)
        (vals,) = read_body(payload, [(self.wire_dtype, n)])
        flat, finish = decode_target(payload, n, out)
        flat.copy_(vals)
        return finish()

    def accumulate(self, payload: Payload, out: torch.Tensor, alpha: float = 1.0) -> None:
        n = check_payload(payload)
        (vals,) = read_body(payload, [(self.wire_dtype, n)])
        out.view(-1).add_(vals.to(out.device), alpha=alpha)

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel


@register("fp16")
class FP16Codec(_CastCodec):
    name = "fp16"
    wire_dtype = torch.float16


@register("bf16")
class BF16Codec(_CastCodec):
    name = "bf16"
    wire_dtype = torch.bfloat16
