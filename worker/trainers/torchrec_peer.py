"""`--mode torchrec`: the peer a PyTorch user picks for a recommendation model — TorchRec's own
`DistributedModelParallel` (optional extra `recsys`: torchrec 1.8.0 over fbgemm-gpu-cpu 1.8.0), never
re-implemented here.

The workload's model is built with 1-row placeholders for its embedding tables (as hybrid builds it); each
nn.Embedding is swapped for `TorchRecTable`, an `EmbeddingBagCollection` of one table whose --embedding-fields
features (one id each, sum pooling: a plain lookup) share it. `DistributedModelParallel` over the job's gloo
group shards the tables as TorchRec's planner chooses (table-wise or row-wise, CPU topology; --torchrec-sharding makes it
use one type) with the table
optimizer fused into backward (`apply_optimizer_in_backward`: --embedding-optimizer sgd = EXACT_SGD, adagrad =
EXACT_ADAGRAD, eps 1e-10, as torch.optim.Adagrad), and wraps the rest of the model in DDP (its dense buckets
optionally through torch's fp16 / bf16 hook, --ddp-hook). The dense part steps with --optimizer, as every mode.
Every table starts from the PS's hash init (deltaps.embedding.init_rows), written into each rank's shards,
so the race's modes share the initial model. TorchRec divides the table's gradient by the world size in its
backward all-to-all (torchrec.distributed.comm_ops.GRADIENT_DIVISION, on by default), so the table's step is the
mean gradient's, as in DDP and on the shards (SGD and Adagrad both tested against --mode allreduce).

Timing: blocked = the exposed part of DDP's dense allreduce (our timing hook on DMP's DDP); TorchRec's
all-to-alls of ids, pooled rows and their gradients run inside forward and backward and count as compute.
Bytes: the dense ring figure plus a model figure of the all-to-alls, (W-1)/W x lookups x (12 + 8 x dim) per
rank and step (ids and lengths out, pooled rows back, their gradients out: the average over the ranks).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deltaps.embedding import init_rows
from deltaps.strategies import TORCHREC_SHARDINGS
from worker.trainers.base import local_optimizer
from worker.trainers.collective import AllreduceHookState, check_table_model_hook, register_timed_hook, ring_bytes
from worker.trainers.strategy import StepOutcome, Strategy, register
from worker.workloads.ctr import table_rows, table_spec

log = logging.getLogger("deltaps.torchrec")

TIMING_METHOD = ("torchrec: blocked = exposed dense allreduce (DDP inside DistributedModelParallel); the all-to-alls "
                 "of ids / pooled rows / row gradients run inside forward and backward and count as compute")
FUSED_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}
LOOKUP_BYTES = 12          # an id (int64) and its length (int32) sent to the table's owner
INIT_BLOCK = 1 << 16       # rows initialised at a time


def import_torchrec():
    try:
        import torchrec
    except (ImportError, OSError) as e:
        raise RuntimeError(f"--mode torchrec needs TorchRec: make setup installs it (pip install -e '.[recsys]' then "
                           f"pip install --no-deps torchrec==1.8.0); import failed: {e}") from None
    return torchrec


class TorchRecTable(nn.Module):
    """An nn.Embedding look-alike over a TorchRec EmbeddingBagCollection: ids [B, fields] -> rows [B, fields, dim];
    every field is a feature of the one table, one id per sample, sum-pooled (a lookup)."""

    def __init__(self, name: str, rows: int, dim: int, fields: int):
        super().__init__()
        torchrec = import_torchrec()
        self.fields, self.dim = fields, dim
        self.keys = [f"{name}.f{i}" for i in range(fields)]
        # on the meta device: DistributedModelParallel allocates only each rank's shards
        self.ebc = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=rows, feature_names=self.keys)], device=torch.device("meta"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor
        if ids.shape[1] != self.fields:
            raise ValueError(f"TorchRecTable: {ids.shape[1]} ids per sample, the table has {self.fields} fields")
        batch = ids.shape[0]
        kjt = KeyedJaggedTensor(keys=self.keys, values=ids.t().reshape(-1),
                                lengths=torch.ones(batch * self.fields, dtype=torch.int32))
        return self.ebc(kjt).values().reshape(batch, self.fields, self.dim)


def swap_tables(model: nn.Module, cfg) -> list[str]:
    """Replace every nn.Embedding of `model` by a TorchRecTable of the job's table shape; their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, TorchRecTable(name.replace(".", "_"), table_rows(cfg), cfg.embedding_dim,
                                            cfg.embedding_fields))
    return names


@torch.no_grad()
def write_initial_rows(dmp, spec) -> int:
    """Every local shard of every table <- the PS's hash init of its rows (columns as the shard cuts them);
    the table values (floats) this rank holds."""
    held = 0
    for key, value in dmp.state_dict().items():
        if not key.endswith(".weight") or not hasattr(value, "local_shards"):
            continue
        for shard in value.local_shards():
            row0, col0 = shard.metadata.shard_offsets
            rows, cols = shard.tensor.shape
            for lo in range(0, rows, INIT_BLOCK):           # in blocks: no second copy of a large table
                hi = min(rows, lo + INIT_BLOCK)
                shard.tensor[lo:hi].copy_(init_rows(spec, np.arange(row0 + lo, row0 + hi))[:, col0:col0 + cols])
            held += rows * cols
    return held


@register("torchrec")
class TorchRec(Strategy):
    collective = True
    evaluates_alone = False     # the sharded tables' forward is an all-to-all over every rank
    takes_ddp_hook = needs_embeddings = True

    @classmethod
    def validate(cls, cfg, workload_cls) -> None:
        super().validate(cfg, workload_cls)
        if cfg.sync != "bsp":
            raise ValueError(f"--mode torchrec is synchronous (--sync bsp), not {cfg.sync}")
        if cfg.torchrec_sharding not in ("auto", *TORCHREC_SHARDINGS):
            raise ValueError(f"--torchrec-sharding {cfg.torchrec_sharding}: use auto or {', '.join(TORCHREC_SHARDINGS)}")
        if cfg.embedding_optimizer not in FUSED_OPTIMIZERS:
            raise ValueError(f"--mode torchrec fuses sgd or adagrad into backward, not --embedding-optimizer "
                             f"{cfg.embedding_optimizer} (fbgemm's Adam is not torch's lazy SparseAdam)")
        check_table_model_hook(cfg.ddp_hook, workload_cls.name)

    def setup(self) -> None:
        torchrec = import_torchrec()
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        cfg, ctx = self.cfg, self.ctx
        model = self.workload.build_model("remote")
        self.tables = swap_tables(model, cfg)
        table_opt = {"lr": cfg.embedding_lr, **({"eps": 1e-10} if cfg.embedding_optimizer == "adagrad" else {})}
        for m in model.modules():
            if isinstance(m, torchrec.EmbeddingBagCollection):
                apply_optimizer_in_backward(FUSED_OPTIMIZERS[cfg.embedding_optimizer], m.parameters(), table_opt)
        group = dist.group.WORLD
        sharders = [EmbeddingBagCollectionSharder()]
        # --torchrec-sharding: the type the planner must use; column-wise cut into one slice per rank (its default
        # minimum slice would keep a 64-wide table whole on one rank)
        split = {"min_partition": max(1, cfg.embedding_dim // ctx.world_size)} if "column" in cfg.torchrec_sharding else {}
        must = {} if cfg.torchrec_sharding == "auto" else {
            t.replace(".", "_"): ParameterConstraints(sharding_types=[cfg.torchrec_sharding], **split) for t in self.tables}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=ctx.world_size, compute_device="cpu"),
                                           constraints=must)
        self.plan = planner.collective_plan(model, sharders, group)
        self.dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
                                            plan=self.plan, sharders=sharders)
        self.values_held = write_initial_rows(self.dmp, table_spec(cfg))
        self.model = self.dmp
        self.state = AllreduceHookState(ctx.world_size)
        register_timed_hook(self.dmp._dmp_wrapped_module, self.state, cfg.ddp_hook)
        self.opt = local_optimizer(cfg, [p for _, p in in_backward_optimizer_filter(self.dmp.named_parameters())])
        self.ring_bytes = self.a2a_bytes = 0
        dist.barrier()

    def train_step(self, run, step: int, batch) -> StepOutcome:
        self.state.new_step()
        loss = self.workload.loss(self.dmp, batch)
        self.opt.zero_grad()
        t = time.perf_counter()
        loss.backward()                 # the table's fused optimizer steps in here; DDP allreduces the dense part
        run.comm(self.state.exposed_comm_s(time.time(), time.perf_counter() - t))
        self.opt.step()
        lookups = batch[0][0].numel()
        world = self.ctx.world_size
        a2a = (world - 1) * lookups * (LOOKUP_BYTES + 8 * self.cfg.embedding_dim) // world
        dense = ring_bytes(self.state.payload_bytes, world)
        self.ring_bytes += dense
        self.a2a_bytes += a2a
        return StepOutcome(loss.item(), dense + a2a)

    def finish(self, run) -> dict:
        sent = self.ring_bytes + self.a2a_bytes
        plan = {table: {"sharding": p.sharding_type, "ranks": p.ranks}           # the planner's choice, per table
                for shards in self.plan.plan.values() for table, p in shards.items()}
        return dict(bytes_pushed_wire=sent, bytes_pushed_raw=sent, bytes_pulled_wire=sent,
                    extras={"timing_method": TIMING_METHOD, "torchrec_plan": plan, "table_values_held": self.values_held,
                            "dense_ring_bytes": self.ring_bytes, "a2a_bytes_model": self.a2a_bytes,
                            "table_optimizer": f"fused {self.cfg.embedding_optimizer}", "tables": self.tables})

    def model_state(self) -> dict:
        """The workload model's state_dict: every table gathered whole on rank 0 (a collective: every rank calls
        it) under its nn.Embedding name."""
        out = {}
        for key, value in self.dmp.state_dict().items():
            if hasattr(value, "local_shards"):
                full = torch.empty(value.size()) if self.rank == 0 else None
                value.gather(0, full)
                table = key.split(".ebc.embedding_bags.")[0]
                out[f"{table}.weight"] = full
            else:
                out[key] = value
        return out

    def report(self, result) -> None:
        dist.barrier()

