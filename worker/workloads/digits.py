"""`--workload mlp`: scikit-learn's digits (1797 8x8 images, no download), split and standardised."""
from __future__ import annotations

from worker.workloads.base import register
from worker.workloads.mlp import TabularWorkload, standardised_split


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test) as tensors; the split is stratified and seeded."""
    from sklearn.datasets import load_digits
    return standardised_split(*load_digits(return_X_y=True), test_fraction, seed)


@register("mlp")
class Digits(TabularWorkload):
    description = "scikit-learn's 8x8 digits, 10 classes"
    load_split = staticmethod(load_digits_split)
