"""`--mode torchft`: the peer a DDP user picks for slow links — torchft's own DiLoCo / Streaming DiLoCo (or its
LocalSGD), run from the torchft package (optional extra `peers`), never re-implemented here.

Every worker is one torchft replica group of one process: a TCPStore of its own, a `Manager` (synchronous
quorum, all --world-size replicas required, the Lighthouse at --lighthouse / $TORCHFT_LIGHTHOUSE, this worker's
own address advertised) over torchft's reconfigurable `ProcessGroupGloo`. The model is cut into
--stream-fragments contiguous fragments of its top-level modules (the root's own parameters first, as a module of
their own, so every parameter syncs); `DiLoCo(manager, fragments, inner, outer,
sync_every=--local-steps, fragment_sync_delay=--overlap-steps)` with the inner optimizer --optimizer/--lr and
the outer one the deltaps modes use (--outer-optimizer/--outer-lr/--outer-momentum: nesterov = SGD(nesterov=True),
sgd = heavy ball, avg = SGD(lr=1), i.e. the mean of the local models); `--torchft-algorithm localsgd` runs
torchft's LocalSGD (model average every --local-steps). --torchft-alpha is DiLoCo's fragment_update_alpha.
Pseudo-gradients travel as fp32 (torchft's `should_quantize` needs CUDA and Triton), or as --torchft-wire
fp16 / bf16: torchft 0.2 has no option for that, so each fragment's class is swapped for `WireCastFragment`, a
subclass that keeps the pseudo-gradients it allreduces in that dtype and hands them back to the outer optimizer
in the parameters' dtype (the sum over the ring is then done in that dtype too).

Timing: a step's blocked time is what torchft's sync hook took after the inner optimizer step (quorum,
allreduce, outer step); with --torchft-first-quorum the replicas meet at a quorum before the clock starts (the
Lighthouse's quorum and the gloo group's set-up then off it, as DDP's constructor's broadcast is). Bytes: the
ring figure 2(W-1)/W of what a sync allreduces (the fragment's fp32 pseudo-gradient; LocalSGD: the parameters).
Evaluation: the global model (each fragment's parameters as of its last sync, the same on every replica), at the
first step after a sync.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
from torch import nn

from deltaps.strategies import WIRE_DTYPES
from worker.trainers.base import local_optimizer
from worker.trainers.collective import ring_bytes
from worker.trainers.strategy import StepOutcome, Strategy, register

log = logging.getLogger("deltaps.torchft")

ALGORITHMS = ("diloco", "localsgd")
WIRE_TORCH_DTYPES = dict(zip(WIRE_DTYPES, (torch.float32, torch.float16, torch.bfloat16)))   # --torchft-wire
TIMING_METHOD = "torchft: blocked = torchft's sync hook after the inner optimizer step (quorum, allreduce, outer step)"


class OwnParameters(nn.Module):
    """The root module's own parameters (the same Parameter objects, e.g. the lm's `position`), as a module: torchft's
    fragments are modules, and a parameter no fragment holds would never be synced (each replica keeping its own)."""

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        for name, p in params.items():
            self.register_parameter(name, p)


def fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """The model's top-level modules with parameters (its own parameters first, as model.parameters() orders them),
    cut into `count` contiguous groups of about equal size: every parameter in exactly one group."""
    blocks = [m for m in model.children() if any(True for _ in m.parameters())]
    own = dict(model.named_parameters(recurse=False))
    if own:
        blocks.insert(0, OwnParameters(own))
    if count > len(blocks):
        raise ValueError(f"--stream-fragments {count}: the model has only {len(blocks)} top-level parts with parameters")
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total, out, group, filled = sum(sizes), [], [], 0
    for i, (block, size) in enumerate(zip(blocks, sizes)):
        group.append(block)
        filled += size
        left_blocks, left_groups = len(blocks) - i - 1, count - len(out) - 1
        if left_groups and (filled >= total * (len(out) + 1) / count or left_blocks == left_groups):
            out.append(nn.ModuleList(group))
            group = []
    out.append(nn.ModuleList(group))
    return out


def outer_optimizer(cfg, params) -> torch.optim.Optimizer:
    """The deltaps modes' outer optimizer, as torch optimizers (what torchft's DiLoCo takes)."""
    if cfg.outer_optimizer == "avg":
        return torch.optim.SGD(params, lr=1.0)
    return torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                           nesterov=cfg.outer_optimizer == "nesterov")


def wire_cast_fragments(synchronizer, dtype: torch.dtype) -> None:
    """Make every fragment of a torchft DiLoCo allreduce its pseudo-gradients in `dtype` (see the module docstring)."""
    from torchft.local_sgd import _StreamingDiLoCoFragment

    class WireCastFragment(_StreamingDiLoCoFragment):
        def _save_grads(self) -> None:
            super()._save_grads()
            self._grads = {name: g.to(dtype) for name, g in self._grads.items()}

        def _set_grads(self) -> None:
            params = dict(self._model_fragment.named_parameters())
            self._grads = {name: g.to(params[name].dtype) for name, g in self._grads.items()}
            super()._set_grads()
    for fragment in synchronizer._fragments:
        fragment.__class__ = WireCastFragment


def own_address(lighthouse: str) -> str:
    """The local address this host reaches the Lighthouse from (a namespace's own veth address); no packet sent."""
    host = urlparse(lighthouse).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


@register("torchft")
class TorchFT(Strategy):
    local_updates = True        # --local-steps = sync_every, --stream-fragments, --overlap-steps = the delay
    needs_lighthouse = True

    @classmethod
    def validate(cls, cfg, workload_cls) -> None:
        super().validate(cfg, workload_cls)
        if cfg.torchft_algorithm not in ALGORITHMS:
            raise ValueError(f"unknown --torchft-algorithm {cfg.torchft_algorithm!r}; use diloco or localsgd")
        if cfg.local_steps < 1:
            raise ValueError("--mode torchft needs --local-steps H (a sync every H inner steps)")
        if cfg.local_steps % cfg.stream_fragments:
            raise ValueError(f"--mode torchft: --stream-fragments {cfg.stream_fragments} must divide --local-steps "
                             f"{cfg.local_steps} (torchft's rule)")
        if cfg.torchft_algorithm == "localsgd" and (cfg.stream_fragments > 1 or cfg.overlap_steps > 0):
            raise ValueError("--torchft-algorithm localsgd averages the whole model at once: no --stream-fragments "
                             "or --overlap-steps")
        if cfg.sync != "bsp":
            raise ValueError(f"--mode torchft runs synchronous quorums: --sync bsp, not {cfg.sync}")
        if not 0 <= cfg.torchft_min_replicas <= cfg.workers or cfg.torchft_timeout_s < 0:
            raise ValueError(f"--torchft-min-replicas must be in [0, --workers {cfg.workers}] and --torchft-timeout-s "
                             f">= 0, got {cfg.torchft_min_replicas} and {cfg.torchft_timeout_s}")
        if cfg.torchft_wire not in WIRE_TORCH_DTYPES or not 0.0 <= cfg.torchft_alpha <= 1.0:
            raise ValueError(f"--torchft-wire must be fp32, fp16 or bf16 and --torchft-alpha in [0, 1], got "
                             f"{cfg.torchft_wire!r} and {cfg.torchft_alpha}")
        if cfg.torchft_algorithm == "localsgd" and (cfg.torchft_wire != "fp32" or cfg.torchft_alpha):
            raise ValueError("--torchft-algorithm localsgd averages the parameters: no --torchft-wire or --torchft-alpha")

    @classmethod
    def check_context(cls, ctx) -> None:
        super().check_context(ctx)
        if not (ctx.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
            raise ValueError("mode torchft needs --lighthouse (or $TORCHFT_LIGHTHOUSE): the torchft Lighthouse's URL")

    @property
    def desc(self) -> str:
        return f"worker {self.rank} (torchft {self.cfg.torchft_algorithm}, {self.workload.name})"

    def setup(self) -> None:
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo, LocalSGD
        cfg, ctx = self.cfg, self.ctx
        lighthouse = ctx.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"]
        host = own_address(lighthouse)
        self.model = model = self.workload.build_model()
        self.inner = inner = local_optimizer(cfg, model.parameters())
        self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=cfg.torchft_timeout_s or cfg.timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=cfg.torchft_min_replicas or self.ctx.world_size,
            use_async_quorum=False,
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
            state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
            replica_id=f"deltaps_{self.rank}", rank=0, world_size=1, store_addr=host, store_port=self.store.port,
            # the quorum outwaits a collective: a replica restarting while the others time out of a round with the
            # dead one (gloo, `timeout`) still finds its quorum (torchft's defaults tie both at 60 s)
            lighthouse_addr=lighthouse, hostname=host, timeout=timeout, quorum_timeout=2 * timeout,
            init_sync=False)    # every replica builds the same seeded model: torchft's advice is no step-0 sync
        self.closables.append(lambda: self.manager.shutdown(wait=False))
        # our hook first: it marks the end of the inner step, so what torchft's hook takes after it is the sync
        self._hook = inner.register_step_post_hook(self._inner_step_done)
        if cfg.torchft_algorithm == "localsgd":
            self.synchronizer = LocalSGD(self.manager, model, inner, sync_every=cfg.local_steps)
            self.parts = [model]
        else:
            self.parts = fragments(model, cfg.stream_fragments)
            self.synchronizer = DiLoCo(self.manager, self.parts, inner,
                                       [outer_optimizer(cfg, f.parameters()) for f in self.parts],
                                       sync_every=cfg.local_steps, fragment_sync_delay=max(0, cfg.overlap_steps),
                                       fragment_update_alpha=cfg.torchft_alpha)
            if cfg.torchft_wire != "fp32":
                wire_cast_fragments(self.synchronizer, WIRE_TORCH_DTYPES[cfg.torchft_wire])
        self.synchronizer.__enter__()
        self.sent, self._synced, self._t_inner, self._first = 0, False, 0.0, 0
        self.sync_blocked_s: list[float] = []     # each sync's time on the clock (the first: set-up, unless begin's)

    def begin(self, run) -> None:
        # --torchft-first-quorum: torchft's first quorum (the Lighthouse's, then the gloo group's rendezvous of every
        # replica) before the clock starts, as DDP's ranks meet at its constructor's broadcast: a sync's time on the
        # clock is then the round's, not the job's start-up (the bench sets it on a job's first start only)
        if not self.cfg.torchft_first_quorum:
            return        # the first sync's quorum sets torchft up, on the clock (a restarted replica heals there)
        # with --torchft-min-replicas below the workers a quorum may form without a replica still starting, whose own
        # first quorum would then meet the others' first sync: again until every replica is in (or --timeout)
        deadline = time.monotonic() + self.cfg.timeout_s
        self.manager.start_quorum()
        while self.manager.num_participants() < self.ctx.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            self.manager.start_quorum()
        self._first = self._job_step()
        if self._first:
            log.warning("rank %d healed before its first step: the job is at step %d", self.ctx.rank, self._first)

    @property
    def first_step(self) -> int:
        return self._first

    @property
    def _steps_per_sync(self) -> int:
        """Inner steps between two syncs: H / F (each sync is one fragment's)."""
        return max(1, self.cfg.local_steps // len(self.parts))

    def _job_step(self) -> int:
        """The job's inner step as torchft's step (syncs so far) says."""
        return self.manager.current_step() * self._steps_per_sync

    def _inner_step_done(self, *_) -> None:
        self._t_inner = time.perf_counter()

    def train_step(self, run, step: int, batch) -> StepOutcome:
        loss = self.workload.loss(self.model, batch)
        self.inner.zero_grad()
        loss.backward()
        syncs = self.manager.current_step()
        self.inner.step()                        # torchft's hook syncs in here every --local-steps / F steps
        blocked = time.perf_counter() - self._t_inner
        run.comm(blocked)
        self._synced = self.manager.current_step() != syncs
        wire = 0
        if self._synced:
            self.sync_blocked_s.append(round(blocked, 6))
            self._catch_up(run, step)
            part = self.parts[(syncs % len(self.parts))] if len(self.parts) > 1 else self.parts[0]
            width = WIRE_TORCH_DTYPES[self.cfg.torchft_wire].itemsize     # fp32 for localsgd (validated)
            wire = ring_bytes(sum(p.numel() * width for p in part.parameters()), self.ctx.world_size)
        self.sent += wire
        return StepOutcome(loss.item(), wire)

    def _catch_up(self, run, step: int) -> None:
        """A replica restarted mid-job heals from a live one at its first sync: torchft's step (syncs so far) then
        says where the job is, H / F inner steps per sync; this rank's loop goes on from there, not from its own
        count (a round or more behind), so it ends with the others instead of waiting alone for a quorum."""
        job_step = self._job_step()
        if job_step - (step + 1) >= self._steps_per_sync:
            log.warning("rank %d healed at its step %d: the job is at step %d", self.ctx.rank, step, job_step)
            run.skip_to(job_step)

    @property
    def synced(self) -> bool:
        return self._synced

    def evaluate(self, step: int) -> dict:
        if self.cfg.torchft_algorithm == "localsgd":
            return self.workload.evaluate(self.model)     # right after the average every replica holds it
        local = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self._adopt_global_model()
        evaluation = self.workload.evaluate(self.model)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(local[n])
        return evaluation

    @torch.no_grad()
    def _adopt_global_model(self) -> None:
        """DiLoCo's global model into self.model: every fragment as of its last sync (torchft 0.2's fragments keep
        it in `original_parameters`), the same on every replica."""
        for frag in self.synchronizer._fragments:
            for name, p in frag._model_fragment.named_parameters():
                p.copy_(frag.original_parameters[name])

    def finish(self, run) -> dict:
        if self.cfg.torchft_algorithm == "diloco":
            self._adopt_global_model()       # the job's model is the global one, not a replica's inner steps since
        self.synchronizer.__exit__(None, None, None)
        self._hook.remove()
        sent = self.sent
        # a ring allreduce receives what it sends; every sync is a round's (no initial or final full transfer)
        steady = {"steady_bytes_moved": 2 * int(sent), "steady_rounds": self.manager.current_step() / len(self.parts)}
        return dict(bytes_pushed_wire=int(sent), bytes_pushed_raw=int(sent), bytes_pulled_wire=int(sent),
                    extras={"torchft_algorithm": self.cfg.torchft_algorithm, "sync_every": self.cfg.local_steps,
                            "fragments": len(self.parts), "fragment_sync_delay": max(0, self.cfg.overlap_steps),
                            "fragment_update_alpha": self.cfg.torchft_alpha, "wire_dtype": self.cfg.torchft_wire,
                            "syncs": self.manager.current_step(), "sync_blocked_s": self.sync_blocked_s,
                            "first_quorum": self.cfg.torchft_first_quorum, "timing_method": TIMING_METHOD, **steady})
