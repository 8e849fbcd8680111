"""Sender-side compression policy (what the worker calls for every pushed gradient).

- tensors under min_bytes, steps before warmup_steps, and tensors the codec would not shrink go
  as `none`;
- error feedback per key (default: the codec's default_error_feedback);
- measure_energy (local-update jobs: one push per round): stats() adds payload_energy_share, the share of the
  squared L2 norm due (the tensor + its residual) that the payloads carried; the rest waits in the residuals
  (error feedback) or, without it, is dropped;
- set_spec() switches codec at runtime. Residual memory is never dropped: EF residuals stay keyed
  as they are and DGC's unsent accumulation is moved into them; the next push of each key sends
  g + residual (through the new codec, or raw for pass-through, which clears it). If the new codec
  runs without error feedback, that fold happens once and nothing is tracked afterwards.
Not meant for concurrent compress() calls on the same key; call set_spec between steps.
"""
from __future__ import annotations

import threading

import torch

from compression.base import NoneCodec, Payload, get_codec
from compression.feedback import ErrorFeedback, squared_norm


class Compressor:
    def __init__(self, spec: str = "none", *, min_bytes: int = 4096, warmup_steps: int = 0,
                 error_feedback: bool | None = None, measure_energy: bool = False):
        self.min_bytes, self.warmup_steps = int(min_bytes), int(warmup_steps)
        self._none = NoneCodec()
        self._ef = ErrorFeedback(self._none)
        self._ef.measure = bool(measure_energy)
        self._lock = threading.Lock()
        self.reset_stats()
        self.set_spec(spec, error_feedback=error_feedback)

    @property
    def spec(self) -> str:
        return self._spec

    @property
    def codec(self):
        return self._codec

    @property
    def measure_energy(self) -> bool:
        return self._ef.measure

    @property
    def error_feedback(self) -> bool:
        return self._use_ef

    def set_spec(self, spec: str, *, error_feedback: bool | None = None) -> None:
        """Switch codec (raises CodecError on a bad spec and keeps the old one)."""
        new = get_codec(spec)
        old = getattr(self, "_codec", None)
        if old is not None and hasattr(old, "drain"):
            for key, v in old.drain().items():
                self._ef.add_residual(key, v)
        self._codec, self._spec = new, spec
        self._ef.codec = new
        self._use_ef = new.default_error_feedback if error_feedback is None else bool(error_feedback)

    def compress(self, key: str, tensor: torch.Tensor, step: int = 0, seed: int = 0) -> Payload:
        raw = tensor.numel() * tensor.element_size()
        codec = self._codec
        est = codec.wire_nbytes(tensor.numel(), tensor.dtype) if codec.lossy else None
        energy = None       # (|due|^2, |left behind|^2) where measured
        if (not codec.lossy or raw < self.min_bytes or step < self.warmup_steps
                or not tensor.is_floating_point() or (est is not None and est >= raw)):
            payload, sent = self._passthrough(key, tensor)
            if self.measure_energy and sent.is_floating_point():
                energy = (squared_norm(sent), 0.0)
        elif self._use_ef:
            payload = self._ef.compress(tensor, seed=seed, key=key)
            energy = self._ef.energy.pop(key, None)
        else:
            if key in self._ef.keys():
                tensor = self._ef.fold(key, tensor).view(tensor.shape).to(tensor.dtype)
            payload = codec.compress(tensor, seed=seed, key=key)
            if self.measure_energy:     # what the payload did not carry is dropped
                lost = tensor.reshape(-1).float() - codec.decompress_on(payload, tensor.device).reshape(-1).float()
                energy = (squared_norm(tensor), squared_norm(lost))
        if payload.codec != "none" and payload.nbytes >= raw:  # codec without a size estimate: send what was due raw
            if self._use_ef and not getattr(codec, "internal_error_feedback", False):
                tensor = self._ef.take_back(key, payload).view(tensor.shape).to(tensor.dtype)
            payload = self._none.compress(tensor)
            if energy is not None:
                energy = (energy[0], 0.0)      # sent whole
        self._count(raw, payload, energy)
        return payload

    def _passthrough(self, key: str, tensor: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        """The raw payload and the tensor it holds (with any residual folded in: sent whole, nothing left)."""
        if tensor.is_floating_point() and key in self._ef.keys():
            tensor = self._ef.fold(key, tensor).view(tensor.shape).to(tensor.dtype)
        return self._none.compress(tensor), tensor

    def residual(self, key: str) -> torch.Tensor | None:
        return self._ef.residual(key)

    def _count(self, raw: int, payload: Payload, energy: tuple[float, float] | None = None) -> None:
        with self._lock:
            s = self._stats
            s["pushes"] += 1
            s["raw_bytes"] += raw
            s["wire_bytes"] += payload.nbytes
            s["by_codec"][payload.codec] = s["by_codec"].get(payload.codec, 0) + 1
            if energy is not None:
                s["energy_due"] += energy[0]
                s["energy_left"] += energy[1]

    def stats(self) -> dict:
        """raw_bytes, wire_bytes (payload bodies), pushes, by_codec counts, compression_ratio; energy_due and
        energy_left (sums of squares, measure_energy) and payload_energy_share = 1 - left / due (None: nothing
        measured)."""
        with self._lock:
            s = dict(self._stats, by_codec=dict(self._stats["by_codec"]))
        s["compression_ratio"] = s["raw_bytes"] / s["wire_bytes"] if s["wire_bytes"] else 1.0
        s["payload_energy_share"] = energy_share(s["energy_due"], s["energy_left"])
        return s

    def reset_stats(self) -> None:
        self._stats = {"pushes": 0, "raw_bytes": 0, "wire_bytes": 0, "by_codec": {}, "energy_due": 0.0,
                       "energy_left": 0.0}


def energy_share(due: float, left: float) -> float | None:
    """1 - left / due: the share of the squared norm due that the payloads carried (None when nothing was due)."""
    return 1.0 - left / due if due > 0 else None
