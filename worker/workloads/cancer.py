"""`--workload cancer`: scikit-learn's breast-cancer data (569 samples, 30 features, malignant / benign; no
download) on the MLP — a small binary task, split stratified and seeded, standardised like digits."""
from __future__ import annotations

from worker.workloads.base import register
from worker.workloads.mlp import TabularWorkload, standardised_split

TEST_FRACTION = 0.25


def load_cancer_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test) as tensors (float32 / int64); the split depends on the seed only."""
    from sklearn.datasets import load_breast_cancer
    return standardised_split(*load_breast_cancer(return_X_y=True), TEST_FRACTION, seed)


@register("cancer")
class BreastCancer(TabularWorkload):
    description = "scikit-learn's breast-cancer data, 30 features, 2 classes"
    load_split = staticmethod(load_cancer_split)
