"""The MLP and the tabular-classification workloads that train it (digits, clf, ...): features -> class."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.workloads.base import Workload
from worker.workloads.data_cache import kept


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
def correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """How many of (x, y) the model classifies right."""
    model.eval()
    right = int((model(x).argmax(1) == y).sum().item())
    model.train()
    return right


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return correct(model, x, y) / len(y)


def standardised_split(x, y, test_size, seed: int):
    """(x_train, y_train, x_test, y_test) tensors (float32 / int64) of numpy data: a stratified, seeded split,
    features standardised with the training set's mean and std. test_size: a fraction or a count."""
    from sklearn.model_selection import train_test_split
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    f = lambda a: torch.from_numpy(((a - mean) / std).astype(np.float32))  # noqa: E731
    return f(x_tr), torch.from_numpy(y_tr), f(x_te), torch.from_numpy(y_te)


def hold_out(x: torch.Tensor, y: torch.Tensor, size: int, seed: int):
    """(x_rest, y_rest, x_held, y_held): a stratified, seeded split of `size` samples out of (x, y) — the validation
    set out of the training set (--eval-split validation), so the test set is never looked at."""
    from sklearn.model_selection import train_test_split
    rest, held = train_test_split(np.arange(len(y)), test_size=size, random_state=seed + 1, stratify=y.numpy())
    rest, held = torch.from_numpy(np.sort(rest)), torch.from_numpy(np.sort(held))
    return x[rest], y[rest], x[held], y[held]


def worker_batches(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, batch_size: int, seed: int):
    """Endless batches from this worker's disjoint slice of the training set, reshuffled every epoch."""
    idx = torch.arange(rank, len(x), world_size)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        perm = idx[torch.randperm(len(idx), generator=g)]
        for i in range(0, len(perm) - batch_size + 1, batch_size):
            b = perm[i:i + batch_size]
            yield x[b], y[b]


def elastic_batches(x: torch.Tensor, y: torch.Tensor, rank: int, live, batch_size: int, seed: int):
    """worker_batches over the live set: this worker takes the slice of its position among live() (the
    sorted worker ids the shards last reported), re-sliced whenever the live set changes."""
    current, it, changes = None, None, 0
    while True:
        members = sorted(live())
        if rank not in members:
            members = sorted(set(members) | {rank})   # not yet (or no longer) reported live: count ourselves
        if members != current:
            current, changes = members, changes + 1
            it = worker_batches(x, y, current.index(rank), len(current), batch_size, seed + 7919 * changes)
        yield next(it)


def tabular_split(load: Callable, seed: int, validation: bool):
    """load(seed): x_train, y_train, x_test, y_test; with `validation` the test set's place (x_test / y_test: what
    evaluations measure) goes to a validation set held out of the training data, as large as the test set."""
    x_tr, y_tr, x_te, y_te = load(seed)
    return hold_out(x_tr, y_tr, len(y_te), seed) if validation else (x_tr, y_tr, x_te, y_te)


class TabularWorkload(Workload):
    """An MLP (--hidden x --layers) on a standardised feature matrix; subclasses say where the data comes from
    (`load_split(seed)` -> x_train, y_train, x_test, y_test tensors, float32 / int64). With --eval-split validation
    the evaluations use a validation set held out of the training data (as large as the test set) in place of the
    test set, which stays as it is and unseen; the split, and so a test-set run, is the same as without it."""
    sequential = True
    has_validation = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.x_tr, self.y_tr, self.x_te, self.y_te = kept(tabular_split, self.load_split, cfg.seed,
                                                          cfg.eval_split == "validation")
        self.classes = int(max(self.y_tr.max(), self.y_te.max())) + 1

    @staticmethod
    def load_split(seed: int):
        raise NotImplementedError

    def build_model(self, tables: str = "local") -> nn.Module:
        if tables != "local":
            raise ValueError(f"--workload {self.name} has no embedding tables to keep {tables}")
        return make_mlp(self.x_tr.shape[1], self.cfg.hidden, self.cfg.layers, self.classes, self.cfg.seed)

    def batches(self, rank: int, world_size: int, live: Callable[[], list[int]] | None = None):
        cfg = self.cfg
        src = (elastic_batches(self.x_tr, self.y_tr, rank, live, cfg.batch_size, cfg.seed) if live is not None
               else worker_batches(self.x_tr, self.y_tr, rank, world_size, cfg.batch_size, cfg.seed))
        for x, y in src:
            yield (x,), y

    def criterion(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def evaluate(self, model: nn.Module) -> dict:
        right = correct(model, self.x_te, self.y_te)
        return {"test_accuracy": right / len(self.y_te), "test_correct": right}

    def reaches(self, evaluation: dict, target: float) -> bool:
        """A count, not a float fraction: 0.9 of 1,000 test samples is 900 right (a float32 900/1000 < 0.9)."""
        return evaluation["test_correct"] >= math.ceil(round(target * len(self.y_te), 9))

    def to(self, device: torch.device) -> TabularWorkload:
        self.x_tr, self.y_tr, self.x_te, self.y_te = (t.to(device) for t in (self.x_tr, self.y_tr, self.x_te, self.y_te))
        return self
