"""`--mode pipeline`: pipeline parallelism (GPipe / 1F1B) x data-parallel replicas whose gradients go to the PS.

World = S x D processes (S = --pipeline-stages, D = world size / S). Global rank r runs stage s = r % S of
pipeline replica d = r // S:

    replica 0:  rank 0 (stage 0) -> rank 1 (stage 1) -> ... -> rank S-1 (stage S-1)
    replica 1:  rank S (stage 0) -> ...
    ...

* The workload's MLP (a sequential one: mlp, clf, ...; worker/workloads/mlp.py make_mlp) is cut into S
  contiguous stages at Linear boundaries (split_stages); parameter names keep the full model's names under a
  stage prefix: `stage1.2.weight`.
* Within a replica, micro-batches flow forward and backward between stages over torch.distributed
  point-to-point (gloo send/recv on one process group per replica), driven by
  torch.distributed.pipelining: a PipelineStage per process and ScheduleGPipe or Schedule1F1B
  (--pipeline-schedule). The schedule splits the replica's batch (--batch-size) into M = --microbatches
  equal micro-batches; the loss is the mean cross-entropy of a micro-batch and the schedule divides the
  accumulated gradients by M, so a stage's gradient is the mean over the M micro-batches.
* Across replicas, the PS aggregates: every process is a PSClient of one BSP job of world size D whose
  worker id is its replica index d. All processes register the same layout (every stage's parameters,
  so the layout digests agree); a process pushes and pulls only its own stage's keys. Key sets of
  different stages are disjoint, and the shard's BSP bookkeeping is per key and per worker id, so a key
  of stage s completes step t once the D replicas of stage s pushed it: the server averages the D
  gradients and runs its optimizer (--optimizer) once, exactly as in ps mode.
* At the end every process pulls the whole model (all stages, min_version = steps) and evaluates it;
  rank 0 writes --save-model with the plain make_mlp names. No evaluation during training (the model is
  cut across processes).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import own_view
from worker.trainers.base import comm_counters, load_params, local_optimizer, make_compressor
from worker.trainers.collective import server_stats_when_done
from worker.trainers.context import ClientOptions
from worker.trainers.strategy import StepOutcome, Strategy, register
from worker.workloads import available_workloads, workload_class

log = logging.getLogger("deltaps.pipeline")

SCHEDULES = ("gpipe", "1f1b")
TIMING_METHOD = ("pipeline: compute = schedule (forward/backward incl. p2p and bubbles); "
                 "comm = PS push + pull of this stage's gradients/parameters; wait = server-side BSP wait")


def split_stages(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into `stages` contiguous parts at parametrised-module boundaries (each Linear keeps
    the activation after it), as evenly as the block count allows. Sub-modules keep their global index as
    name, so a stage's named_parameters() are the full model's names ('2.weight')."""
    blocks: list[list[int]] = []
    for i, m in enumerate(model):
        if any(True for _ in m.parameters()) or not blocks:
            blocks.append([i])
        else:
            blocks[-1].append(i)
    if not 1 <= stages <= len(blocks):
        raise ValueError(f"cannot split a model of {len(blocks)} layers into {stages} pipeline stages")
    per, extra = divmod(len(blocks), stages)
    out, b = [], 0
    for s in range(stages):
        n = per + (1 if s < extra else 0)
        idx = [i for blk in blocks[b:b + n] for i in blk]
        b += n
        out.append(nn.Sequential(OrderedDict((str(i), model[i]) for i in idx)))
    return out


def stage_name(stage: int, name: str) -> str:
    return f"stage{stage}.{name}"


def grid(rank: int, world_size: int, stages: int) -> tuple[int, int, int]:
    """(stage, replica, replicas) of a global rank."""
    if world_size % stages:
        raise ValueError(f"world size {world_size} is not a multiple of --pipeline-stages {stages}")
    return rank % stages, rank // stages, world_size // stages


def make_schedule(kind: str, stage, microbatches: int, loss_fn):
    """loss_fn(output, target): the mean loss of a micro-batch (the workload's criterion)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    if kind == "gpipe":
        return ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    if kind == "1f1b":
        return Schedule1F1B(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    raise ValueError(f"unknown pipeline schedule {kind!r}; use gpipe or 1f1b")


def pipeline_extras(cfg, stage: int, replica: int, replicas: int, stage_params: int,
                    stage_modules: list[str], pipeline_s: float) -> dict:
    """The pipeline mode's own result keys (RunResult.extras)."""
    return {"stage_params": stage_params, "stage": stage, "replica": replica, "pipeline_stages": cfg.pipeline_stages,
            "replicas": replicas, "microbatches": cfg.microbatches, "pipeline_schedule": cfg.pipeline_schedule,
            "stage_modules": stage_modules, "pipeline_s": pipeline_s, "timing_method": TIMING_METHOD}


@register("pipeline")
class Pipeline(Strategy):
    collective = True
    needs_servers = True

    @classmethod
    def validate(cls, cfg, workload_cls) -> None:
        super().validate(cfg, workload_cls)
        if not workload_cls.sequential:
            stacks = ", ".join(n for n in available_workloads() if workload_class(n).sequential)
            raise ValueError(f"--mode pipeline cuts a stack of layers: use a workload with an MLP ({stacks}), "
                             f"not --workload {workload_cls.name}")
        if cfg.sync != "bsp":
            raise ValueError(f"--mode pipeline supports --sync bsp only, not {cfg.sync}")
        if cfg.eval_every:
            raise ValueError("--eval-every applies to --mode ps / allreduce / hybrid, not pipeline (the model is cut "
                             "across processes)")
        if cfg.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {cfg.pipeline_schedule!r}; use gpipe or 1f1b")
        if not 1 <= cfg.pipeline_stages <= cfg.layers + 1:
            raise ValueError(f"--pipeline-stages must be in [1, layers + 1 = {cfg.layers + 1}], "
                             f"got {cfg.pipeline_stages}")
        if cfg.workers % cfg.pipeline_stages:
            raise ValueError(f"--workers {cfg.workers} must be a multiple of --pipeline-stages {cfg.pipeline_stages}")
        if cfg.microbatches < 1 or cfg.batch_size % cfg.microbatches:
            raise ValueError(f"--microbatches {cfg.microbatches} must be >= 1 and divide --batch-size {cfg.batch_size}")

    @property
    def desc(self) -> str:
        return f"worker {self.rank} (pipeline s{self.s} r{self.d})"

    def setup(self) -> None:
        from torch.distributed.pipelining import PipelineStage

        from worker.client import PSClient
        cfg, ctx = self.cfg, self.ctx
        S = cfg.pipeline_stages
        self.s, self.d, self.D = s, d, D = grid(ctx.rank, ctx.world_size, S)
        # one gloo group per pipeline replica (every rank must create every group, in the same order)
        groups = [dist.new_group([r * S + i for i in range(S)], backend="gloo") for r in range(D)]
        self.pp_group = groups[d]
        self.model = model = self.workload.build_model()     # same init in every process
        parts = split_stages(model, S)
        self.mine = parts[s]
        self.full = [(stage_name(i, n), p) for i, part in enumerate(parts) for n, p in part.named_parameters()]
        self.own = own = [(stage_name(s, n), p) for n, p in self.mine.named_parameters()]
        self.own_names = [n for n, _ in own]
        self.client = PSClient(ctx.servers, d, D, optimizer=OptimizerConfig.from_torch(local_optimizer(cfg, model.parameters())),
                               codec=cfg.codec, pull_codec=cfg.pull_codec, compressor=make_compressor(cfg),
                               **ClientOptions.from_config(cfg, ctx.security).kwargs())
        self.closables.append(self.client.close)
        self.client.setup([(n, p.detach()) for n, p in self.full], pull=False)    # the delta pull below waits for init
        self.staging = own_view(own)
        self.client.pull(names=self.own_names, out=self.staging, delta=True)     # into the staging buffers
        load_params(own, self.staging)
        stage = PipelineStage(self.mine, s, S, torch.device("cpu"), group=self.pp_group)
        self.schedule = make_schedule(cfg.pipeline_schedule, stage, cfg.microbatches, self.workload.criterion)
        self.pipe_s: list[float] = []
        dist.barrier()

    def batches(self):
        return self.workload.batches(self.d, self.D)   # every stage of replica d draws the same batch

    def train_step(self, run, step: int, batch) -> StepOutcome:
        t0, s, S, client = run.step_start, self.s, self.cfg.pipeline_stages, self.client
        (xb,), yb = batch      # only the ends use it
        for _, p in self.own:
            p.grad = None
        mb_losses: list = []
        if S == 1:
            self.schedule.step(xb, target=yb, losses=mb_losses)
        elif s == 0:
            self.schedule.step(xb)
        elif s == S - 1:
            self.schedule.step(target=yb, losses=mb_losses)
        else:
            self.schedule.step()
        t1 = time.perf_counter()
        client.push({n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in self.own}, step)
        before = time.perf_counter()
        futs = [client.pool.submit(client.pull_keys, sh, ks, client.sync.pull_min_version(step + 1), self.staging, True)
                for sh, ks in client.keys_by_shard(self.own_names).items()]
        waited = max((f.result() for f in futs), default=0.0)
        load_params(self.own, self.staging)
        t2 = time.perf_counter()
        run.comm(t2 - t1, min(waited, t2 - before))
        self.pipe_s.append(t1 - t0)
        loss = float(torch.stack([x.detach() for x in mb_losses]).mean()) if mb_losses else None
        return StepOutcome(loss, end=t2)

    def finish(self, run) -> dict:
        cfg, s, S = self.cfg, self.s, self.cfg.pipeline_stages
        # the last stage knows the losses: share them with the replica's other stages (rank 0 reports them)
        lt = torch.tensor(run.losses if s == S - 1 else [0.0] * cfg.steps, dtype=torch.float64)
        dist.broadcast(lt, src=self.d * S + S - 1, group=self.pp_group)
        run.losses = lt.tolist()
        # the whole model, every stage at its final version, from the PS
        load_params(self.full, self.client.pull(min_version=self.client.sync.pull_min_version(cfg.steps)))
        # a replica's samples are counted once, not once per stage, so the launch summary's sum is right
        return dict(samples=cfg.steps * cfg.batch_size / S, **comm_counters(self.client.stats.snapshot()),
                    codec=cfg.codec, final_codec=self.client.codec,
                    extras=pipeline_extras(cfg, s, self.d, self.D, sum(p.numel() for _, p in self.own),
                                           list(self.mine._modules), sum(self.pipe_s)))

    def report(self, result) -> None:
        result.server_stats = server_stats_when_done(self.client, self.rank)
