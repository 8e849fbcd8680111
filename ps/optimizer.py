"""Server-side optimizer: torch.optim semantics, one state per key, kept on the shard."""
from __future__ import annotations

import torch

from deltaps.optimizer_config import OptimizerConfig


class KeyOptimizer:
    """Applies gradients to one flat parameter tensor in place with torch.optim's fused kernels
    (same update rule as the default implementation, ~10x faster for Adam on CPU)."""

    def __init__(self, value: torch.Tensor, cfg: OptimizerConfig):
        self.value = value
        if cfg.name == "adam":
            self.opt = torch.optim.Adam([value], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                        weight_decay=cfg.weight_decay, fused=True)
        else:
            self.opt = torch.optim.SGD([value], lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                                       nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, fused=True)

    @torch.no_grad()
    def apply(self, grad: torch.Tensor) -> None:
        self.value.grad = grad
        self.opt.step()
        self.value.grad = None

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
