"""`--mode pipeline`: pipeline parallelism (GPipe / 1F1B) x data-parallel replicas whose gradients go to the PS.

World = S x D processes (S = --pipeline-stages, D = world size / S). Global rank r runs stage s = r % S of
pipeline replica d = r // S:

    replica 0:  rank 0 (stage 0) -> rank 1 (stage 1) -> ... -> rank S-1 (stage S-1)
    replica 1:  rank S (stage 0) -> ...
    ...

* The digits MLP (worker/workloads/mlp.py make_mlp) is cut into S contiguous stages at Linear boundaries
  (split_stages); parameter names keep the full model's names under a stage prefix: `stage1.2.weight`.
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
  rank 0 writes --save-model with the plain make_mlp names.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deltaps.config import TrainConfig
from deltaps.optimizer_config import OptimizerConfig
from worker.trainers.base import RunRecorder, comm_counters, load_params, local_optimizer, make_compressor, save_model
from worker.trainers.collective import env_rendezvous, init_process_group, server_stats_when_done
from worker.workloads.digits import load_digits_split, worker_batches
from worker.workloads.mlp import accuracy, make_mlp, param_count

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


def make_schedule(kind: str, stage, microbatches: int):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    loss_fn = lambda out, y: F.cross_entropy(out, y)  # noqa: E731  (mean over the micro-batch)
    if kind == "gpipe":
        return ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    if kind == "1f1b":
        return Schedule1F1B(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    raise ValueError(f"unknown pipeline schedule {kind!r}; use gpipe or 1f1b")


def pipeline_extras(cfg: TrainConfig, stage: int, replica: int, replicas: int, stage_params: int,
                    stage_modules: list[str], pipeline_s: float) -> dict:
    """train_pipeline's own result keys (RunResult.extras)."""
    return {"stage_params": stage_params, "stage": stage, "replica": replica, "pipeline_stages": cfg.pipeline_stages,
            "replicas": replicas, "microbatches": cfg.microbatches, "pipeline_schedule": cfg.pipeline_schedule,
            "stage_modules": stage_modules, "pipeline_s": pipeline_s, "timing_method": TIMING_METHOD}


def train_pipeline(cfg: TrainConfig, servers: list[str], rank: int, world_size: int,
                   master_addr: str = "127.0.0.1", master_port: int = 29500, security=None) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from worker.client import PSClient

    torch.set_num_threads(1)
    S, M = cfg.pipeline_stages, cfg.microbatches
    s, d, D = grid(rank, world_size, S)
    init_process_group(cfg, rank, world_size, master_addr, master_port)
    client = None
    try:
        # one gloo group per pipeline replica (every rank must create every group, in the same order)
        groups = [dist.new_group([r * S + i for i in range(S)], backend="gloo") for r in range(D)]
        pp_group = groups[d]
        x_tr, y_tr, x_te, y_te = load_digits_split(cfg.seed)
        model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed)   # same init in every process
        parts = split_stages(model, S)
        mine = parts[s]
        full = [(stage_name(i, n), p) for i, part in enumerate(parts) for n, p in part.named_parameters()]
        own = [(stage_name(s, n), p) for n, p in mine.named_parameters()]
        own_names = [n for n, _ in own]
        client = PSClient(servers, d, D, sync=cfg.sync,
                          optimizer=OptimizerConfig.from_torch(local_optimizer(cfg, model.parameters())),
                          codec=cfg.codec, pull_codec=cfg.pull_codec, compressor=make_compressor(cfg),
                          chunk_bytes=cfg.chunk_bytes, max_message_bytes=cfg.max_message_bytes,
                          timeout_s=cfg.timeout_s, security=security,
                          reconnect_deadline_s=cfg.reconnect_deadline_s, replay_steps=cfg.replay_steps)
        client.setup([(n, p.detach()) for n, p in full])
        staging = {n: torch.empty(p.numel(), dtype=torch.float32) for n, p in own}
        staging.update(client.pull(names=own_names, out=staging, delta=True))
        load_params(own, staging)
        stage = PipelineStage(mine, s, S, torch.device("cpu"), group=pp_group)
        schedule = make_schedule(cfg.pipeline_schedule, stage, M)
        batches = worker_batches(x_tr, y_tr, d, D, cfg.batch_size, cfg.seed)
        pipe_s = []
        run = RunRecorder(cfg, rank, f"worker {rank} (pipeline s{s} r{d})", log)
        dist.barrier()
        for step in run.steps():
            t0 = run.step_start
            xb, yb = next(batches)      # every stage of replica d draws the same batch; only ends use it
            for _, p in own:
                p.grad = None
            mb_losses: list = []
            if S == 1:
                schedule.step(xb, target=yb, losses=mb_losses)
            elif s == 0:
                schedule.step(xb)
            elif s == S - 1:
                schedule.step(target=yb, losses=mb_losses)
            else:
                schedule.step()
            t1 = time.perf_counter()
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in own}
            client.push(grads, step)
            before = time.perf_counter()
            futs = [client.pool.submit(client.pull_keys, sh, ks, client.sync.pull_min_version(step + 1), staging, True)
                    for sh, ks in client.keys_by_shard(own_names).items()]
            waited = max((f.result() for f in futs), default=0.0)
            load_params(own, staging)
            t2 = time.perf_counter()
            run.comm(t2 - t1, min(waited, t2 - before))
            pipe_s.append(t1 - t0)
            loss = float(torch.stack([x.detach() for x in mb_losses]).mean()) if mb_losses else None
            run.record(loss, end=t2)
        # the last stage knows the losses: share them with the replica's other stages (rank 0 reports them)
        lt = torch.tensor(run.losses if s == S - 1 else [0.0] * cfg.steps, dtype=torch.float64)
        dist.broadcast(lt, src=d * S + S - 1, group=pp_group)
        run.losses = lt.tolist()
        # the whole model, every stage at its final version, from the PS
        load_params(full, client.pull(min_version=client.sync.pull_min_version(cfg.steps)))
        acc = accuracy(model, x_te, y_te)
        save_model(cfg, rank, model)
        res = run.result(final_test_accuracy=acc, model_params=param_count(model),
                         # a replica's samples are counted once, not once per stage, so the launch summary's sum is right
                         samples=cfg.steps * cfg.batch_size / S,
                         **comm_counters(client.stats.snapshot()), codec=cfg.codec, final_codec=client.codec,
                         extras=pipeline_extras(cfg, s, d, D, sum(p.numel() for _, p in own), list(mine._modules),
                                                sum(pipe_s)))
        res.server_stats = server_stats_when_done(client, rank)
        return res.to_dict()
    finally:
        if client is not None:
            client.close()
        dist.destroy_process_group()


def run_worker(cfg: TrainConfig, args, security=None) -> dict:
    """`deltaps worker --mode pipeline`: --servers, --rank, --world-size (= S x D), --master-addr/--master-port."""
    rank, world, addr, port = env_rendezvous(args.rank, args.world_size, args.master_addr, args.master_port)
    args.rank = rank
    if not args.servers:
        raise ValueError("mode pipeline needs --servers (the PS shards) and --master-addr/--master-port")
    return train_pipeline(cfg, args.servers, rank, world, addr, port, security=security)


# ---- reference: the same training in one process (tests/cluster/test_pipeline.py) --------------------------------
def reference_sgd(cfg: TrainConfig, replicas: int) -> dict[str, torch.Tensor]:
    """Plain SGD in one process on the same micro-batch sequence: per step, the gradient is the mean over
    the `replicas` x M micro-batches of each micro-batch's mean loss. Returns make_mlp's state_dict."""
    x_tr, y_tr, _, _ = load_digits_split(cfg.seed)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    its = [worker_batches(x_tr, y_tr, d, replicas, cfg.batch_size, cfg.seed) for d in range(replicas)]
    for _ in range(cfg.steps):
        opt.zero_grad()
        for it in its:
            xb, yb = next(it)
            for xm, ym in zip(xb.tensor_split(cfg.microbatches), yb.tensor_split(cfg.microbatches)):
                (F.cross_entropy(model(xm), ym) / (replicas * cfg.microbatches)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
