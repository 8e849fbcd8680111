"""Deep Gradient Compression (Lin et al., ICLR 2018), sender side.

State is kept per key inside the codec: compress(tensor, seed=, key=) updates that key's
velocity u and accumulation v. Per step:
    g <- clip(g)                      local gradient clipping (L2 norm <= clip; 0 = off)
    u <- momentum * u + g             momentum correction
    v <- v + u                        local accumulation (DGC's own error feedback)
    send the exactly-k largest |v|    (sample threshold + exact refinement, as topk)
    v[sent] = 0, u[sent] = 0          momentum-factor masking
Density warms up 25% -> 6.25% -> 1.5625% -> 0.4% -> ratio over the first `warmup_steps` calls of a
key (four equal stages); it never drops below `ratio`. The payload has the topk layout, so the
server decodes it like topk. Since momentum lives here, the server should apply plain SGD.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from compression.base import CodecError, Payload, register
from compression.codecs.common import det_l2norm, flat_float
from compression.codecs.sparse import SparseCodec, check_ratio, k_for, topk_indices

WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


class _State:
    __slots__ = ("u", "v", "steps")

    def __init__(self, x: torch.Tensor):
        self.u = torch.zeros_like(x)
        self.v = torch.zeros_like(x)
        self.steps = 0


@register("dgc")
class DGCCodec(SparseCodec):
    name = "dgc"
    stateful = True
    internal_error_feedback = True  # v is the residual; do not wrap in ErrorFeedback

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, clip: float = 0.0, warmup_steps: int = 0):
        self.ratio = check_ratio("dgc", ratio)
        if not 0 <= momentum < 1:
            raise CodecError(f"dgc: momentum must be in [0, 1), got {momentum!r}")
        if (not isinstance(clip, (int, float)) or isinstance(clip, bool) or not math.isfinite(clip) or clip < 0
                or not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0):
            raise CodecError(f"dgc: clip must be a finite number >= 0 and warmup_steps an int >= 0, got {clip!r}, "
                             f"{warmup_steps!r}")
        self.momentum, self.clip, self.warmup_steps = float(momentum), float(clip), warmup_steps
        self._state: dict[str, _State] = {}

    def spec(self) -> str:
        return f"dgc:ratio={self.ratio},momentum={self.momentum},clip={self.clip},warmup_steps={self.warmup_steps}"

    def density(self, step: int) -> float:
        if step < self.warmup_steps:
            stage = min(len(WARMUP_DENSITIES) - 1, step * len(WARMUP_DENSITIES) // self.warmup_steps)
            return max(self.ratio, WARMUP_DENSITIES[stage])
        return self.ratio

    def wire_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        ratio = self.density(0)
        k = min(numel, max(1, math.ceil(ratio * numel)))
        return k * (4 + torch.empty((), dtype=dtype).element_size())

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None,
                 step: int | None = None) -> Payload:
        g = flat_float(tensor)
        key = "" if key is None else key
        st = self._state.get(key)
        if st is None or st.v.shape != g.shape or st.v.device != g.device:
            st = self._state[key] = _State(g)
        if self.clip > 0:
            norm = det_l2norm(g)
            if norm > self.clip:
                g = g * float(np.float32(self.clip / norm))
        st.u.mul_(self.momentum).add_(g)
        st.v.add_(st.u)
        k = k_for(self.density(st.steps if step is None else step), g.numel())
        idx = topk_indices(st.v, k, seed)
        payload = self._encode(tensor, idx, st.v, {})
        # what went out is v rounded to the tensor's dtype: a bf16 / fp16 gradient's rounding stays in v, not lost
        sent = st.v[idx]
        st.v[idx] = sent - sent.to(tensor.dtype).to(sent.dtype)
        st.u[idx] = 0
        st.steps += 1
        return payload

    # --- state access, for Compressor.set_spec and checkpoints ---
    def residual(self, key: str) -> torch.Tensor | None:
        st = self._state.get(key)
        return None if st is None else st.v

    def drain(self) -> dict[str, torch.Tensor]:
        """Unsent accumulation per key; clears all state (velocity is dropped)."""
        out = {k: st.v for k, st in self._state.items()}
        self._state.clear()
        return out

    def reset(self, key: str | None = None) -> None:
        if key is None:
            self._state.clear()
        else:
            self._state.pop(key, None)
