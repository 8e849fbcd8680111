"""`--mode ps`: every parameter on the shards, through a DistributedOptimizer — gradients every step, or
parameter deltas every --local-steps (local updates, the shards' outer optimizer); the codec rollback switch
(LossGuard) and a clean SIGTERM."""
from __future__ import annotations

import logging
import math
import signal
import statistics
import threading
import time

from deltaps.errors import PSError
from worker.trainers.base import comm_counters, distributed_optimizer
from worker.trainers.strategy import StepOutcome, Strategy, WorkerStopped, register

log = logging.getLogger("deltaps.worker")


def adopt_server_params(opt, flush: bool = True) -> None:
    """Everyone has pushed everything: take the servers' final parameters (and synchronised buffers) into the model.
    flush: a local-update job's inner steps since the last round take a last round first, then the shards' exact
    model is pulled. False when an evaluation stopped the job: the model it judged is the result, the shared pull
    view (a lossy pull lags the exact model; quorum ranks > 0, stopped by rank 0: their own last pull)."""
    if flush:
        opt.flush()
    else:
        opt.synchronize()    # exchanges in flight complete; nothing new is pushed
    opt.client.barrier("train-done")
    opt.load(opt.client.pull(min_version=0) if flush else opt.staging)


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


def _install_sigterm(opt) -> threading.Event:
    """SIGTERM: finish the current step (or abort it if it is stuck reconnecting), then stop."""
    stopping = threading.Event()

    def handler(*_):
        stopping.set()
        opt.client.closed.set()     # stop reconnect/backoff loops
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return stopping


@register("ps")
class ParameterServer(Strategy):
    needs_servers = True
    local_updates = True
    gpu = True

    @classmethod
    def validate(cls, cfg, workload_cls) -> None:
        super().validate(cfg, workload_cls)
        if cfg.sync.startswith("quorum") and not cfg.local_steps:
            raise ValueError(f"--sync {cfg.sync} needs --local-steps H > 0: quorum rounds are local-update rounds "
                             f"(a late delta folds into the next round; a late gradient would not)")
        if cfg.local_steps:
            from deltaps.optimizer_config import overlap_steps
            from deltaps.sync import parse_sync
            from worker.local_updates import check_pace
            check_pace(parse_sync(cfg.sync).inner, cfg.stream_fragments,
                       overlap_steps(cfg.local_steps, cfg.stream_fragments, None if cfg.overlap_steps < 0 else cfg.overlap_steps))
        cls.target_needs_bsp(cfg, workload_cls)

    @property
    def desc(self) -> str:
        return f"worker {self.rank}" + (f" ({self.device})" if self.device.type != "cpu" else "")

    def setup(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.workload.to(self.device)
        self.model = self.workload.build_model().to(self.device)   # a GPU model compresses on the GPU
        self.opt = opt = distributed_optimizer(cfg, self.model, ctx.servers, ctx.rank, ctx.world_size, ctx.security)
        self.closables.append(opt.close)
        self.stopping = _install_sigterm(opt)
        self.stats_after_setup = opt.client.stats.snapshot()     # the initial full pull is not a round's bytes
        if opt.clock:
            log.warning("worker %d joined a running job at step %d", self.rank, opt.clock)
        if ctx.metrics is not None:
            ctx.metrics.attach(opt)
        self.fallbacks: list[dict] = []
        self.guard = LossGuard(cfg.fallback_factor, cfg.fallback_warmup_steps, cfg.fallback_loss_floor)

    @property
    def first_step(self) -> int:
        return self.opt.clock      # a worker (re)joining a running job starts at the job's step

    def end_step(self, run, step: int) -> None:
        if self.opt.clock > step + 1:    # quorum rounds went on past this worker's own steps (LocalUpdates)
            run.skip_to(self.opt.clock)

    def batches(self):
        cfg, opt = self.cfg, self.opt
        live = (lambda: opt.client.live_workers) if cfg.min_workers or cfg.max_workers else None  # elastic
        return self.workload.batches(self.rank, self.ctx.world_size, live=live)

    def train_step(self, run, step: int, batch) -> StepOutcome:
        opt = self.opt
        wire0 = opt.client.stats.snapshot().get("bytes_pushed_wire", 0)
        timing0 = dict(opt.timing)
        loss = self.workload.loss(self.model, batch)
        opt.zero_grad()
        self._rollback_check(step, loss.item())
        if math.isfinite(loss.item()):
            loss.backward()
        try:
            opt.step()  # a non-finite loss pushes zero gradients: the step is skipped, not poisoned
        except PSError:
            if not self.stopping.is_set():
                raise
        if opt.client.job_stop is not None:   # quorum: rank 0 reached the target (evaluate below)
            run.stop_with(opt.client.job_stop)
        if self.stopping.is_set():   # SIGTERM: leave without the end-of-job barriers; the shards evict us
            log.warning("worker %d: SIGTERM at step %d; closing channels and exiting", self.rank, opt.clock)
            raise WorkerStopped(f"worker {self.rank} stopped by SIGTERM at step {opt.clock}")
        run.comm_since(opt.timing, timing0)
        return StepOutcome(loss.item(), opt.client.stats.snapshot().get("bytes_pushed_wire", 0) - wire0)

    def _rollback_check(self, step: int, loss: float) -> None:
        """The rollback switch: the whole job goes back to uncompressed gradients when the loss goes bad."""
        opt = self.opt
        reason = self.guard.check(loss) if opt.client.codec != "none" else None
        if reason:
            log.warning("worker %d step %d: %s; switching codec %s -> none", self.rank, step, reason, opt.client.codec)
            opt.client.set_codec("none")
            self.fallbacks.append({"step": step, "reason": reason})
            if self.ctx.metrics is not None:
                self.ctx.metrics.on_fallback(reason)

    @property
    def quorum(self) -> bool:
        return self.opt.client.sync.kind == "quorum"

    @property
    def synced(self) -> bool:
        # bsp: every rank pulled the same global model (local updates: after a round); quorum: the global model
        # this rank last pulled (the ranks' rounds differ)
        return self.opt.synced

    @property
    def judges(self) -> bool:
        # quorum: rank 0 alone judges and stops the job for all (finish); the others evaluate too, off their clocks,
        # so no rank trains on while another evaluates (a bsp or torchft rank waits for everyone's evaluation)
        return self.rank == 0 or not self.quorum

    def evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        with self.opt.global_model():   # what step() pulled; local-update jobs: the shards' model as last pulled
            evaluation = self.workload.evaluate(self.model)
        if self.opt.local is not None:  # not training: out of the round pace (inner=adaptive) as out of the clock
            self.opt.local.off_clock(time.perf_counter() - t0)
        return evaluation

    def finish(self, run) -> dict:
        opt = self.opt
        if self.quorum and run.steps_to_target is not None and opt.client.job_stop is None:
            opt.client.stop(run.steps_to_target, run.time_to_target_s, f"worker {self.rank} reached the target")
        steady = self._steady_rounds() if opt.local else {}
        # pulled in the loop: neither the initial full pull nor the end-of-job one below (bench's pulled per step)
        loop_pulled = opt.client.stats.snapshot().get("bytes_pulled_wire", 0) - \
            self.stats_after_setup.get("bytes_pulled_wire", 0)
        # a job an evaluation stopped keeps the global model it evaluated (no flush of inner steps); so does the
        # quorum job's judge, whatever ended its loop: the keys' rounds close independently, so the shards' keys may be
        # a round apart at the stop (docs/local-updates.md#quorum-rounds)
        judge = self.quorum and opt.client.job_stop is not None and opt.client.job_stop["worker_id"] == self.rank
        adopt_server_params(opt, flush=run.stopped_at is None and not judge)
        note = {"optimizer_note": f"server {self.cfg.optimizer} on every parameter, table included"}
        return dict(**comm_counters(opt.client.stats.snapshot()), loop_bytes_pulled_wire=int(loop_pulled),
                    codec=self.cfg.codec, final_codec=opt.client.codec,
                    codec_switches=opt.codec_switches, codec_fallbacks=self.fallbacks,
                    extras={**steady, **(note if self.workload.has_embeddings else {})})

    def _steady_rounds(self) -> dict:
        """A local-update job's bytes pushed + pulled over the rounds the loop completed, and how many full rounds
        (every fragment once) that was: the initial full pull and the end-of-job flush and pull left out."""
        opt = self.opt
        opt.synchronize()                    # the exchanges in flight complete; no new round is started
        now, before = opt.client.stats.snapshot(), self.stats_after_setup
        moved = sum(now.get(k, 0) - before.get(k, 0) for k in ("bytes_pushed_wire", "bytes_pulled_wire"))
        sizes = opt.local.round_sizes      # inner steps per round pushed (inner=adaptive: fewer on a slow worker)
        return {"steady_bytes_moved": int(moved), "steady_rounds": opt.local.outer_rounds / len(opt.local.fragments),
                "inner_steps_per_round": statistics.median(sizes) if sizes else None,
                "payload_energy_share": opt.client.compressor.stats()["payload_energy_share"]}

    def report(self, result) -> None:
        if self.rank == 0:
            result.server_stats = self.opt.client.server_stats()
        self.opt.client.barrier("exit")
