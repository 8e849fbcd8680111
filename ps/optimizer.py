"""Server-side optimizer: torch.optim semantics, one state per key, kept on the shard.

Sparse (lazy, catch-up) Adam for top-k steps. With top-k + error feedback a coordinate is silent for
many steps and then receives its accumulated residual at once: the sum of k steps' gradients, mostly old
mass. Dense Adam decays m and v of every silent coordinate, keeps moving it on decayed momentum and
normalises each stale burst into a full-size step: on the bench MLP the loss climbed from 0.02 to 0.37
between steps 50 and 80 (docs/compare.md). Plain lazy Adam (one Adam step per burst) fixed that, but a
burst of k steps' mass then moves a coordinate as far as one step's: on the harder clf race top-k never
reached 90 % in 600 steps. So a bsp step whose pushes were all top-k touches only the coordinates some
worker sent (the union); a coordinate last updated k steps ago takes the burst as k equal steps of
burst/k — m and v decay over the k steps in closed form — and moves k**CATCH_UP_POWER Adam steps
(1 would be k steps of a steady gradient, 0.5 a random walk's; measured: 1 and 0.75 lose up to 2 points
on digits at 100 steps and vary run to run, 0.5 keeps digits exact and reaches 90 % on clf;
docs/compare.md).
Silent coordinates stay where they are. Any dense push in a step (raw small tensors, warm-up steps,
other codecs, a rollback) takes torch's fused path — until the first lazy step; after it a dense step is
one step of its gradient after the silent ones (m and v decayed over them), so it equals torch's Adam
with zero gradients on the silent steps, minus their momentum drift.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from deltaps.optimizer_config import OptimizerConfig

SPARSE_CODECS = ("topk",)    # pushes of these codecs make a bsp step lazy (sparse) under Adam
CATCH_UP_POWER = 0.5        # a burst of k steps' residual moves k**this Adam steps (docs/compare.md)


def warm_up() -> None:
    """Build one throwaway optimizer: torch.optim's first constructor imports torch._dynamo (~1 s of a core),
    which a shard's first Init would otherwise pay while worker 0 waits (measured: 1.03 s, then 30 us)."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0, fused=True)


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
        self.coord_steps: torch.Tensor | None = None   # lazy Adam: the step of each coordinate's last update
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
        if self.coord_steps is not None:     # after a lazy phase (Adam only): catch the silent ones up
            self.apply_sparse(torch.arange(self.value.numel()), grad, spread=False)
            return
        self.value.grad = grad
        self.opt.step()
        self.value.grad = None
        increment_version(self.value)     # the fused kernels write in place without it (ps/pull_views.py digest_of)

    @torch.no_grad()
    def apply_sparse(self, idx: torch.Tensor, grad: torch.Tensor, spread: bool = True) -> None:
        """Adam on the coordinates idx (int64, unique) only. A coordinate last updated k steps ago: m and v
        decay over the k steps; spread (a top-k burst, the sum of k steps' gradients): the burst is k equal
        steps of grad/k and the value moves k**CATCH_UP_POWER of their Adam step; else grad is this step's
        alone (one step after k-1 silent ones). Bias correction by the step count (every coordinate has
        lived through all steps). With every coordinate present each step it equals apply(). Adam only:
        apply_step() sends every other optimizer the dense way."""
        c = self.cfg
        st = self.opt.state[self.value]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(self.value)
            st["exp_avg_sq"] = torch.zeros_like(self.value)
        if self.coord_steps is None:   # dense steps before (warm-up, rollback) updated every coordinate
            self.coord_steps = torch.full_like(self.value, float(st["step"]))
        t = float(st["step"]) + 1
        g = grad.to(self.value.dtype)
        if c.weight_decay:
            g = g.add(self.value[idx], alpha=c.weight_decay)
        k = (t - self.coord_steps[idx]).clamp_(min=1)
        k64 = k.double()       # 1 - beta2**k in float32 would be off by ~1e-5 relative
        d1, d2 = torch.pow(c.beta1, k64), torch.pow(c.beta2, k64)
        if spread:
            g = g / k
            w1, w2, scale = (1 - d1).to(g.dtype), (1 - d2).to(g.dtype), k.pow(CATCH_UP_POWER)
        else:
            w1, w2, scale = 1 - c.beta1, 1 - c.beta2, None
        d1, d2 = d1.to(g.dtype), d2.to(g.dtype)
        m = st["exp_avg"][idx].mul_(d1).add_(g * w1)
        v = st["exp_avg_sq"][idx].mul_(d2).add_(g * g * w2)
        st["exp_avg"].index_copy_(0, idx, m)
        st["exp_avg_sq"].index_copy_(0, idx, v)
        self.coord_steps.index_fill_(0, idx, t)
        denom = v.sqrt().div_((1 - c.beta2 ** t) ** 0.5).add_(c.eps)
        upd = m.div_(1 - c.beta1 ** t).div_(denom)
        self.value.index_add_(0, idx, upd if scale is None else upd.mul_(scale), alpha=-c.lr)
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
