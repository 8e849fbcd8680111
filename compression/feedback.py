"""Error feedback around any lossy codec, with residual memory per key:
    g' = g + residual;  p = C(g');  residual = g' - D(p)
Residuals are kept in float32 (float64 for float64 gradients) on the gradient's device.
Codecs with their own accumulation (DGC: internal_error_feedback) are called straight through.
With `measure` on, each compress records (|g'|^2, |residual|^2) per key in `energy`: how much of what was due the
payload carried (Compressor's payload energy share; two reductions per call, so only where pushes are rare).
"""
from __future__ import annotations

import torch

from compression.base import Codec, Payload
from compression.server import all_finite


def squared_norm(t: torch.Tensor) -> float:
    """|t|^2, accumulated in float32 at least, float64 for float64 (what the energy figures sum)."""
    return float(t.detach().to(torch.promote_types(t.dtype, torch.float32)).square().sum())


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ErrorFeedback:
    def __init__(self, codec: Codec):
        self.codec = codec
        self._residual: dict[str, torch.Tensor] = {}
        self.measure = False
        self.energy: dict[str, tuple[float, float]] = {}     # key -> (|g'|^2, |residual left|^2) of its last push

    def fold(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """g + residual(key) as a flat accumulator tensor (the residual is consumed)."""
        r = self._residual.pop(key, None)
        g = tensor.detach().reshape(-1)
        if r is not None and r.shape == g.shape:
            return r.add_(g.to(r.device))
        return g.to(_acc_dtype(g.dtype), copy=True)

    def compress(self, tensor: torch.Tensor, *, seed: int = 0, key: str | None = None) -> Payload:
        key = "" if key is None else key
        if getattr(self.codec, "internal_error_feedback", False):
            if key in self._residual:  # e.g. left over from a codec used before set_spec
                tensor = self.fold(key, tensor).view(tensor.shape).to(tensor.dtype)
            return self.codec.compress(tensor, seed=seed, key=key)
        if key in self._residual and not all_finite(tensor.detach()):
            # a NaN / Inf step never enters the memory: the codec sends it alone (the shard's --nonfinite policy judges
            # it) or refuses it, and the rounds of residual held so far stay (folding first would lose them either way)
            return self.codec.compress(tensor, seed=seed, key=key)
        g = self.fold(key, tensor)
        due = squared_norm(g) if self.measure else 0.0
        src = g.view(tensor.shape)
        # residual = g' - D(p), in place, on g's device
        payload = self.codec.compress_leaving(src if src.dtype == tensor.dtype else src.to(tensor.dtype), g,
                                              seed=seed, key=key)
        self._residual[key] = g
        if self.measure:
            self.energy[key] = (due, squared_norm(g))
        return payload

    def take_back(self, key: str, payload: Payload) -> torch.Tensor:
        """g' of the push that made `payload` (its residual + what the payload decodes to), flat, for the
        caller to send whole instead: the key's residual is consumed."""
        g = self._residual.pop(key)
        self.codec.accumulate(payload, g, alpha=1.0)
        return g

    def residual(self, key: str) -> torch.Tensor | None:
        r = self._residual.get(key)
        if r is None and getattr(self.codec, "internal_error_feedback", False):
            return self.codec.residual(key)
        return r

    def add_residual(self, key: str, tensor: torch.Tensor) -> None:
        """Merge an external residual (e.g. DGC's unsent accumulation) into this key's memory."""
        t = tensor.detach().reshape(-1)
        r = self._residual.get(key)
        if r is not None and r.shape == t.shape:
            r.add_(t.to(r.device, r.dtype))
        else:
            self._residual[key] = t.to(_acc_dtype(t.dtype), copy=True)

    def keys(self) -> list[str]:
        return list(self._residual)
