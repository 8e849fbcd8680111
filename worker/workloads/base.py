"""The workload seam: a model, its data, its loss and its metric, and the registry `--workload` names.

Contract: a Workload is built once per worker from the job's TrainConfig (`get_workload(cfg)`); strategies
(worker/trainers/) never branch on its name, they ask it:
* `build_model(tables)` — the model with the job's seed (every rank builds the same initial values);
  `tables`: "local" (embedding tables materialised, dense gradients), "sparse" (nn.Embedding(sparse=True)),
  "remote" (1-row placeholders that a strategy swaps for tables on the shards). Workloads without tables
  (`has_embeddings = False`) take "local" only;
* `batches(rank, world_size, live=None)` — endless batches `(inputs, target)` of this rank's data, where
  `inputs` is the tuple the model is called with; `live`: a callable returning the live worker ids of an
  elastic job (the data follows the live set);
* `criterion(output, target)` / `loss(model, batch)` — the training loss (mean over the batch);
* `evaluate(model)` — held-out figures: always `test_accuracy`, and `metric` (the figure --eval-every
  records and `target_field`'s target races to, in the direction `higher_is_better` says); `reaches(evaluation,
  target)` — whether an evaluation reaches the target (a fraction of a test set is compared as a count);
* `logical_params(model)`, `result_extras(evaluation)` — what the report says of the model.
A workload owns its config rules (`validate`). Adding one: a module with `@register("name")` on the class,
its test, one docs line (the package imports every module in it).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from deltaps.registry import Registry

# the bundled workloads register themselves when worker/workloads/__init__.py imports them
WORKLOADS = Registry("workload")
register = WORKLOADS.register
available_workloads = WORKLOADS.names
workload_class = WORKLOADS.get


def get_workload(cfg) -> Workload:
    """The workload `cfg.workload` names, built for this job (whose rules check_job has checked)."""
    return workload_class(cfg.workload)(cfg)


class Workload:
    name = ""
    description = ""                      # its data in a few words, for the bench header
    metric = "test_accuracy"              # what evaluations during training measure
    higher_is_better = True               # the metric's direction (a loss: False)
    target_field = "target_accuracy"      # the TrainConfig field holding the target for `metric`
    has_embeddings = False                # a model with embedding tables (hybrid, ddp:sparse)
    sequential = False                    # the model is an nn.Sequential of layers (pipeline stages cut it)
    has_validation = False                # --eval-split validation: evaluations on data held out of training

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def validate(cls, cfg) -> None:
        """This workload's own config rules: its target is `target_field`, never another workload's."""
        for other in {workload_class(w).target_field for w in available_workloads()} - {cls.target_field}:
            if getattr(cfg, other):
                raise ValueError(f"--workload {cls.name} races to a test {cls.metric.removeprefix('test_')}: "
                                 f"use --{cls.target_field.replace('_', '-')}, not --{other.replace('_', '-')}")
        if cfg.eval_split == "validation" and not cls.has_validation:
            raise ValueError(f"--workload {cls.name} has no validation split (--eval-split validation)")

    @property
    def target(self) -> float:
        return float(getattr(self.cfg, self.target_field))

    def build_model(self, tables: str = "local") -> nn.Module:
        raise NotImplementedError

    def batches(self, rank: int, world_size: int, live: Callable[[], list[int]] | None = None) -> Iterator[tuple]:
        raise NotImplementedError

    def criterion(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        inputs, target = batch
        device = next(model.parameters()).device
        if target.device != device:      # batches are made on the CPU; a GPU model takes them over
            inputs, target = tuple(t.to(device, non_blocking=True) for t in inputs), target.to(device, non_blocking=True)
        return self.criterion(model(*inputs), target)

    def evaluate(self, model: nn.Module) -> dict:
        raise NotImplementedError

    def reaches(self, evaluation: dict, target: float) -> bool:
        """Whether an evaluation reaches the race target, in the metric's direction."""
        value = evaluation[self.metric]
        return value >= target if self.higher_is_better else value <= target

    def to(self, device: torch.device) -> Workload:
        """Keep the data on `device` (a GPU rank of an NCCL job); no-op by default."""
        return self

    def logical_params(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    def result_extras(self, evaluation: dict) -> dict:
        """The workload's own result keys (RunResult.extras); none by default."""
        return {}
