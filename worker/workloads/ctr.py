"""Synthetic click-through workload: Zipf-distributed categorical ids, labels from a hidden model.

`fields` categorical features share one embedding table of `rows` rows; field f draws ids from its own
contiguous range of rows // fields ids, Zipf(a) over ranks (rank 1 most popular), mapped to ids by a fixed
affine permutation so popular ids are spread over the range (and over the shards, id % n). Each sample
also has `DENSE` standard-normal dense features.

Labels come from a hidden ground-truth model: every id has a hidden `TEACHER_DIM`-dim vector (a hash of
the id, deltaps.embedding.hash_uniform, never stored), each field a fixed projection; logit = sum over fields
of <u_id, w_f> + <x_dense, v> + b, label ~ Bernoulli(sigmoid(logit)). So loss / AUC are meaningful: the
teacher's own AUC on the test set (`oracle_auc`) is the ceiling, 0.5 is chance. Everything is a pure
function of (seed, worker rank, step): reruns and every mode see the same data.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deltaps.embedding import TableSpec, dense_init, hash_uniform
from worker.workloads.base import Workload, register

DENSE = 13
TEACHER_DIM = 8
TEST_SAMPLES = 8192


class CTRData:
    def __init__(self, rows: int, fields: int = 8, zipf_a: float = 1.1, seed: int = 0, drift: float = 0.0,
                 drift_every: int = 0, steps: int = 0):
        if rows < fields:
            raise ValueError(f"embedding rows {rows} < fields {fields}")
        self.rows, self.fields, self.a, self.seed = rows, fields, zipf_a, seed
        self.per_field = rows // fields
        ranks = np.arange(1, self.per_field + 1, dtype=np.float64)
        w = ranks ** -zipf_a
        self.cdf = np.cumsum(w) / w.sum()
        m = self.per_field
        mult = 2_654_435_761 % m or 1
        while np.gcd(mult, m) != 1:
            mult += 1
        self.mult, self.off = mult, (seed * 97_531) % m
        # drift: every `drift_every` steps a `drift` share of each field's slots gets a new id (a new generation);
        # slot k is renewed when epoch x drift + phase_k crosses an integer (golden-ratio phases spread renewals)
        self.drift, self.drift_every = drift, drift_every
        self.phase = (np.arange(m) * 0.6180339887498949) % 1.0
        last_epoch = (max(steps, 1) - 1) // drift_every if drift else 0
        self.generations = int(np.floor(last_epoch * drift + self.phase.max())) + 1 if drift else 1
        g = np.random.default_rng(seed + 12345)
        self.w_fields = g.normal(0, 1.0, (fields, TEACHER_DIM)) / np.sqrt(fields * TEACHER_DIM / 12.0)
        self.v_dense = g.normal(0, 0.5 / np.sqrt(DENSE), DENSE)
        self.bias = -0.5
        self._recent: dict = {}      # (rank, step, batch size) -> batch, the latest two
        self._tests: dict = {}       # epoch -> test set

    @property
    def table_rows(self) -> int:
        """Rows a fixed table needs for every id the run draws (every generation of every slot)."""
        return max(self.rows, self.fields * self.per_field * self.generations)

    def epoch_of(self, step: int) -> int:
        return step // self.drift_every if self.drift else 0

    def _ids(self, g: np.random.Generator, n: int, epoch: int = 0) -> np.ndarray:
        rank = np.searchsorted(self.cdf, g.random((n, self.fields)))          # 0-based rank, Zipf
        local = (rank * self.mult + self.off) % self.per_field
        gen = np.floor(epoch * self.drift + self.phase[local]).astype(np.int64) if self.drift else 0
        return (np.arange(self.fields) * self.generations + gen) * self.per_field + local   # [n, fields] global ids

    def teacher_logit(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        u = hash_uniform(ids.reshape(-1), TEACHER_DIM, self.seed, scale=1.0, salt=1).numpy()
        u = u.reshape(ids.shape[0], self.fields, TEACHER_DIM)
        return np.einsum("bfd,fd->b", u, self.w_fields) * 2.0 + dense @ self.v_dense + self.bias

    def sample(self, g: np.random.Generator, n: int, epoch: int = 0):
        ids = self._ids(g, n, epoch)
        dense = g.normal(0, 1, (n, DENSE)).astype(np.float32)
        p = 1 / (1 + np.exp(-self.teacher_logit(ids, dense)))
        y = (g.random(n) < p).astype(np.float32)
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(dense), torch.from_numpy(y), p

    def batch(self, rank: int, step: int, batch_size: int):
        """A pure function of (seed, rank, step); the latest two are kept (hybrid's pipeline asks for the next
        step's ids one step early; the loop asks again)."""
        key = (rank, step, batch_size)
        if key not in self._recent:
            g = np.random.default_rng([self.seed, 1 + rank, step])
            ids, dense, y, _ = self.sample(g, batch_size, self.epoch_of(step))
            self._recent = dict(list(self._recent.items())[-1:]) | {key: (ids, dense, y)}
        return self._recent[key]

    def test_set(self, epoch: int = 0):
        """TEST_SAMPLES held-out samples of `epoch`'s ids (the same set for every epoch without drift)."""
        if epoch not in self._tests:
            g = np.random.default_rng([self.seed, 0, 10**9 + epoch])
            ids, dense, y, p = self.sample(g, TEST_SAMPLES, epoch)
            self._tests = {epoch: (ids, dense, y, torch.from_numpy(p))}
        return self._tests[epoch]


class CTRModel(nn.Module):
    """Embedding (rows x dim, shared by all fields) -> concat with dense features -> MLP -> click logit."""

    def __init__(self, rows: int, dim: int = 64, fields: int = 8, hidden: int = 256, layers: int = 2, seed: int = 0,
                 materialize_table: bool = True, table_spec: TableSpec | None = None, sparse: bool = False):
        super().__init__()
        self.fields, self.dim = fields, dim
        # the table's initial values are ps.embedding's hash init, in every mode (the PS computes the same);
        # hybrid mode builds a 1-row placeholder that replace_embeddings swaps for a PSEmbedding;
        # sparse=True: the table's gradient is a sparse COO tensor of the batch's rows (bench compare's ddp:sparse)
        spec = table_spec or TableSpec("emb", rows, dim, seed=seed)
        self.emb = nn.Embedding(rows if materialize_table else 1, dim, sparse=sparse,
                                _weight=dense_init(spec) if materialize_table else torch.zeros(1, dim))
        torch.manual_seed(seed)   # the MLP's init does not depend on how the table was made
        mods, width = [], fields * dim + DENSE
        for _ in range(layers):
            mods += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        mods.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*mods)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids).reshape(ids.shape[0], self.fields * self.dim)
        return self.mlp(torch.cat([e, dense], 1)).squeeze(1)


def table_rows(cfg) -> int:
    """A fixed table's rows: --embedding-rows, times the id generations a drifting stream draws (--id-drift)."""
    return CTRData(cfg.embedding_rows, cfg.embedding_fields, cfg.zipf_a, cfg.seed, cfg.id_drift, cfg.drift_every,
                   cfg.steps).table_rows


def table_spec(cfg) -> TableSpec:
    """The click-through table: fixed (table_rows rows) or, with --embedding-dynamic, without a row count (rows made
    on first touch, evicted after --embedding-ttl-steps, made after --embedding-min-count sightings)."""
    dynamic = {"dynamic": True, "ttl_steps": cfg.embedding_ttl_steps, "min_count": cfg.embedding_min_count}
    return TableSpec("emb", 0 if cfg.embedding_dynamic else table_rows(cfg), cfg.embedding_dim, cfg.embedding_optimizer,
                     lr=cfg.embedding_lr, eps=1e-10 if cfg.embedding_optimizer == "adagrad" else 1e-8, init="uniform",
                     init_scale=0.05, seed=cfg.seed, **(dynamic if cfg.embedding_dynamic else {}))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged."""
    s = scores.double().numpy()
    y = labels.numpy() > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.no_grad()
def evaluate(model: nn.Module, data: CTRData, epoch: int = 0) -> dict:
    ids, dense, y, p = data.test_set(epoch)
    was = model.training
    model.eval()
    logits = model(ids, dense)
    model.train(was)
    return {"test_loss": F.binary_cross_entropy_with_logits(logits, y).item(),
            "test_auc": auc(logits, y), "test_accuracy": ((logits > 0).float() == y).float().mean().item(),
            "oracle_auc": auc(p, y),
            "oracle_loss": F.binary_cross_entropy(p.float().clamp(1e-7, 1 - 1e-7), y).item()}


@register("ctr")
class CTR(Workload):
    """The click-through task: the table and the MLP; races to a test AUC."""
    description = "synthetic click-through data for a model with a large embedding table"
    metric, target_field, has_embeddings = "test_auc", "target_auc", True

    @classmethod
    def validate(cls, cfg) -> None:
        super().validate(cfg)
        if cfg.embedding_optimizer not in ("sgd", "adagrad", "adam"):
            raise ValueError(f"unknown embedding optimizer {cfg.embedding_optimizer!r}; use sgd, adagrad or adam")
        for name in ("embedding_rows", "embedding_dim", "embedding_fields"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
        if not 0.0 <= cfg.id_drift <= 1.0 or (cfg.id_drift and cfg.drift_every < 1):
            raise ValueError(f"--id-drift must be in [0, 1] with --drift-every >= 1 steps, got {cfg.id_drift} and "
                             f"{cfg.drift_every}")
        if cfg.embedding_ttl_steps < 0 or cfg.embedding_min_count < 0:
            raise ValueError("--embedding-ttl-steps and --embedding-min-count must be >= 0")
        if (cfg.embedding_ttl_steps or cfg.embedding_min_count) and not cfg.embedding_dynamic:
            raise ValueError("--embedding-ttl-steps / --embedding-min-count apply to dynamic tables "
                             "(--embedding-dynamic)")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.data = CTRData(cfg.embedding_rows, cfg.embedding_fields, cfg.zipf_a, cfg.seed, cfg.id_drift,
                            cfg.drift_every, cfg.steps)
        self.step = 0       # the step whose batch the training loop took last: evaluations test its epoch's ids

    def build_model(self, tables: str = "local") -> CTRModel:
        cfg = self.cfg
        return CTRModel(self.data.table_rows, cfg.embedding_dim, cfg.embedding_fields, cfg.hidden, cfg.layers, cfg.seed,
                        materialize_table=tables != "remote", table_spec=table_spec(cfg), sparse=tables == "sparse")

    def batch_at(self, rank: int, step: int) -> tuple:
        """Step `step`'s batch of `rank` (a pure function of them: a strategy may look one step ahead)."""
        ids, dense, y = self.data.batch(rank, step, self.cfg.batch_size)
        return (ids, dense), y

    def batches(self, rank: int, world_size: int, live=None):
        step = 0
        while True:
            self.step = step
            yield self.batch_at(rank, step)
            step += 1

    def criterion(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output, target)

    def evaluate(self, model: nn.Module) -> dict:
        return {**evaluate(model, self.data, self.data.epoch_of(self.step)), "ids_epoch": self.data.epoch_of(self.step)}

    def logical_params(self, model: nn.Module) -> int:
        """The dense part plus the whole table (a placeholder where the table lives on the shards)."""
        dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("emb"))
        return dense + self.data.table_rows * self.cfg.embedding_dim

    def result_extras(self, evaluation: dict) -> dict:
        return ctr_extras(evaluation)


def ctr_extras(ev: dict) -> dict:
    """The click-through workload's own result keys: test AUC / loss, and the teacher's (the ceiling)."""
    return {"final_test_auc": ev["test_auc"], "final_test_loss": ev["test_loss"], "oracle_auc": ev["oracle_auc"],
            "oracle_loss": ev["oracle_loss"], "workload": "ctr"}
