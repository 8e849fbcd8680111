"""Ring-allreduce baseline: the same trainer as train_ps, but gradients are averaged with
torch.distributed (DDP, bucketed allreduce; gloo on CPU, nccl on GPUs) and every rank runs the
optimizer locally. This is what users already run (DDP / Horovod) and what deltaps must beat.

Same model (make_mlp, same seed), same data shard per rank (worker_batches), same optimizer config
(local_optimizer), same steps; the result dict has the keys train_ps returns, so deltaps.tools.launch.summarize
works for both.

Step-time split (how it is measured, per step, per rank):
  * a DDP communication hook timestamps each gradient bucket when autograd hands it over ("ready");
    the last bucket's ready time marks the end of this rank's own backward compute;
  * backward() returns only after every bucket's allreduce finished; the time from the last ready
    timestamp to that return is time blocked on communication ("exposed", i.e. not overlapped);
  * after training the per-step last-ready timestamps (wall clock, shared by processes on one host)
    are all-gathered; wait = (slowest rank's last-ready time - mine), clipped to the blocked time:
    the part of the block spent waiting for peers to finish their compute (stragglers);
    comm = blocked - wait: moving bytes after everyone was ready;
  * compute = step time - comm - wait (forward, backward, optimizer step; communication that
    overlaps with backward is hidden and therefore counted as compute, which is what it costs).
  Across hosts the wait/comm split depends on clock synchronisation; their sum does not.

Bytes: a ring allreduce of G gradient bytes over p ranks sends (and receives) 2(p-1)/p * G per rank;
bytes_pushed_* / bytes_pulled_wire report that model figure, with G measured from the buckets.
"""
from __future__ import annotations

import datetime
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from deltaps.config import TrainConfig
from worker.workloads.digits import load_digits_split, worker_batches
from worker.workloads.mlp import accuracy, make_mlp, param_count

log = logging.getLogger("deltaps.allreduce")


def ring_bytes(grad_bytes: int, world_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring allreduce of grad_bytes."""
    return int(2 * (world_size - 1) * grad_bytes // world_size) if world_size > 1 else 0


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return backend


class _HookState:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.last_ready = 0.0       # wall clock (time.time) of the latest bucket handed over this step
        self.bucket_bytes = 0       # gradient bytes allreduced this step


def _timed_allreduce_hook(state: _HookState, bucket):
    """Same as DDP's default allreduce hook (average), plus a ready timestamp and a byte count."""
    state.last_ready = max(state.last_ready, time.time())
    buf = bucket.buffer()
    state.bucket_bytes += buf.numel() * buf.element_size()
    buf.div_(state.world_size)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def env_rendezvous(rank: int | None, world_size: int | None, master_addr: str | None,
                   master_port: int | None) -> tuple[int, int, str, int]:
    """Flags win; otherwise torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT."""
    rank = rank if rank is not None else int(os.environ.get("RANK", "-1"))
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "-1"))
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = master_port or int(os.environ.get("MASTER_PORT", "29500"))
    if rank < 0 or world_size < 1:
        raise ValueError("allreduce worker needs --rank/--world-size or torchrun's RANK/WORLD_SIZE")
    return rank, world_size, master_addr, master_port


def train_allreduce(cfg: TrainConfig, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                    master_port: int = 29500, backend: str = "auto", bucket_cap_mb: float = 25.0) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.trainers.ps import local_optimizer

    torch.set_num_threads(1)
    backend = resolve_backend(backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s * 4))
    try:
        return _train(cfg, rank, world_size, backend, device, bucket_cap_mb, DDP, local_optimizer)
    finally:
        dist.destroy_process_group()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(cfg, rank, world_size, backend, device, bucket_cap_mb, DDP, local_optimizer) -> dict:
    x_tr, y_tr, x_te, y_te = load_digits_split(cfg.seed)
    x_tr, y_tr = x_tr.to(device), y_tr.to(device)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb)
    state = _HookState(world_size)
    ddp.register_comm_hook(state, _timed_allreduce_hook)
    opt = local_optimizer(cfg, ddp.parameters())
    batches = worker_batches(x_tr, y_tr, rank, world_size, cfg.batch_size, cfg.seed)
    step_s, blocked_s, ready_wall, losses, grad_bytes = [], [], [], [], []
    bar = tqdm(range(cfg.steps), desc=f"worker {rank} (allreduce)", disable=not cfg.progress, unit="step",
               dynamic_ncols=True, mininterval=0.5)
    dist.barrier()
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        xb, yb = next(batches)
        state.last_ready, state.bucket_bytes = 0.0, 0
        loss = F.cross_entropy(ddp(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()           # returns after all buckets are allreduced and averaged
        _sync(device)
        t_bwd_wall, t_bwd = time.time(), time.perf_counter()
        opt.step()
        _sync(device)
        step_s.append(time.perf_counter() - t0)
        ready = state.last_ready or t_bwd_wall
        ready_wall.append(ready)
        blocked_s.append(max(0.0, min(t_bwd_wall - ready, t_bwd - t0)))
        grad_bytes.append(state.bucket_bytes)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if cfg.log_every and step % cfg.log_every == 0:
            log.info("worker %d step %d loss %.4f", rank, step, losses[-1])
    wall = time.perf_counter() - t_start
    bar.close()
    # Who was ready last, per step: gather everybody's last-bucket timestamps (no cost during training).
    mine = torch.tensor(ready_wall, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    slowest = torch.stack(everyone).max(0).values.cpu().tolist()
    wait_steps = [min(b, max(0.0, s - r)) for b, s, r in zip(blocked_s, slowest, ready_wall)]
    wait = sum(wait_steps)
    comm = sum(blocked_s) - wait
    total_step = sum(step_s)
    acc = accuracy(model, x_te.to(device), y_te.to(device))
    if cfg.save_model and rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, cfg.save_model)
    # every rank must hold the same parameters after DDP training
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    params_max_diff = (spread - flat).abs().max().item()
    g = grad_bytes[-1] if grad_bytes else 0
    per_step = ring_bytes(g, world_size)
    sent = sum(ring_bytes(b, world_size) for b in grad_bytes)
    result = {
        "rank": rank, "steps": cfg.steps, "wall_s": wall, "mean_step_s": total_step / max(1, len(step_s)),
        "median_step_s": sorted(step_s)[len(step_s) // 2] if step_s else 0.0,
        "compute_s": total_step - comm - wait, "comm_s": comm, "wait_s": wait,
        "bytes_pushed_wire": int(sent), "bytes_pushed_raw": int(sent), "bytes_pulled_wire": int(sent),
        "push_rpcs": 0, "pull_rpcs": 0, "push_pull_rpcs": 0,
        "final_test_accuracy": acc, "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "samples_per_s": cfg.steps * cfg.batch_size / wall if wall > 0 else 0.0,
        "model_params": param_count(model), "losses": losses,
        "codec": "none", "final_codec": "none", "codec_switches": [], "codec_fallbacks": [],
        "bytes_pushed_wire_steps": [ring_bytes(b, world_size) for b in grad_bytes],
        "backend": backend, "bucket_cap_mb": bucket_cap_mb, "grad_bytes_per_step": g,
        "ring_bytes_per_step": per_step, "params_max_diff_across_ranks": params_max_diff,
        "timing_method": "ddp-comm-hook: blocked = backward return - last bucket ready; "
                         "wait = slowest rank's last-ready - mine (clipped); comm = blocked - wait",
    }
    dist.barrier()
    return result
