"""Bundled data: scikit-learn's digits (1797 8x8 images, no download), split and standardised."""
from __future__ import annotations

import numpy as np
import torch


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test) as tensors; the split is stratified and seeded."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    f = lambda a: torch.from_numpy(((a - mean) / std).astype(np.float32))  # noqa: E731
    return f(x_tr), torch.from_numpy(y_tr), f(x_te), torch.from_numpy(y_te)


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
