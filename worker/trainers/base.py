"""The trainer seam: what every training loop records and reports, and the helpers the loops share.

* `RunRecorder` is the loop skeleton: `for step in run.steps():` drives the progress bar, the wall clock
  and each step's timer; inside a step the trainer reports time blocked on communication (`run.comm`)
  and closes the step with `run.record(loss)`.
* `RunResult` is one rank's report: the per-step records plus the figures every mode reports, with the
  mode's own figures in `extras`. Derived figures (mean/median step, the compute/comm/wait split,
  final_train_loss, samples/s) have one rule each, here; `to_dict()` is the JSON a worker writes and
  deltaps.tools.launch.summarize reads.

Evaluation during training (--eval-every, --target-accuracy; ps and allreduce modes): after `record()`
the trainer calls `run.evaluate(fn, synced)`; the evaluation is timed apart and left out of the step times
and the wall clock, so `time_s` of an evaluation (and `time_to_target_s`) is training time only. The
recorder ends the loop after the first evaluation that reaches the target (with --common-step S: after the
evaluation due at S, if that comes later, so every mode of a race has a metric at step S); every rank evaluates
the same model (synced) on the same test set, so all ranks stop at the same step without talking.
With --eval-log every evaluation is also appended to a JSON-lines file as it happens (a running job's progress:
bench compare's --time-cap reads it).

Step split (every mode): a step's time = compute + comm + wait, where `blocked` is the time the step was
blocked on communication, `wait` the part of it spent waiting for peers / the server's BSP gate, comm =
blocked - wait, compute = step - blocked.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from tqdm import tqdm

from deltaps.config import TrainConfig
from worker.trainers.context import ClientOptions

FINAL_LOSS_WINDOW = 20     # final_train_loss = mean of the last this-many logged step losses

# Keys every mode's result dict has (to_dict); `server_stats` is added on rank 0 of modes with shards.
COMMON_KEYS = (
    "rank", "steps", "wall_s", "mean_step_s", "median_step_s", "compute_s", "comm_s", "wait_s",
    "bytes_pushed_wire", "bytes_pushed_raw", "bytes_pulled_wire", "loop_bytes_pulled_wire", "push_rpcs", "pull_rpcs",
    "push_pull_rpcs", "final_test_accuracy", "final_train_loss", "samples_per_s", "model_params", "losses",
    "codec", "final_codec", "codec_switches", "codec_fallbacks", "bytes_pushed_wire_steps",
)


# ---- shared helpers ----------------------------------------------------------------------------------
def local_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    """The torch optimizer --optimizer/--lr/... describe (run locally, or shipped to the PS as its config), every mode's,
    peers' included. Adam fused where torch has it: 3.50 -> 0.34 ms a step on clf's 648k parameters, one thread."""
    if cfg.optimizer == "adam":
        params = list(params)
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def table_optimizer(cfg: TrainConfig, params, sparse: bool = False) -> torch.optim.Optimizer:
    """The local table optimizer of the allreduce modes: --embedding-optimizer at --embedding-lr (the PS table's
    eps). sparse: for a sparse gradient; torch's SGD and Adagrad take one as is, adam becomes SparseAdam."""
    if cfg.embedding_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.embedding_lr, eps=1e-10)
    if cfg.embedding_optimizer == "adam":
        return (torch.optim.SparseAdam if sparse else torch.optim.Adam)(params, lr=cfg.embedding_lr)
    return torch.optim.SGD(params, lr=cfg.embedding_lr)


def make_compressor(cfg: TrainConfig):
    from compression import Compressor
    # a local-update job pushes once per round: cheap to measure how much of each delta its payload carries
    return Compressor(cfg.codec, min_bytes=cfg.min_compress_bytes, warmup_steps=cfg.compress_warmup_steps,
                      measure_energy=cfg.local_steps > 0)


def distributed_optimizer(cfg: TrainConfig, model, servers: list[str], rank: int, world_size: int, security=None):
    """A DistributedOptimizer over the whole model, configured from cfg (ps mode, ctr ps mode)."""
    from deltaps.optimizer_config import outer_optimizer_config
    from worker.optimizer import DistributedOptimizer
    outer = (outer_optimizer_config(cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum, cfg.pull_residual)
             if cfg.local_steps else None)
    return DistributedOptimizer(local_optimizer(cfg, model.parameters()), model, servers=servers, rank=rank,
                                world_size=world_size, codec=cfg.codec, pull_codec=cfg.pull_codec,
                                compressor=make_compressor(cfg), bucket_bytes=cfg.bucket_bytes,
                                **ClientOptions.from_config(cfg, security).kwargs(), heartbeat_s=cfg.heartbeat,
                                min_workers=cfg.min_workers, max_workers=cfg.max_workers, buffers=cfg.buffer_sync,
                                local_steps=cfg.local_steps, stream_fragments=cfg.stream_fragments, outer=outer,
                                overlap_steps=None if cfg.overlap_steps < 0 else cfg.overlap_steps)


def load_params(named, values: dict[str, torch.Tensor]) -> None:
    """Copy pulled values into the named parameters (for evaluation after training)."""
    with torch.no_grad():
        for n, p in named:
            p.copy_(values[n].view_as(p))


def save_model(cfg: TrainConfig, rank: int, state: dict) -> None:
    """--save-model (the loop calls it only then): rank 0 writes the model's state_dict, on the CPU."""
    if rank == 0:
        torch.save({k: v.cpu() for k, v in state.items()}, cfg.save_model)


def comm_counters(stats: dict) -> dict:
    """RunResult's byte / RPC fields from a PS client's CommStats snapshot."""
    return {k: int(stats.get(k, 0)) for k in ("bytes_pushed_wire", "bytes_pushed_raw", "bytes_pulled_wire",
                                              "push_rpcs", "pull_rpcs", "push_pull_rpcs")}


# ---- the report ----------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One rank's run. Per-step records (one entry per completed step; `losses` only where the rank
    knows the loss) and the figures every mode reports; mode-specific figures go in `extras`."""
    rank: int
    steps: int                      # steps of the job (cfg.steps, or fewer when the target accuracy stopped it)
    wall_s: float                   # the training loop's wall time
    samples: float                  # samples credited to this rank (the samples_per_s numerator)
    final_test_accuracy: float
    model_params: int
    step_times: list[float] = field(default_factory=list)
    blocked_times: list[float] = field(default_factory=list)   # per step: blocked on communication (comm + wait)
    wait_times: list[float] = field(default_factory=list)      # per step: of which waiting for peers / the BSP gate
    losses: list[float] = field(default_factory=list)
    bytes_pushed_wire_steps: list[int] = field(default_factory=list)
    bytes_pushed_wire: int = 0
    bytes_pushed_raw: int = 0
    bytes_pulled_wire: int = 0
    loop_bytes_pulled_wire: int | None = None   # of which the training loop's (PS: no initial / final full pull)
    push_rpcs: int = 0
    pull_rpcs: int = 0
    push_pull_rpcs: int = 0
    codec: str = "none"
    final_codec: str = "none"
    codec_switches: list = field(default_factory=list)
    codec_fallbacks: list = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    server_stats: list | None = None   # rank 0 of modes with shards

    def __post_init__(self):
        if self.loop_bytes_pulled_wire is None:     # modes without pulls outside their loop
            self.loop_bytes_pulled_wire = self.bytes_pulled_wire

    @property
    def total_step_s(self) -> float:
        return sum(self.step_times)

    @property
    def mean_step_s(self) -> float:
        return self.total_step_s / max(1, len(self.step_times))

    @property
    def median_step_s(self) -> float:
        return sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else 0.0

    @property
    def wait_s(self) -> float:
        return sum(self.wait_times)

    @property
    def comm_s(self) -> float:
        return sum(self.blocked_times) - self.wait_s

    @property
    def compute_s(self) -> float:
        return self.total_step_s - sum(self.blocked_times)

    @property
    def final_train_loss(self) -> float:
        tail = self.losses[-FINAL_LOSS_WINDOW:]
        return sum(tail) / max(1, len(tail))

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        """The result JSON: COMMON_KEYS, then the extras, then server_stats where there are any."""
        out = {k: getattr(self, k) for k in COMMON_KEYS}
        clash = set(out) & set(self.extras)
        if clash:
            raise ValueError(f"extras redefine common result keys {sorted(clash)}")
        out.update(self.extras)
        if self.server_stats is not None:
            out["server_stats"] = self.server_stats
        return out


# ---- the loop skeleton ---------------------------------------------------------------------------------
class RunRecorder:
    """Feeds a RunResult: `for step in run.steps(): ... run.comm(blocked, wait) ... run.record(loss)`.

    A step's timer starts when `steps()` yields it and stops at `record()` (or at its `end`); steps left by
    `break` before `record()` are not counted. `evaluate()` after `record()` may end the loop (target reached)."""

    def __init__(self, cfg: TrainConfig, rank: int, desc: str, log: logging.Logger, metric: str = "test_accuracy",
                 target_key: str = "target_accuracy", reaches=None):
        self.cfg, self.rank, self.desc, self.log = cfg, rank, desc, log
        self.step_times: list[float] = []
        self.blocked_times: list[float] = []
        self.wait_times: list[float] = []
        self.losses: list[float] = []
        self.wire_steps: list[int] = []
        self.wall_s = 0.0
        self._bar = None
        self._step, self._t0, self._blocked, self._wait = 0, 0.0, 0.0, 0.0
        # evaluation during training: never on the clock (eval_s is subtracted from every training time)
        self.evals: list[dict] = []
        self.eval_s = 0.0
        self.unjudged_evals = 0                  # evaluations run but not judged (--sync quorum, ranks > 0)
        self.steps_to_target: int | None = None
        self.time_to_target_s: float | None = None
        self.stopped_at: int | None = None      # the step the loop ended after, when an evaluation ended it early
        self.halted = False                      # another rank stopped the job (stop_with)
        self._skip_to = 0                        # skip_to: the next step, when the job is ahead of this loop
        self.straggler_s = [0.0, 0.0]            # --straggler: compute measured, time slept
        self._t_start = 0.0
        self._origin_wall: float | None = None   # a restartable job's clock origin (resume)
        self._eval_due = False
        # what the evaluations measure and the config field / result key of its target: the workload's
        self.metric, self.target_key, self.target = metric, target_key, getattr(cfg, target_key)
        # reaches(evaluation, target): the workload's rule (direction; a fraction compared as a count)
        self.reaches = reaches or (lambda evaluation, target: evaluation[metric] >= target)

    def steps(self, first: int = 0) -> Iterator[int]:
        """Steps first .. cfg.steps - 1 under a progress bar; wall_s covers the whole loop."""
        self._bar = tqdm(total=max(0, self.cfg.steps - first), desc=self.desc, disable=not self.cfg.progress,
                         unit="step", dynamic_ncols=True, mininterval=0.5)
        try:
            # a restarted job's clock runs on from its first incarnation's start (resume)
            behind = time.time() - self._origin_wall if self._origin_wall is not None else 0.0
            self._t_start = time.perf_counter() - behind
            self._log_eval({"started": True, "step": first, "wall": time.time()})    # the bench's cue: start-up is over
            step = first
            while step < self.cfg.steps:
                self._step, self._blocked, self._wait = step, 0.0, 0.0
                self._t0 = time.perf_counter()
                yield step
                if self.halted or self.steps_to_target is not None and self._common_step_evaluated():
                    self.stopped_at = step + 1     # target reached: every rank leaves after the same step
                    self._bar.update(1)
                    break
                nxt = max(step + 1, min(self._skip_to, self.cfg.steps))
                self._bar.update(nxt - step)
                step = nxt
            self.wall_s = self.training_s()
        finally:
            self._bar.close()

    def skip_to(self, step: int) -> None:
        """The job is further on than this rank's loop (a restarted torchft replica healed from a live one): its
        next step is `step`, as the loop `while manager.current_step() < N` of torchft's own examples would run."""
        self._skip_to = max(self._skip_to, step)

    def resume(self, origin_wall: float, eval_s: float = 0.0, evals: list[dict] = ()) -> None:
        """Before steps(): this run's clock runs from origin_wall (time.time() at the job's first start; now for a
        fresh one) less its evaluations, those of earlier incarnations (eval_s, evals) included — a job restarted from a
        checkpoint (worker/elastic.py) counts the time its failure cost."""
        self._origin_wall, self.eval_s, self.evals = origin_wall, eval_s, list(evals)

    def clock_state(self) -> dict:
        """What resume() takes, as of now (a checkpoint's copy)."""
        return {"origin_wall": self._origin_wall, "eval_s": self.eval_s, "evals": list(self.evals)}

    def _log_eval(self, row: dict) -> None:
        """One line of --eval-log (read back by deltaps/tools/bench_protocol.py read_eval_logs / started)."""
        if self.cfg.eval_log:
            with open(self.cfg.eval_log.replace("{rank}", str(self.rank)), "a") as f:
                f.write(json.dumps(row) + "\n")

    def stop_with(self, stop: dict) -> None:
        """Another rank stopped the job at its target (--sync quorum): take its figures and end after this step."""
        if self.steps_to_target is None:
            self.steps_to_target, self.time_to_target_s = stop["step"], stop["time_s"]
        self.halted = True

    def _common_step_evaluated(self) -> bool:
        """--common-step S: the evaluation due at S happened (0: no common step, nothing to wait for)."""
        common = self.cfg.common_step
        return not common or any(e["step"] >= common for e in self.evals)

    @property
    def step_start(self) -> float:
        """perf_counter() when the current step began."""
        return self._t0

    def straggle(self, factor: float) -> None:
        """--straggler: sleep (factor - 1) x this step's compute (its time so far less its blocked time), inside the
        step's time. A sleeping rank frees its CPU share, which a slow accelerator would not (docs/faults.md)."""
        compute = max(0.0, time.perf_counter() - self._t0 - self._blocked)
        pause = (factor - 1.0) * compute
        time.sleep(pause)
        self.straggler_s[0] += compute
        self.straggler_s[1] += pause

    def straggler_extras(self, factor: float) -> dict:
        compute, pause = self.straggler_s
        return {"straggler_factor": factor, "straggler_compute_s": compute, "straggler_sleep_s": pause,
                "straggler_achieved_factor": (compute + pause) / compute if compute else None} if factor != 1.0 else {}

    def comm(self, blocked_s: float, wait_s: float = 0.0) -> None:
        """This step was blocked on communication for blocked_s, wait_s of it waiting for peers / the server."""
        self._blocked += blocked_s
        self._wait += wait_s

    def comm_since(self, timing: dict, before: dict) -> None:
        """A DistributedOptimizer's `timing` went from `before` (a copy) to `timing` during this step."""
        self.comm(timing["blocked_s"] - before["blocked_s"], timing["wait_s"] - before["wait_s"])

    def record(self, loss: float | None = None, wire_bytes: int | None = None, end: float | None = None) -> float:
        """Close the current step (its time ends now, or at perf_counter value `end`); returns its seconds.
        loss: None where this rank does not know it; wire_bytes: bytes pushed this step, where counted per step."""
        step_s = (time.perf_counter() if end is None else end) - self._t0
        self.step_times.append(step_s)
        self.blocked_times.append(self._blocked)
        self.wait_times.append(self._wait)
        if wire_bytes is not None:
            self.wire_steps.append(wire_bytes)
        if loss is not None:
            self.losses.append(loss)
            if self._step % 10 == 0:
                self._bar.set_postfix(loss=f"{loss:.3f}")
            if self.cfg.log_every and self._step % self.cfg.log_every == 0:
                self.log.info("worker %d step %d loss %.4f", self.rank, self._step, loss)
        return step_s

    def training_s(self) -> float:
        """Seconds of the training loop so far, evaluations left out."""
        return time.perf_counter() - self._t_start - self.eval_s

    def evaluate(self, evaluation_fn, synced: bool = True, judges: bool = True) -> bool:
        """After `record()`: every cfg.eval_every steps run `evaluation_fn()` (-> the workload's evaluation
        dict, with the metric: test accuracy, test AUC, ...), timed apart from training. synced: every rank
        holds the same model now (DDP: always; local SGD / PS local updates: right after an average); a due
        evaluation waits for the next synced step. Returns True when this one reached the target (the workload's
        target field, judged by `reaches`): `steps()` then ends the loop.
        judges=False (--sync quorum, ranks > 0): the evaluation runs and its time is off the clock, as everywhere,
        but it is not recorded and stops nothing: rank 0 judges for the job (`stop_with`)."""
        every, done = self.cfg.eval_every, self._step + 1
        if not every:
            return False
        self._eval_due = self._eval_due or done % every == 0 or done == self.cfg.common_step
        if not (self._eval_due and synced):
            return False
        self._eval_due = False
        t0 = time.perf_counter()
        train_s = t0 - self._t_start - self.eval_s
        evaluation = evaluation_fn()
        self.eval_s += time.perf_counter() - t0
        if not judges:
            self.unjudged_evals += 1
            return False
        self.evals.append({"step": done, "time_s": train_s, **evaluation})
        reached = bool(self.target) and self.reaches(evaluation, self.target)
        self._log_eval({**self.evals[-1], "reached": reached})
        if self.cfg.log_every:
            self.log.info("worker %d step %d %s %.4f (%.2f s of training)", self.rank, done,
                          self.metric.replace("_", " "), evaluation[self.metric], train_s)
        if reached and self.steps_to_target is None:
            self.steps_to_target, self.time_to_target_s = done, train_s
            return True
        return False

    def eval_extras(self) -> dict:
        """The result keys of evaluation during training (RunResult.extras); {} when --eval-every is off."""
        if not self.cfg.eval_every:
            return {}
        return {"evals": list(self.evals), "eval_s": self.eval_s, "unjudged_evals": self.unjudged_evals,
                self.target_key: self.target or None,
                "time_to_target_s": self.time_to_target_s, "steps_to_target": self.steps_to_target}

    def result(self, *, final_test_accuracy: float, model_params: int, samples: float | None = None,
               **fields) -> RunResult:
        """The RunResult of this run; samples defaults to steps x cfg.batch_size (steps: cfg.steps, or the step
        an evaluation stopped the job at); fields: RunResult's byte / codec fields and `extras`."""
        cfg = self.cfg
        steps = self.stopped_at or cfg.steps
        if cfg.eval_every:
            fields["extras"] = {**fields.get("extras", {}), **self.eval_extras()}
        return RunResult(rank=self.rank, steps=steps, wall_s=self.wall_s,
                         samples=steps * cfg.batch_size if samples is None else samples,
                         final_test_accuracy=final_test_accuracy, model_params=model_params,
                         step_times=list(self.step_times), blocked_times=list(self.blocked_times),
                         wait_times=list(self.wait_times), losses=list(self.losses),
                         bytes_pushed_wire_steps=list(self.wire_steps), **fields)
