"""Bundled data: `clf`, a synthetic 10-class classification task hard enough to race to an accuracy target.

scikit-learn's `make_classification` (no download): 64 features, 32 of them informative, 10 classes of 2
Gaussian clusters each, `class_sep` 1.6; 40,000 training and 1,000 test samples, standardised like digits.
Digits is learned in a few dozen steps; this one is not: the bench's MLP (64-768x2-10, 648k parameters),
global batch 128 (4 workers x 32), Adam lr 1e-3, first reaches 90 % test accuracy after 320-350 steps
(seeds 0-2, evaluated every 10 steps) and ends near 92-93 % at 600 — a target on the slope, not the plateau.
The per-worker sharding is mlp.worker_batches.
"""
from __future__ import annotations

from worker.workloads.base import register
from worker.workloads.mlp import TabularWorkload, standardised_split

FEATURES, CLASSES = 64, 10
TRAIN, TEST = 40_000, 1_000
HIDDEN, LAYERS = 768, 2          # the model `bench compare --workload clf` sizes by default
TARGET_ACCURACY = 0.9            # ... and the target `make bench-peers` races to


def load_clf_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test) as tensors (float32 / int64); data and split depend on the seed only."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=TRAIN + TEST, n_features=FEATURES, n_informative=32, n_redundant=0,
                               n_classes=CLASSES, n_clusters_per_class=2, class_sep=1.6, flip_y=0.0,
                               random_state=seed)
    return standardised_split(x, y, TEST, seed)


@register("clf")
class Clf(TabularWorkload):
    description = "a synthetic 10-class task, 40k samples"
    load_split = staticmethod(load_clf_split)
