"""The trainer one worker process runs: MLP on digits through the parameter servers."""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ps.config import TrainConfig
from worker.data import load_digits_split, worker_batches
from worker.model import accuracy, make_mlp, param_count
from worker.optimizer import DistributedOptimizer

log = logging.getLogger("deltaps.worker")


def local_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_compressor(cfg: TrainConfig):
    if cfg.codec in ("", "none"):
        return None
    from compression import Compressor
    return Compressor(cfg.codec)


def train_ps(cfg: TrainConfig, servers: list[str], rank: int, world_size: int) -> dict:
    """Train for cfg.steps, then evaluate the servers' final parameters on the held-out split."""
    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te = load_digits_split(cfg.seed)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed)
    opt = DistributedOptimizer(local_optimizer(cfg, model.parameters()), model, servers=servers, rank=rank,
                               world_size=world_size, sync=cfg.sync, codec=cfg.codec,
                               compressor=make_compressor(cfg), chunk_bytes=cfg.chunk_bytes,
                               max_message_bytes=cfg.max_message_bytes, timeout_s=cfg.timeout_s)
    batches = worker_batches(x_tr, y_tr, rank, world_size, cfg.batch_size, cfg.seed)
    step_s, losses = [], []
    bar = tqdm(range(cfg.steps), desc=f"worker {rank}", disable=not cfg.progress, unit="step", dynamic_ncols=True, mininterval=0.5)
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        xb, yb = next(batches)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if cfg.log_every and step % cfg.log_every == 0:
            log.info("worker %d step %d loss %.4f", rank, step, losses[-1])
    wall = time.perf_counter() - t_start
    bar.close()
    # Everyone has pushed everything: take the servers' final parameters and evaluate them.
    opt.client.barrier("train-done")
    final = opt.client.pull(min_version=0)
    with torch.no_grad():
        for n, p in opt.named:
            p.copy_(final[n].view_as(p))
    acc = accuracy(model, x_te, y_te)
    comm = opt.client.stats.snapshot()
    blocked, wait = opt.timing["blocked_s"], opt.timing["wait_s"]
    total_step = sum(step_s)
    result = {
        "rank": rank, "steps": cfg.steps, "wall_s": wall, "mean_step_s": total_step / max(1, len(step_s)),
        "median_step_s": sorted(step_s)[len(step_s) // 2] if step_s else 0.0,
        "compute_s": total_step - blocked, "comm_s": blocked - wait, "wait_s": wait,
        "bytes_pushed_wire": int(comm.get("bytes_pushed_wire", 0)),
        "bytes_pushed_raw": int(comm.get("bytes_pushed_raw", 0)),
        "bytes_pulled_wire": int(comm.get("bytes_pulled_wire", 0)),
        "push_rpcs": int(comm.get("push_rpcs", 0)), "pull_rpcs": int(comm.get("pull_rpcs", 0)),
        "final_test_accuracy": acc, "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "samples_per_s": cfg.steps * cfg.batch_size / wall if wall > 0 else 0.0,
        "model_params": param_count(model), "losses": losses,
    }
    if rank == 0:
        result["server_stats"] = opt.client.server_stats()
    opt.client.barrier("exit")
    opt.close()
    return result
