"""Ring-allreduce baseline: the same trainer as train_ps, but gradients are averaged with
torch.distributed (DDP, bucketed allreduce; gloo on CPU, nccl on GPUs) and every rank runs the
optimizer locally. This is what users already run (DDP / Horovod) and what deltaps must beat.

Same model (make_mlp, same seed), same data shard per rank (worker_batches), same optimizer config
(local_optimizer), same steps; the result is a RunResult (worker/trainers/base.py) like train_ps's, so
deltaps.tools.launch.summarize works for both.

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

import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deltaps.config import TrainConfig
from worker.trainers.base import RunRecorder, local_optimizer, save_model
from worker.trainers.collective import (
    AllreduceHookState,
    check_ddp_hook,
    init_process_group,
    register_timed_hook,
    resolve_backend,
    ring_bytes,
)
from worker.workloads import load_split
from worker.workloads.digits import worker_batches
from worker.workloads.mlp import accuracy, make_mlp, param_count

__all__ = ["train_allreduce", "allreduce_extras"]

log = logging.getLogger("deltaps.allreduce")

TIMING_METHOD = ("ddp-comm-hook: blocked = backward return - last bucket ready; "
                 "wait = slowest rank's last-ready - mine (clipped); comm = blocked - wait")


def train_allreduce(cfg: TrainConfig, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                    master_port: int = 29500, backend: str = "auto", bucket_cap_mb: float = 25.0) -> dict:
    torch.set_num_threads(1)
    check_ddp_hook(cfg.ddp_hook)      # a bad --ddp-hook fails here, before the rendezvous
    backend = resolve_backend(backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        torch.cuda.set_device(device)
    init_process_group(cfg, rank, world_size, master_addr, master_port, backend)
    try:
        return _train(cfg, rank, world_size, backend, device, bucket_cap_mb)
    finally:
        dist.destroy_process_group()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce_extras(backend: str, bucket_cap_mb: float, grad_bytes_steps: list[int], world_size: int,
                     params_max_diff: float, wire_steps: list[int] | None = None, hook: dict | None = None) -> dict:
    """train_allreduce's own result keys (RunResult.extras). ring_bytes_per_step: the mean per step of the
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


def _train(cfg, rank, world_size, backend, device, bucket_cap_mb) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    x_tr, y_tr, x_te, y_te = load_split(cfg.workload, cfg.seed)
    x_tr, y_tr, x_te, y_te = x_tr.to(device), y_tr.to(device), x_te.to(device), y_te.to(device)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb)
    state = AllreduceHookState(world_size)
    hook = register_timed_hook(ddp, state, cfg.ddp_hook, backend)
    opt = local_optimizer(cfg, ddp.parameters())
    batches = worker_batches(x_tr, y_tr, rank, world_size, cfg.batch_size, cfg.seed)
    ready_wall, grad_bytes = [], []
    run = RunRecorder(cfg, rank, f"worker {rank} (allreduce)", log)
    dist.barrier()
    for _ in run.steps():
        t0 = run.step_start
        xb, yb = next(batches)
        state.new_step()
        loss = F.cross_entropy(ddp(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()           # returns after all buckets are allreduced and averaged
        _sync(device)
        t_bwd_wall, t_bwd = time.time(), time.perf_counter()
        opt.step()
        _sync(device)
        averaged = hook.after_step(ddp.parameters())     # local SGD: the periodic model average, else None
        end = time.perf_counter()
        blocked, ready = state.exposed_comm_s(t_bwd_wall, t_bwd - t0), state.ready_wall(t_bwd_wall)
        wire = ring_bytes(state.payload_bytes, world_size)
        if averaged:
            avg_s, ready, avg_bytes = averaged
            blocked, wire = blocked + avg_s, wire + ring_bytes(avg_bytes, world_size)
        ready_wall.append(ready)
        run.comm(blocked)
        grad_bytes.append(state.bucket_bytes)
        run.record(loss.item(), wire_bytes=wire, end=end)
        # replicas are identical after every DDP step; under local SGD only right after the model average
        # (or before its start step, while gradients are still allreduced)
        avg = hook.averager
        run.evaluate(lambda: accuracy(model, x_te, y_te),
                     synced=avg is None or averaged is not None or avg.step <= avg.warmup_steps)
    # Who was ready last, per step: gather everybody's last-bucket timestamps (no cost during training).
    mine = torch.tensor(ready_wall, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    slowest = torch.stack(everyone).max(0).values.cpu().tolist()
    run.wait_times = [min(b, max(0.0, s - r)) for b, s, r in zip(run.blocked_times, slowest, ready_wall)]
    acc = accuracy(model, x_te, y_te)
    save_model(cfg, rank, model)
    # every rank must hold the same parameters after DDP training (local SGD: only right after an average)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    params_max_diff = (spread - flat).abs().max().item()
    sent = sum(run.wire_steps)
    raw = sum(ring_bytes(b, world_size) for b in grad_bytes)    # what plain fp32 DDP would have moved
    result = run.result(final_test_accuracy=acc, model_params=param_count(model),
                        bytes_pushed_wire=int(sent), bytes_pushed_raw=int(raw), bytes_pulled_wire=int(sent),
                        extras=allreduce_extras(backend, bucket_cap_mb, grad_bytes, world_size, params_max_diff,
                                                run.wire_steps, hook.extras))
    dist.barrier()
    return result.to_dict()
