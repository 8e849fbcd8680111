"""`--mode allreduce`, the ring-allreduce baseline: gradients are averaged with torch.distributed (DDP,
bucketed allreduce; gloo on CPU, nccl on GPUs) and every rank runs the optimizer locally. This is what users
already run (DDP / Horovod, + torch's comm hooks) and what deltaps must beat.

Same model, data shard per rank, optimizer config (local_optimizer) and steps as every mode (the one loop,
worker/trainers/loop.py). A model with embedding tables (--workload ctr) keeps them dense in DDP's buckets,
or sparse (--sparse-embeddings, bench compare's ddp:sparse: nn.Embedding(sparse=True), gloo's sparse
allreduce, stepped by --embedding-optimizer; collective.sparse_aware_hook); the dense buckets of such a model
take fp16 / bf16 only.

Step-time split (how it is measured, per step, per rank):
  * a DDP communication hook (worker/trainers/collective.py) timestamps each gradient bucket when autograd
    hands it over ("ready"); the last bucket's ready time marks the end of this rank's own backward compute;
  * backward() returns only after every bucket's allreduce finished; the time from the last ready
    timestamp to that return is time blocked on communication ("exposed", i.e. not overlapped);
  * after training the per-step last-ready timestamps (wall clock, shared by processes on one host)
    are all-gathered; wait = (slowest rank's last-ready time - mine), clipped to the blocked time:
    the part of the block spent waiting for peers to finish their compute (stragglers);
    comm = blocked - wait: moving bytes after everyone was ready;
  * compute = step time - comm - wait (forward, backward, optimizer step; communication that
    overlaps with backward is hidden and therefore counted as compute, which is what it costs).
  Across hosts the wait/comm split depends on clock synchronisation; their sum does not.
  With --ddp-hook (torch's fp16/bf16/PowerSGD/post-local-SGD hooks, worker/trainers/ddp_hooks.py) the same
  timing hook wraps torch's: ready = when DDP hands the bucket over, done = when that hook's future completes
  (compression and decompression in its callbacks count as comm). Local SGD's periodic model average after
  optimizer.step() is a blocking allreduce: its duration is added to blocked, and its start is that step's
  ready time for the wait split.

Bytes: a ring allreduce of G bytes over p ranks sends (and receives) 2(p-1)/p * G per rank;
bytes_pushed_* / bytes_pulled_wire report that model figure, with G = the bytes the hook hands to allreduce
(fp32 gradient buckets; half of them for fp16/bf16; PowerSGD's uncompressed tensors + P and Q; local SGD:
the parameters on averaging steps, nothing on the others).
"""
from __future__ import annotations

import functools
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from worker.trainers.base import local_optimizer, table_optimizer
from worker.trainers.collective import (
    SparseHookState,
    check_ddp_hook,
    check_table_model_hook,
    ring_bytes,
    sparse_aware_hook,
    wrap_hook,
)
from worker.trainers.devices import backend_for, check_gpus_not_shared
from worker.trainers.strategy import StepOutcome, Strategy, register

__all__ = ["Allreduce", "allreduce_extras"]

log = logging.getLogger("deltaps.allreduce")

TIMING_METHOD = ("ddp-comm-hook: blocked = backward return - last bucket ready; "
                 "wait = slowest rank's last-ready - mine (clipped); comm = blocked - wait")


def allreduce_extras(backend: str, bucket_cap_mb: float, grad_bytes_steps: list[int], world_size: int,
                     params_max_diff: float, wire_steps: list[int] | None = None, hook: dict | None = None) -> dict:
    """The allreduce mode's own result keys (RunResult.extras). ring_bytes_per_step: the mean per step of the
    ring figure of what was allreduced (wire_steps; default: every step's fp32 gradients)."""
    g = grad_bytes_steps[-1] if grad_bytes_steps else 0
    wire = sum(wire_steps) / max(1, len(wire_steps)) if wire_steps is not None else ring_bytes(g, world_size)
    hook = hook or {"ddp_hook": "none"}
    method = TIMING_METHOD
    if hook["ddp_hook"] != "none":
        method += f"; hook {hook['ddp_hook']}: timed from bucket ready to its future done"
        if hook["ddp_hook"].startswith("localsgd"):
            method += "; blocked also counts the periodic model average after optimizer.step (ready = its start)"
    return {"backend": backend, "bucket_cap_mb": bucket_cap_mb, "grad_bytes_per_step": g,
            "ring_bytes_per_step": wire, "params_max_diff_across_ranks": params_max_diff,
            "timing_method": method, **hook}


@register("allreduce")
class Allreduce(Strategy):
    collective = True
    takes_ddp_hook = sparse_tables = gpu = True

    @classmethod
    def validate(cls, cfg, workload_cls) -> None:
        super().validate(cfg, workload_cls)
        check_ddp_hook(cfg.ddp_hook)     # a bad --ddp-hook fails here, before the rendezvous
        if workload_cls.has_embeddings:
            check_table_model_hook(cfg.ddp_hook, workload_cls.name)
        if workload_cls.has_embeddings and cfg.device == "cuda":
            raise ValueError(f"--device cuda: --workload {workload_cls.name}'s tables train on the CPU in --mode "
                             f"allreduce (gloo's sparse allreduce carries their rows); use --device cpu")
        if cfg.ddp_checkpoint_dir and cfg.ddp_hook.split(":")[0] not in ("none", "fp16", "bf16"):
            raise ValueError(f"--ddp-checkpoint-dir takes --ddp-hook none, fp16 or bf16 (hooks without state of their "
                             f"own), not {cfg.ddp_hook!r}: its state would not be in the checkpoint")
        if cfg.sparse_embeddings and not workload_cls.has_embeddings:
            raise ValueError(f"--sparse-embeddings (ddp:sparse) needs a model with an embedding table (--workload "
                             f"ctr), not --workload {workload_cls.name}")

    @functools.cached_property
    def device(self) -> torch.device:
        # gloo's sparse allreduce carries the tables' rows: a model with tables stays on the CPU, on gloo
        return torch.device("cpu") if self.workload.has_embeddings else super().device

    def backend(self) -> str:
        return backend_for(self.device, self.ctx.backend)

    @property
    def desc(self) -> str:
        sparse = ", sparse table" if self.cfg.sparse_embeddings else ""
        return f"worker {self.rank} (allreduce{sparse}, {self.workload.name})"

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        cfg, ctx = self.cfg, self.ctx
        if self.backend() == "nccl":
            check_gpus_not_shared(self.device, ctx.world_size, cfg.timeout_s)
        self.workload.to(self.device)
        self.model = model = self.workload.build_model("sparse" if cfg.sparse_embeddings else "local").to(self.device)
        tables = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
        # a table's gradient is not copied into DDP's buckets (a million-row table would be twice in memory)
        self.bucket_views = bool(tables)
        self.ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                       bucket_cap_mb=ctx.bucket_cap_mb, gradient_as_bucket_view=self.bucket_views)
        self.state = SparseHookState(ctx.world_size)
        self.hook = wrap_hook(self.state, cfg.ddp_hook, self.backend())    # torch's hook inside our timing
        self.ddp.register_comm_hook(self.state, sparse_aware_hook)
        dense = [p for p in model.parameters() if all(p is not t for t in tables)]
        self.optimizers = [local_optimizer(cfg, dense)]
        # gradients that are views into DDP's buckets are zeroed in place; a sparse gradient is replaced
        self.zero_to_none = [not self.bucket_views]
        if tables:
            self.optimizers.append(table_optimizer(cfg, tables, cfg.sparse_embeddings))
            self.zero_to_none.append(cfg.sparse_embeddings)
        self.ready_wall, self.grad_bytes, self.sparse_bytes, self._synced = [], [], 0, True
        self.checkpoint, self.resumed = None, None
        if cfg.ddp_checkpoint_dir:       # restartable by torchrun's elastic agent (worker/elastic.py)
            from worker.elastic import ElasticCheckpoint, restore
            self.checkpoint = ElasticCheckpoint(cfg.ddp_checkpoint_dir, cfg.ddp_checkpoint_every, ctx.rank)
            self.resumed = self.checkpoint.load()
            if self.resumed is not None:
                restore(self.resumed, model, self.optimizers)
                log.warning("worker %d: resumed from the checkpoint of step %d", ctx.rank, self.resumed["step"])
        dist.barrier()           # every rank has read the checkpoint before rank 0 writes the next one

    @property
    def first_step(self) -> int:
        return self.resumed["step"] if self.resumed is not None else 0

    def batches(self):
        batches = self.workload.batches(self.rank, self.ctx.world_size)
        for _ in range(self.first_step):     # a resumed job's data stream goes on where the checkpoint left it
            next(batches)
        return batches

    def begin(self, run) -> None:
        if self.resumed is not None:
            r = self.resumed
            run.resume(r["origin_wall"], r["eval_s"], r["evals"])
        elif self.checkpoint is not None:    # a job restarted before its first periodic checkpoint resumes here
            run.resume(time.time())
            self.checkpoint.save(0, self.model, self.optimizers, run)

    def end_step(self, run, step: int) -> None:
        if self.checkpoint is not None and self.checkpoint.due(step + 1):
            self.checkpoint.save(step + 1, self.model, self.optimizers, run)

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self, run, step: int, batch) -> StepOutcome:
        t0, state, world = run.step_start, self.state, self.ctx.world_size
        state.new_step()
        loss = self.workload.loss(self.ddp, batch)
        for opt, to_none in zip(self.optimizers, self.zero_to_none):
            opt.zero_grad(set_to_none=to_none)
        loss.backward()           # returns after all buckets are allreduced and averaged
        self._sync_device()
        t_bwd_wall, t_bwd = time.time(), time.perf_counter()
        for opt in self.optimizers:
            opt.step()
        self._sync_device()
        averaged = self.hook.after_step(self.ddp.parameters())     # local SGD: the periodic model average, else None
        end = time.perf_counter()
        blocked, ready = state.exposed_comm_s(t_bwd_wall, t_bwd - t0), state.ready_wall(t_bwd_wall)
        wire = ring_bytes(state.payload_bytes, world) + state.sparse_sent
        if averaged:
            avg_s, ready, avg_bytes = averaged
            blocked, wire = blocked + avg_s, wire + ring_bytes(avg_bytes, world)
        self.ready_wall.append(ready)
        run.comm(blocked)
        self.grad_bytes.append(state.bucket_bytes)
        self.sparse_bytes += state.sparse_sent
        # replicas are identical after every DDP step; under local SGD only right after the model average
        # (or before its start step, while gradients are still allreduced)
        avg = self.hook.averager
        self._synced = avg is None or averaged is not None or avg.step <= avg.warmup_steps
        return StepOutcome(loss.item(), wire, end)

    @property
    def synced(self) -> bool:
        return self._synced

    def finish(self, run) -> dict:
        world = self.ctx.world_size
        # Who was ready last, per step: gather everybody's last-bucket timestamps (no cost during training).
        mine = torch.tensor(self.ready_wall, dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        slowest = torch.stack(everyone).max(0).values.cpu().tolist()
        run.wait_times = [min(b, max(0.0, s - r)) for b, s, r in zip(run.blocked_times, slowest, self.ready_wall)]
        # every rank must hold the same parameters after DDP training (local SGD: only right after an average)
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        spread = flat.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        params_max_diff = (spread - flat).abs().max().item()
        sent = sum(run.wire_steps)
        # what plain fp32 DDP would have moved (+ the sparse rows, which have no dense figure)
        raw = sum(ring_bytes(b, world) for b in self.grad_bytes) + self.sparse_bytes
        extras = allreduce_extras(self.backend(), self.ctx.bucket_cap_mb, self.grad_bytes, world, params_max_diff,
                                  run.wire_steps, self.hook.extras)
        if self.cfg.sparse_embeddings:
            extras.update(sparse_embeddings=True, sparse_allgather_bytes=self.sparse_bytes,
                          table_optimizer=type(self.optimizers[-1]).__name__)
        return dict(bytes_pushed_wire=int(sent), bytes_pushed_raw=int(raw), bytes_pulled_wire=int(sent),
                    extras=extras)

    def report(self, result) -> None:
        dist.barrier()
