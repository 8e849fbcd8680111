"""The trainer one worker process runs: MLP on digits (or --workload clf) through the parameter servers."""
from __future__ import annotations

import logging
import math
import signal
import threading

import torch
import torch.nn.functional as F

from deltaps.config import TrainConfig
from deltaps.errors import PSError
from worker.trainers.base import (
    RunRecorder,
    adopt_server_params,
    comm_counters,
    distributed_optimizer,
    save_model,
)
from worker.workloads import load_split
from worker.workloads.digits import elastic_batches, worker_batches
from worker.workloads.mlp import accuracy, make_mlp, param_count

log = logging.getLogger("deltaps.worker")


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


def _global_accuracy(opt, model, x, y) -> float:
    with opt.global_model():
        return accuracy(model, x, y)


def train_ps(cfg: TrainConfig, servers: list[str], rank: int, world_size: int, metrics=None,
             security=None) -> dict:
    """Train for cfg.steps, then evaluate the servers' final parameters on the held-out split.
    metrics: optional worker.metrics.WorkerMetrics fed once per step; security: deltaps.security.Security."""
    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te = load_split(cfg.workload, cfg.seed)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed)
    opt = distributed_optimizer(cfg, model, servers, rank, world_size, security)
    stopping = _install_sigterm(opt)
    if opt.clock:
        log.warning("worker %d joined a running job at step %d", rank, opt.clock)
    if metrics is not None:
        metrics.attach(opt)
    if cfg.min_workers or cfg.max_workers:   # elastic: the data follows the live set
        batches = elastic_batches(x_tr, y_tr, rank, lambda: opt.client.live_workers, cfg.batch_size, cfg.seed)
    else:
        batches = worker_batches(x_tr, y_tr, rank, world_size, cfg.batch_size, cfg.seed)
    fallbacks = []
    guard = LossGuard(cfg.fallback_factor, cfg.fallback_warmup_steps, cfg.fallback_loss_floor)
    run = RunRecorder(cfg, rank, f"worker {rank}", log)
    for step in run.steps(first=opt.clock):
        xb, yb = next(batches)
        wire0 = opt.client.stats.snapshot().get("bytes_pushed_wire", 0)
        timing0 = dict(opt.timing)
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
        run.comm_since(opt.timing, timing0)
        step_s = run.record(loss.item(), wire_bytes=opt.client.stats.snapshot().get("bytes_pushed_wire", 0) - wire0)
        if metrics is not None:
            metrics.on_step(step_s, loss.item(), len(yb))
        # the global model (what step() pulled; local-update jobs: the shards' model as last pulled); may end
        # the loop (bsp only: the same model, and decision, on every rank)
        run.evaluate(lambda: _global_accuracy(opt, model, x_te, y_te), synced=opt.synced)
    if stopping.is_set():   # SIGTERM: leave without the end-of-job barriers; the shards evict us
        log.warning("worker %d: SIGTERM at step %d; closing channels and exiting", rank, opt.clock)
        opt.close()
        raise WorkerStopped(f"worker {rank} stopped by SIGTERM at step {opt.clock}")
    adopt_server_params(opt, flush=run.steps_to_target is None)
    acc = accuracy(model, x_te, y_te)
    save_model(cfg, rank, model)
    result = run.result(final_test_accuracy=acc, model_params=param_count(model),
                        **comm_counters(opt.client.stats.snapshot()), codec=cfg.codec, final_codec=opt.client.codec,
                        codec_switches=opt.codec_switches, codec_fallbacks=fallbacks)
    if rank == 0:
        result.server_stats = opt.client.server_stats()
    opt.client.barrier("exit")
    opt.close()
    return result.to_dict()
