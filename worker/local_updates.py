"""Local-update training (DiLoCo, Streaming DiLoCo) on the parameter servers.

Each worker steps its own inner optimizer for H steps, then pushes its parameter *delta* for a round:
delta = anchor - local model, where the anchor is the global model the worker last pulled (the client's
pull staging, which is also the shared view delta pulls are applied to). The push goes through the codec
with its error feedback like a gradient, the shards average the deltas (bsp) and apply the outer
optimizer to the mean (`outer_optimizer_config`: avg = SGD lr 1 = the mean of the local models), and the
worker adopts the new global model. Server steps count rounds, not inner steps.

Streaming (fragments F > 1): the parameters are split into F contiguous groups of about equal size;
fragment f syncs every H inner steps at offset (f+1)H/F, so one fragment is on the wire at a time.

Overlap (`overlap_steps` tau < H/F, Streaming DiLoCo's tau; default 1 with fragments, else 0): an exchange
runs in the background for the next tau inner steps; then the worker takes the new global values and keeps
the progress made meanwhile (p = global + (p_now - p_at_send)). tau = 0 waits for the exchange at once.
A round's delta is then tau steps older than the model it lands on, the price of hiding the transfer.

Quorum rounds (--sync quorum:Q): a round may close without this worker; its late delta folds into the open
round on the shards, and its next push is for the round it pulled (the rounds it missed are skipped). With
inner=adaptive a worker slower than the quorum takes fewer inner steps per round instead (RoundPace), so that its
delta lands in the round it pulled; the shards weigh it by the steps it covers (PushRequest.inner_steps).
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from compression.policy import energy_share
from deltaps.optimizer_config import overlap_steps as check_overlap_steps


def split_fragments(named: list[tuple[str, torch.Tensor]], fragments: int) -> list[list[str]]:
    """F contiguous groups of parameter names (model order), cut where the running element count crosses
    k/F of the total (a parameter is never split); an even split by count if that leaves a group empty."""
    if not 1 <= fragments <= len(named):
        raise ValueError(f"--stream-fragments must be between 1 and the {len(named)} parameters, got {fragments}")
    total = max(1, sum(p.numel() for _, p in named))
    groups: list[list[str]] = [[] for _ in range(fragments)]
    seen = 0
    for n, p in named:
        groups[min(fragments - 1, seen * fragments // total)].append(n)
        seen += p.numel()
    if all(groups):
        return groups
    k, r = divmod(len(named), fragments)
    bounds = [f * k + min(f, r) for f in range(fragments + 1)]
    return [[n for n, _ in named[bounds[f]:bounds[f + 1]]] for f in range(fragments)]


ADAPT_BELOW = 0.8    # inner=adaptive: a worker shortens its rounds only when the quorum's round fits < this x H of its steps
PACE_EMA = 0.5       # weight of the newest observation in RoundPace's estimates


class RoundPace:
    """inner=adaptive (quorum rounds, one fragment): how many inner steps this worker's next round takes.

    The quorum's round period: the shards' recent open-to-quorum span (before the first quorum, the seconds per
    version this worker sees advance between its exchanges); its own pace: seconds per inner step of its last round
    (its compute, a straggler's slowness included; the exchanges not), and the seconds its exchange takes (encoding its
    delta and moving bytes, less waiting for the round to close), which a round must leave room for. A worker whose
    H steps fit in the period (within ADAPT_BELOW) keeps H — the period is set by those workers, so they never
    shorten rounds in turn; a slower one takes the steps that fit, at least 1."""

    def __init__(self, local_steps: int):
        self.H = local_steps
        self.period_s: float | None = None     # seconds per round: the quorum's pace
        self.step_s: float | None = None       # this worker's seconds per inner step
        self.comm_s: float | None = None       # seconds its exchange takes (not waiting for the round)
        self._seen: tuple[float, int] | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else PACE_EMA * new + (1 - PACE_EMA) * old

    def stepped(self, seconds: float, steps: int) -> None:
        if steps > 0:
            self.step_s = self._ema(self.step_s, seconds / steps)

    def observed(self, now: float, version: int, comm_s: float = 0.0, quorum_s: float = 0.0) -> None:
        """After an exchange: the shards' version (rounds applied) at perf_counter() `now`; comm_s: the seconds
        the exchange took; quorum_s: the shards' recent open-to-quorum span (0: not known yet). The period is that
        span once known, not the versions' pace: a round waits out its grace window for a straggler arriving late
        in it, so a straggler fitting its steps to the pace it sees would stretch every round to the window's end."""
        self.comm_s = self._ema(self.comm_s, comm_s)
        if quorum_s > 0:
            self.period_s = self._ema(self.period_s, quorum_s)
        elif self._seen is not None and version > self._seen[1]:
            self.period_s = self._ema(self.period_s, (now - self._seen[0]) / (version - self._seen[1]))
        self._seen = (now, version)

    def next_round(self) -> int:
        if self.period_s is None or not self.step_s:     # comm_s is known once period_s is
            return self.H
        fits = max(0.0, self.period_s - self.comm_s) / self.step_s
        return self.H if fits >= ADAPT_BELOW * self.H else max(1, min(self.H, int(fits + 1e-9)))


def check_pace(inner: str, fragments: int, tau: int) -> None:
    """inner=adaptive rounds are whole-model rounds waited for at once (their length is measured per round)."""
    if inner == "adaptive" and (fragments > 1 or tau):
        raise ValueError(f"quorum rounds with inner=adaptive take one fragment and no overlap (--stream-fragments 1, "
                         f"--overlap-steps 0), not {fragments} fragments and overlap {tau}")


class LocalUpdates:
    """The outer loop of a local-update job, driven by DistributedOptimizer.step() after each inner step."""

    def __init__(self, dopt, local_steps: int, fragments: int = 1, overlap_steps: int | None = None):
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        self.dopt, self.H = dopt, local_steps
        self.fragments = split_fragments(dopt.named, fragments) if fragments > 1 else [[n for n, _ in dopt.named]]
        F = len(self.fragments)
        self.offsets = [((f + 1) * local_steps // F) % local_steps for f in range(F)]
        self.tau = check_overlap_steps(local_steps, F, overlap_steps)
        self.params = dict(dopt.named)
        # a worker (re)joining a running job at round r is at inner step r x H: its schedule is everyone's
        # (streaming: every fragment restarts at the slowest one's round; the shards ignore pushes they have)
        self.inner = dopt.round * local_steps   # inner steps of the job so far (this worker's clock)
        self.rounds = [dopt.round] * F          # server step of each fragment's next round
        self.synced_at = [self.inner] * F       # inner step count at each fragment's last send
        self.inflight: dict[int, tuple[list[Future], dict[str, torch.Tensor]]] = {}   # fragment -> (futures, p at send)
        self.outer_rounds = 0                   # fragment rounds completed (metrics)
        self.last_delta_norm = 0.0              # L2 norm of the last pushed delta (metrics)
        # share of the last rounds' delta + residual (squared L2) their payloads carried (metrics), from the
        # compressor's running sums at the previous finish
        self.last_payload_share: float | None = None
        self._energy_seen = (0.0, 0.0)
        # quorum inner=adaptive: this round's inner steps (RoundPace), the compute seconds spent on them so far
        check_pace(dopt.client.sync.inner, F, self.tau)
        self.pace = RoundPace(local_steps) if dopt.client.sync.inner == "adaptive" else None
        self.round_steps, self.round_compute_s, self._stepped_at, self._sent_at = local_steps, 0.0, None, 0.0
        self.round_sizes: list[int] = []        # inner steps of every round pushed (inner=adaptive: per round)

    def off_clock(self, seconds: float) -> None:
        """Time spent between inner steps that is not training (an evaluation): left out of this worker's pace."""
        self.round_compute_s -= seconds

    # ---- schedule ------------------------------------------------------------------------------
    def due(self, f: int) -> bool:
        if self.pace is not None:
            return self.inner - self.synced_at[f] >= self.round_steps
        return self.inner % self.H == self.offsets[f] and self.inner >= (self.offsets[f] or self.H)

    # ---- rounds --------------------------------------------------------------------------------
    def after_inner_step(self) -> None:
        """Called after each inner step: finish the exchanges that have overlapped tau steps, start the ones
        due (tau = 0: finish them too). Blocked time goes to the optimizer's timing (note_blocked)."""
        self.inner += 1
        if self._stepped_at is not None:      # this inner step's time since the last one ended (exchanges excluded)
            self.round_compute_s += time.perf_counter() - self._stepped_at
        self.finish_inflight([f for f in self.inflight if self.inner - self.synced_at[f] >= self.tau])
        for f in range(len(self.fragments)):
            if self.due(f):
                self.send(f)
        if not self.tau:
            self.finish_inflight()
        self._stepped_at = time.perf_counter()

    def send(self, f: int) -> None:
        """Push fragment f's delta (anchor - local) for its next round and pull the new global values."""
        d = self.dopt
        self._sent_at = time.perf_counter()     # the pace's exchange time starts here: encoding the delta is in it
        staging = d.staging
        deltas, sent, sq = {}, {}, 0.0
        for n in self.fragments[f]:
            p = self.params[n].detach().reshape(-1).to(torch.float32)
            deltas[n] = staging[n].to(p.device) - p      # on the model's device: a GPU worker compresses there
            sq += float(deltas[n].square().sum())
            if self.tau:
                sent[n] = p.clone()
        self.last_delta_norm = sq ** 0.5
        step = self.rounds[f]
        steps = self.inner - self.synced_at[f]
        self.round_sizes.append(steps)
        if self.pace is not None:
            self.pace.stepped(self.round_compute_s, steps)
            self.round_compute_s = 0.0
        futures = d.push_pull(deltas, self.fragments[f], step, steps if self.pace is not None else 0)
        if f == len(self.fragments) - 1:    # buffers ride with the last fragment: one round per H steps
            futures += d.sync_buffers(step)
        self.rounds[f] += 1
        d.round = min(self.rounds)            # rounds every fragment has pushed
        self.synced_at[f] = self.inner
        self.inflight[f] = (futures, sent)

    def finish_inflight(self, fragments: list[int] | None = None) -> None:
        """Wait for the exchanges in flight (all, or those of `fragments`) and adopt the new global values
        (keeping progress made since the send where the exchange overlapped inner steps)."""
        done = {f: self.inflight.pop(f) for f in (list(self.inflight) if fragments is None else fragments)}
        if not done:
            return
        d = self.dopt
        t0 = time.perf_counter()
        waited = max((fut.result() for fs, _ in done.values() for fut in fs), default=0.0)
        blocked = time.perf_counter() - t0
        if d.client.sync.kind == "quorum":    # skip the rounds that closed without us (ps/rounds.py)
            for f in done:
                pulled = min(d.client.versions.get(k.key, 0) for ks in d.client.keys_by_shard(self.fragments[f]).values()
                             for k in ks)
                self.rounds[f] = max(self.rounds[f], pulled)
                self._follow_the_job()
                if self.pace is not None:
                    now = time.perf_counter()       # one fragment, no overlap (check_pace): the exchange is now - sent
                    self.pace.observed(now, pulled, max(0.0, now - self._sent_at - waited),
                                       max(d.client.quorum_paces.values(), default=0.0))
                    self.round_steps = self.pace.next_round()
            d.round = min(self.rounds)
        with torch.no_grad():
            for f, (_, sent) in done.items():
                for n in self.fragments[f]:
                    p = self.params[n]
                    g = d.staging[n].to(p.device).view_as(p)
                    if sent:
                        p.add_(g - sent[n].view_as(p))   # p_now + (global - p_at_send)
                    else:
                        p.copy_(g)
                self.outer_rounds += 1
            if len(self.fragments) - 1 in done:     # the round that carried the buffers
                d.load_buffers(d.staging)
        self._note_payload_share()
        d.note_blocked(blocked, waited)

    def _note_payload_share(self) -> None:
        stats = self.dopt.client.compressor.stats()
        due, left = stats["energy_due"], stats["energy_left"]
        share = energy_share(due - self._energy_seen[0], left - self._energy_seen[1])
        if share is not None:
            self.last_payload_share, self._energy_seen = share, (due, left)

    def _follow_the_job(self) -> None:
        """Quorum, whole-model rounds: the job is at round r, i.e. inner step r x H (where a joiner starts). A worker
        whose rounds covered fewer inner steps (inner=adaptive) or that skipped rounds closed without it is behind
        that: its clock jumps to the job's, so it ends with the others at --steps instead of training on alone
        while they wait for it at the end-of-job barrier. The steps it did train are counted apart (trained)."""
        if len(self.fragments) > 1 or self.tau:
            return
        behind = self.rounds[0] * self.H - self.inner
        if behind > 0:
            self.inner += behind
            self.synced_at[0] += behind
            self.dopt.clock += behind        # the loop follows it (PS strategy end_step: run.skip_to)

    def flush(self) -> None:
        """End of training: every fragment with local progress takes a last round (every worker calls
        this after the same number of inner steps, so the rounds match), and the exchanges complete."""
        self.finish_inflight()
        tau, self.tau = self.tau, 0
        try:
            for f in range(len(self.fragments)):
                if self.synced_at[f] != self.inner:
                    self.send(f)
            self.finish_inflight()
        finally:
            self.tau = tau
