"""Server-side optimizer: torch.optim semantics, one state per key, kept on the shard.

Sparse (lazy) Adam for top-k steps. With top-k + error feedback a coordinate is silent for many steps
and then receives its accumulated residual at once, mostly gradient mass from the first steps of
training (the mass-weighted age of what top-k sends grows with the step count). Dense Adam decays m and
v of every silent coordinate, keeps moving it on decayed momentum, and normalises each stale burst into
a full-size step: on the bench MLP the applied update's cosine with the current gradient falls to ~0.02
and the loss climbs from 0.02 to 0.37 between steps 50 and 80 (docs/compare.md). A bsp step whose
pushes were all top-k therefore updates m, v, the bias-correction count and the value only on the
coordinates some worker sent (the union), each coordinate with its own step count, so a burst is one
Adam step of at most ~lr, and silent coordinates stay where they are. Any dense push in a step (raw
small tensors, warm-up steps, other codecs, a rollback) takes torch's fused path on the same state —
until the first lazy step; after it a dense step is the lazy step on every coordinate, so each coordinate
keeps its own step count (torch's one count would mis-correct the bias of the rarely sent ones).
"""
from __future__ import annotations

import torch

from deltaps.optimizer_config import OptimizerConfig

SPARSE_CODECS = ("topk",)    # pushes of these codecs make a bsp step lazy (sparse) under Adam


class KeyOptimizer:
    """Applies gradients to one flat parameter tensor in place with torch.optim's fused kernels
    (same update rule as the default implementation, ~10x faster for Adam on CPU)."""

    def __init__(self, value: torch.Tensor, cfg: OptimizerConfig):
        self.value = value
        self.cfg = cfg
        if cfg.name == "adam":
            self.opt = torch.optim.Adam([value], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                        weight_decay=cfg.weight_decay, fused=True)
        else:
            self.opt = torch.optim.SGD([value], lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                                       nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, fused=True)
        self.coord_steps: torch.Tensor | None = None   # lazy Adam: Adam steps taken per coordinate
        self._step_sparse: bool | None = None           # this step's pushes: None none yet, True all top-k

    def note_push(self, grad) -> None:
        """Record one push of the step being aggregated (a compression.server.Decoded)."""
        sparse = bool(getattr(grad, "sparse", False)) and getattr(grad, "codec", None) in SPARSE_CODECS
        self._step_sparse = sparse if self._step_sparse is None else (self._step_sparse and sparse)

    @torch.no_grad()
    def apply_step(self, grad: torch.Tensor) -> None:
        """Apply a bsp step's mean gradient: lazily on its nonzero coordinates when every push noted for
        this step was top-k and the optimizer is Adam, else the dense torch step."""
        sparse, self._step_sparse = self._step_sparse, None
        if sparse and self.cfg.name == "adam":
            idx = grad.nonzero().view(-1)
            self.apply_sparse(idx, grad[idx])
        else:
            self.apply(grad)

    @torch.no_grad()
    def apply(self, grad: torch.Tensor) -> None:
        if self.coord_steps is not None:     # after a lazy phase (Adam only): per-coordinate step counts
            self.apply_sparse(torch.arange(self.value.numel()), grad)
            return
        self.value.grad = grad
        self.opt.step()
        self.value.grad = None

    @torch.no_grad()
    def apply_sparse(self, idx: torch.Tensor, grad: torch.Tensor) -> None:
        """Lazy Adam on the coordinates idx (int64, unique) with gradient values grad: m, v, the per-
        coordinate step count and the value change only there (torch.optim.Adam's formula, per
        coordinate bias correction). With every coordinate present each step it equals apply(). Adam only:
        apply_step() sends every other optimizer the dense way."""
        c = self.cfg
        st = self.opt.state[self.value]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(self.value)
            st["exp_avg_sq"] = torch.zeros_like(self.value)
        if self.coord_steps is None:   # dense steps before (warm-up, rollback) count for every coordinate
            self.coord_steps = torch.full_like(self.value, float(st["step"]))
        g = grad.to(self.value.dtype)
        if c.weight_decay:
            g = g.add(self.value[idx], alpha=c.weight_decay)
        t = self.coord_steps[idx].add_(1)
        m = st["exp_avg"][idx].lerp_(g, 1 - c.beta1)
        v = st["exp_avg_sq"][idx].mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        self.coord_steps.index_copy_(0, idx, t)
        st["exp_avg"].index_copy_(0, idx, m)
        st["exp_avg_sq"].index_copy_(0, idx, v)
        bc1 = 1 - torch.pow(c.beta1, t)
        bc2 = 1 - torch.pow(c.beta2, t)
        denom = v.sqrt().div_(bc2.sqrt()).add_(c.eps)
        self.value.index_add_(0, idx, m.div_(bc1).div_(denom), alpha=-c.lr)
        st["step"] += 1

    def state_dict(self) -> dict:
        """torch's state + the per-coordinate step counts + the kind of the step being aggregated (a
        checkpoint can hold a half-aggregated bsp step: ps/state.py)."""
        s = {**self.opt.state_dict(), "step_sparse": self._step_sparse}
        if self.coord_steps is not None:
            s["coord_steps"] = self.coord_steps.clone()
        return s

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        cs = state.pop("coord_steps", None)
        self._step_sparse = state.pop("step_sparse", None)
        self.coord_steps = None if cs is None else cs.clone().to(self.value.dtype)
        self.opt.load_state_dict(state)
