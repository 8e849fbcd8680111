"""`--workload mlp`: scikit-learn's digits (1797 8x8 images, no download), split and standardised."""
from __future__ import annotations

from worker.workloads.base import register
from worker.workloads.mlp import TabularWorkload, standardised


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test) as tensors; the split is stratified and seeded."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return standardised(x_tr, y_tr, x_te, y_te)


@register("mlp")
class Digits(TabularWorkload):
    description = "scikit-learn's 8x8 digits, 10 classes"
    load_split = staticmethod(load_digits_split)
