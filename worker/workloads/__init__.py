"""Bundled workloads: digits (data + MLP), the synthetic `clf` classification task and the synthetic CTR task."""
from __future__ import annotations

# --workload names whose data feeds the MLP (worker/workloads/mlp.py); ctr has its own model and trainers.
MLP_WORKLOADS = ("mlp", "clf")


def load_split(workload: str, seed: int = 0):
    """(x_train, y_train, x_test, y_test) of an MLP workload: `mlp` = digits, `clf` = the synthetic task.
    Both have 64 features and 10 classes; shard them with digits.worker_batches."""
    if workload == "mlp":
        from worker.workloads.digits import load_digits_split
        return load_digits_split(seed)
    if workload == "clf":
        from worker.workloads.clf import load_clf_split
        return load_clf_split(seed)
    raise ValueError(f"workload {workload!r} has no MLP data; use one of {', '.join(MLP_WORKLOADS)}")
