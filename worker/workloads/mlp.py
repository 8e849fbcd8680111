"""Models for the bundled task: an MLP whose size is configurable (hidden width x depth)."""
from __future__ import annotations

import torch
from torch import nn


def make_mlp(in_features: int = 64, hidden: int = 256, layers: int = 2, classes: int = 10, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    mods, width = [], in_features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc
