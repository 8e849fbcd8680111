"""The strategy seam: how a training mode moves gradients / parameters, and the registry `--mode` names.

Contract (one instance per worker run, driven by worker/trainers/loop.py):
* `validate(cfg, workload_cls)` (class method) — the mode's own config rules; `check_context(ctx)` — what it
  needs of the RunContext (shard addresses, a rendezvous);
* `setup()` — build `self.model` (from the workload) and the mode's machinery; a `collective` strategy runs
  inside the process group the loop started;
* `batches()` — this rank's batches (default: the workload's, for rank / world size);
* `begin(run)` — before the first step (a restarted job resumes its clock here); `end_step(run, step)` — after
  each step and its evaluation (checkpoints);
* `train_step(run, step, batch) -> StepOutcome` — one step: forward, backward, exchange; it reports its time
  blocked on communication to `run.comm`;
* `synced` — every rank holds the same model now (evaluations that may stop the job wait for it);
* `judges` — this rank's evaluations may stop the job (default: every rank's; under --sync quorum rank 0's alone,
  the others evaluate their own global model all the same, so every rank pauses for evaluations as a peer's do);
* `evaluate(step)` — the workload's evaluation of the global model after `step` (off the clock);
* `finish(run) -> dict` — after the last step: bring `self.model` to the job's final model and return the
  RunResult fields the mode reports (bytes, codec, extras, samples); `model_state()` — its state_dict;
* `report(result)` — end-of-job exchanges that need the result (server stats, barriers); `close()`.
Strategies register themselves (`@register`), as codecs do; the loop imports none of them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from deltaps.registry import Registry
from worker.trainers.context import RunContext
from worker.trainers.devices import resolve_device
from worker.workloads.base import Workload

# the built-in strategies register themselves on import (loaded on first lookup, as compression's codecs)
BUILTIN = ("worker.trainers.ps", "worker.trainers.allreduce", "worker.trainers.hybrid", "worker.trainers.pipeline",
           "worker.trainers.torchft_peer", "worker.trainers.torchrec_peer")
STRATEGIES = Registry("mode", BUILTIN)
register = STRATEGIES.register
available_strategies = STRATEGIES.names
strategy_class = STRATEGIES.get


class StepOutcome(NamedTuple):
    loss: float | None                # None where this rank does not know the step's loss
    wire_bytes: int | None = None     # bytes sent this step, where counted per step
    end: float | None = None          # perf_counter() at the step's end, when it is not now


class WorkerStopped(RuntimeError):
    """The worker got SIGTERM and left the job cleanly (channels closed, no result)."""


class Strategy:
    name = ""
    collective = False      # runs in a torch.distributed process group (the loop starts and ends it)
    needs_servers = False   # talks to the PS shards
    needs_lighthouse = False  # a torchft Lighthouse (the launcher starts one)
    # an evaluation is a function of the module's own state_dict, computed by this rank alone (no collective, no
    # state elsewhere), so ranks holding the same state may share it (--eval-cache: a rank waiting for another's
    # result must not be a party to its forward, and the digest must cover everything the result depends on)
    evaluates_alone = True

    def __init__(self, cfg, ctx: RunContext, workload: Workload):
        self.cfg, self.ctx, self.workload = cfg, ctx, workload
        self.rank = ctx.rank
        self.model: torch.nn.Module | None = None
        self.closables: list = []     # close() of what setup opened (clients, managers): called last-first

    # ---- rules ----
    takes_ddp_hook = False  # --ddp-hook: its DDP part runs torch's comm hooks
    local_updates = False   # --local-steps / --stream-fragments / --overlap-steps
    sparse_tables = False   # --sparse-embeddings
    dynamic_tables = False  # --embedding-dynamic
    needs_embeddings = False  # trains a model's embedding tables its own way (hybrid, torchrec): --workload ctr
    gpu = False             # --device cuda / auto puts its model on a GPU (else it trains on the CPU)

    @classmethod
    def validate(cls, cfg, workload_cls: type[Workload]) -> None:
        """The mode's config rules; subclasses add theirs and call this."""
        if (cfg.ddp_hook or "none") != "none" and not cls.takes_ddp_hook:
            raise ValueError(f"--ddp-hook {cfg.ddp_hook} applies to --mode allreduce / hybrid, not {cls.name}")
        if cfg.local_steps and not cls.local_updates:
            raise ValueError(f"--local-steps applies to --mode ps only, not {cls.name} (DDP's local SGD: "
                             f"--ddp-hook localsgd:period=H)")
        if cfg.device == "cuda" and not cls.gpu:
            raise ValueError(f"--device cuda applies to --mode ps / allreduce; --mode {cls.name} trains on the CPU")
        if cls.needs_embeddings and not workload_cls.has_embeddings:
            raise ValueError(f"--mode {cls.name} needs a model with embeddings: use --workload ctr, not "
                             f"{workload_cls.name}")
        if cfg.embedding_dynamic and not cls.dynamic_tables:
            raise ValueError(f"--embedding-dynamic: a table without a row count lives on the shards (--mode hybrid), "
                             f"not --mode {cls.name}")
        if cfg.sparse_embeddings and not cls.sparse_tables:
            raise ValueError(f"--sparse-embeddings (ddp:sparse) needs --mode allreduce --workload ctr (a model with an "
                             f"embedding table), not --mode {cls.name} --workload {workload_cls.name}")

    @classmethod
    def check_context(cls, ctx: RunContext) -> None:
        """What the run needs of its context: shard addresses (modes with shards), a rank and a world size."""
        missing = ["--servers (or $DELTAPS_SERVERS, --servers-pattern)"] if cls.needs_servers and not ctx.servers else []
        if ctx.rank is None:
            missing.append("--rank (or $RANK, $JOB_COMPLETION_INDEX)")
        if ctx.world_size is None:
            missing.append("--world-size (or $WORLD_SIZE)")
        if missing:
            raise ValueError(f"mode {cls.name} needs {', '.join(missing[:-1])}{' and ' if len(missing) > 1 else ''}"
                             f"{missing[-1]}")

    @classmethod
    def target_needs_bsp(cls, cfg, workload_cls: type[Workload]) -> None:
        """A race target stops every rank at the evaluation that reaches it: only under bsp do all ranks
        evaluate the same model at the same step (in a mode whose ranks train through the shards); under
        quorum rounds (local updates) rank 0 judges and stops the job on the shards (worker/trainers/ps.py)."""
        target = getattr(cfg, workload_cls.target_field)
        quorum = cfg.sync.startswith("quorum") and cls.local_updates and cfg.local_steps
        if target and cfg.sync != "bsp" and not quorum:
            flag = "--" + workload_cls.target_field.replace("_", "-")
            raise ValueError(f"{flag} needs --sync bsp in --mode {cls.name}: under {cfg.sync} every worker holds a "
                             f"different model, so the ranks could not agree on when to stop without talking; "
                             f"--eval-every alone still records each rank's evaluations")

    # ---- the run ----
    @functools.cached_property
    def device(self) -> torch.device:
        """Where this rank's model trains (worker/trainers/devices.py)."""
        return resolve_device(self.cfg.device, self.rank) if self.gpu else torch.device("cpu")

    def backend(self) -> str:
        """The process group's backend (collective strategies)."""
        return "gloo"

    @property
    def desc(self) -> str:
        return f"worker {self.rank} ({self.name}, {self.workload.name})"

    @property
    def first_step(self) -> int:
        return 0

    def setup(self) -> None:
        raise NotImplementedError

    def batches(self):
        return self.workload.batches(self.rank, self.ctx.world_size)

    def begin(self, run) -> None:
        pass

    def train_step(self, run, step: int, batch) -> StepOutcome:
        raise NotImplementedError

    def end_step(self, run, step: int) -> None:
        pass

    @property
    def synced(self) -> bool:
        return True

    @property
    def judges(self) -> bool:
        return True

    def evaluate(self, step: int) -> dict:
        return self.workload.evaluate(self.model)

    def finish(self, run) -> dict:
        return {}

    def model_state(self) -> dict:
        """The final model's state_dict as the workload's model names it (--save-model; called on every rank:
        a strategy whose model is sharded gathers it here)."""
        return self.model.state_dict()

    def report(self, result) -> None:
        pass

    def close(self) -> None:
        """Close what setup opened, whatever happened (also after a failed setup or a SIGTERM)."""
        while self.closables:
            self.closables.pop()()


def check_job(cfg, ctx: RunContext | None = None) -> None:
    """Every rule of a job: the config's own (cfg.validate), the workload's and the mode's."""
    from worker.workloads import workload_class
    cfg.validate()
    workload_cls = workload_class(cfg.workload)
    workload_cls.validate(cfg)
    strategy = strategy_class(cfg.mode)
    strategy.validate(cfg, workload_cls)
    if ctx is not None:
        strategy.check_context(ctx)


def load_job(path: str | None = None, overrides: dict | None = None):
    """deltaps.config.load_config + the workload's and the mode's rules (check_job)."""
    from deltaps.config import load_config
    cfg = load_config(path, overrides)
    check_job(cfg)
    return cfg
