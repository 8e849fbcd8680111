"""The trainer one worker process runs: MLP on digits through the parameter servers."""
from __future__ import annotations

import logging
import math
import signal
import threading
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from deltaps.config import TrainConfig
from deltaps.errors import PSError
from worker.optimizer import DistributedOptimizer
from worker.workloads.digits import load_digits_split, worker_batches
from worker.workloads.mlp import accuracy, make_mlp, param_count

log = logging.getLogger("deltaps.worker")


def local_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_compressor(cfg: TrainConfig):
    from compression import Compressor
    return Compressor(cfg.codec, min_bytes=cfg.min_compress_bytes, warmup_steps=cfg.compress_warmup_steps)


class LossGuard:
    """Automatic rollback trigger: NaN/Inf loss, or smoothed loss above factor x its running minimum."""

    def __init__(self, factor: float, warmup_steps: int, floor: float, beta: float = 0.95):
        self.factor, self.warmup, self.floor, self.beta = factor, warmup_steps, floor, beta
        self.ema = self.min_ema = None
        self.steps = 0

    def check(self, loss: float) -> str | None:
        """A reason to roll back, or None."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        self.steps += 1
        self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
        if self.steps <= self.warmup:
            self.min_ema = self.ema if self.min_ema is None else min(self.min_ema, self.ema)
            return None
        self.min_ema = min(self.min_ema, self.ema)
        if self.factor > 0 and self.ema > self.factor * max(self.min_ema, self.floor):
            return f"smoothed loss {self.ema:.4g} > {self.factor} x running minimum {max(self.min_ema, self.floor):.4g}"
        return None


class WorkerStopped(RuntimeError):
    """The worker got SIGTERM and left the job cleanly (channels closed, no result)."""


def _install_sigterm(opt) -> threading.Event:
    """SIGTERM: finish the current step (or abort it if it is stuck reconnecting), then stop."""
    stopping = threading.Event()

    def handler(*_):
        stopping.set()
        opt.client.closed.set()     # stop reconnect/backoff loops
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return stopping


def train_ps(cfg: TrainConfig, servers: list[str], rank: int, world_size: int, metrics=None,
             security=None) -> dict:
    """metrics: optional worker.metrics.WorkerMetrics fed once per step; security: deltaps.security.Security."""
    """Train for cfg.steps, then evaluate the servers' final parameters on the held-out split."""
    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te = load_digits_split(cfg.seed)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed)
    opt = DistributedOptimizer(local_optimizer(cfg, model.parameters()), model, servers=servers, rank=rank,
                               world_size=world_size, sync=cfg.sync, codec=cfg.codec, pull_codec=cfg.pull_codec,
                               compressor=make_compressor(cfg), chunk_bytes=cfg.chunk_bytes,
                               max_message_bytes=cfg.max_message_bytes, bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s,
                               security=security, reconnect_deadline_s=cfg.reconnect_deadline_s,
                               replay_steps=cfg.replay_steps)
    stopping = _install_sigterm(opt)
    if opt.clock:
        log.warning("worker %d joined a running job at step %d", rank, opt.clock)
    if metrics is not None:
        metrics.attach(opt)
    batches = worker_batches(x_tr, y_tr, rank, world_size, cfg.batch_size, cfg.seed)
    step_s, losses, wire_per_step, fallbacks = [], [], [], []
    guard = LossGuard(cfg.fallback_factor, cfg.fallback_warmup_steps, cfg.fallback_loss_floor)
    bar = tqdm(range(opt.clock, cfg.steps), desc=f"worker {rank}", disable=not cfg.progress, unit="step", dynamic_ncols=True, mininterval=0.5)
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        xb, yb = next(batches)
        wire0 = opt.client.stats.snapshot().get("bytes_pushed_wire", 0)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        reason = guard.check(loss.item()) if opt.client.codec != "none" else None
        if reason:   # rollback switch: the whole job goes back to uncompressed gradients
            log.warning("worker %d step %d: %s; switching codec %s -> none", rank, step, reason, opt.client.codec)
            opt.client.set_codec("none")
            fallbacks.append({"step": step, "reason": reason})
            if metrics is not None:
                metrics.on_fallback(reason)
        if math.isfinite(loss.item()):
            loss.backward()
        try:
            opt.step()  # a non-finite loss pushes zero gradients: the step is skipped, not poisoned
        except PSError:
            if stopping.is_set():
                break
            raise
        if stopping.is_set():
            break
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if metrics is not None:
            metrics.on_step(step_s[-1], losses[-1], len(yb))
        wire_per_step.append(opt.client.stats.snapshot().get("bytes_pushed_wire", 0) - wire0)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if cfg.log_every and step % cfg.log_every == 0:
            log.info("worker %d step %d loss %.4f", rank, step, losses[-1])
    wall = time.perf_counter() - t_start
    bar.close()
    if stopping.is_set():   # SIGTERM: leave without the end-of-job barriers; the shards evict us
        log.warning("worker %d: SIGTERM at step %d; closing channels and exiting", rank, opt.clock)
        opt.close()
        raise WorkerStopped(f"worker {rank} stopped by SIGTERM at step {opt.clock}")
    # Everyone has pushed everything: take the servers' final parameters and evaluate them.
    opt.client.barrier("train-done")
    final = opt.client.pull(min_version=0)
    with torch.no_grad():
        for n, p in opt.named:
            p.copy_(final[n].view_as(p))
    acc = accuracy(model, x_te, y_te)
    if cfg.save_model and rank == 0:
        torch.save(model.state_dict(), cfg.save_model)
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
        "push_pull_rpcs": int(comm.get("push_pull_rpcs", 0)),
        "final_test_accuracy": acc, "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "samples_per_s": cfg.steps * cfg.batch_size / wall if wall > 0 else 0.0,
        "model_params": param_count(model), "losses": losses,
        "codec": cfg.codec, "final_codec": opt.client.codec, "codec_switches": opt.codec_switches,
        "codec_fallbacks": fallbacks, "bytes_pushed_wire_steps": wire_per_step,
    }
    if rank == 0:
        result["server_stats"] = opt.client.server_stats()
    opt.client.barrier("exit")
    opt.close()
    return result
