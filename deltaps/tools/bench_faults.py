"""Faults and heterogeneity in `deltaps bench compare`, applied identically to every mode (docs/faults.md).

  --straggler RANK:FACTOR            that worker's compute takes FACTOR times as long (TrainConfig.straggler: it
                                     sleeps (FACTOR - 1) x its measured compute after every step, on the clock;
                                     with --cpus-per-worker X: its node is capped at X / FACTOR cores instead)
  --kill WORKER@WHEN[:restart=S]     (repeatable: a fault script) kill -9 that worker's process once rank 0 has
                                     trained WHEN: SECONDS of its training clock (evaluations excluded; read from
                                     its eval log, so within one --eval-every of the moment) or P% of the mode's
                                     healthy time to target in the same seed; with restart=S the same command starts
                                     it again S wall-clock seconds after the kill (its start-up counts), as a
                                     supervisor would (torchft: without --torchft-first-quorum, a job's first start's
                                     flag: it heals at the others' next sync)

A kill takes the worker's whole process tree (a pod's death): a `ddp-elastic` mode's workers run under torchrun's
elastic agent (`torchrun_command`), which restarts every rank of the job from the newest checkpoint when one dies;
its killed node's agent is restarted as any worker is.

With either, every mode runs twice per seed, healthy and then with the faults, in the same invocation: the
report's figures are the faulty runs', with `healthy_time_to_target_s` and `goodput` = healthy time to target /
faulty time to target (medians over seeds; per seed in `seeds`). A killed worker that is not restarted leaves
no result: the mode's figures come from the workers that finished.
"""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltaps.config import parse_straggler
from deltaps.tools.bench_protocol import read_eval_logs, started
from deltaps.tools.process_tree import kill_descendants

KILL = re.compile(r"(\d+)@(\d+(?:\.\d+)?)(%?)(?::restart=(\d+(?:\.\d+)?))?")


@dataclass(frozen=True)
class Kill:
    worker: int
    at_s: float                          # rank 0's training seconds (a share of the healthy time when percent)
    restart_s: float | None = None
    percent: bool = False                # at_s is P % of the mode's healthy time to target

    def __str__(self) -> str:
        when = f"{self.at_s:g}{'%' if self.percent else ''}"
        return f"{self.worker}@{when}" + (f":restart={self.restart_s:g}" if self.restart_s is not None else "")

    def resolved(self, healthy_s: float | None) -> "Kill":
        """This kill in rank 0's training seconds, given the mode's healthy time to target (same seed)."""
        if not self.percent:
            return self
        if healthy_s is None:
            raise ValueError(f"--kill {self}: the mode's healthy run did not reach the target, so "
                             f"{self.at_s:g}% of its time to target is undefined")
        return Kill(self.worker, healthy_s * self.at_s / 100.0, self.restart_s)


def parse_kill(text: str) -> Kill:
    m = KILL.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad --kill {text!r}: want WORKER@SECONDS[:restart=S] or WORKER@P%[:restart=S], "
                         f"e.g. 1@4.5:restart=2 or 1@33%:restart=2")
    return Kill(int(m[1]), float(m[2]), float(m[4]) if m[4] else None, m[3] == "%")


def add_arguments(p) -> None:
    p.add_argument("--straggler", default="", help="RANK:FACTOR: that worker's compute takes FACTOR times as long, "
                   "in every mode (it sleeps (FACTOR-1) x its measured compute each step); runs each mode healthy too")
    p.add_argument("--kill", action="append", default=[], type=parse_kill, metavar="WORKER@SECONDS|P%[:restart=S]",
                   help="kill -9 that worker once rank 0 trained SECONDS (or P%% of the mode's healthy time to target), "
                        "restarted S seconds later if given; repeatable; runs each mode healthy too")


def check(args) -> None:
    for k in args.kill:
        if not 0 < k.worker < args.workers:
            raise ValueError(f"--kill {k}: worker {k.worker} is not one of workers 1 .. {args.workers - 1} (rank 0 "
                             f"keeps the training clock the kills follow, and judges quorum targets)")
    if args.kill and not args.eval_every:
        raise ValueError("--kill needs --eval-every: the kills follow rank 0's training clock in its eval log")


def variants(args) -> list[tuple[str, dict, list[Kill]]]:
    """(name, TrainConfig overrides, kills) of each run of a mode per seed: one plain run without faults."""
    if not (args.straggler or args.kill):
        return [("", {}, [])]
    return [("healthy", {"straggler": ""}, []), ("faulty", {"straggler": args.straggler}, list(args.kill))]


def straggler_by_cap(faults: dict, caps, workers: int) -> tuple[dict, tuple[int, float] | None]:
    """With CPU caps (cpu_caps.py) a run's --straggler RANK:F is worker RANK's node capped at X / F cores once it trains
    (CapOnceTraining) instead of the worker's sleep, which a capped worker makes up for in its throttled time.
    -> (the run's TrainConfig overrides, (RANK, F) or None)."""
    if caps is None or not faults.get("straggler"):
        return faults, None
    return {**faults, "straggler": ""}, parse_straggler(faults["straggler"], workers)


class CapOnceTraining(threading.Thread):
    """A capped straggler's node drops to X / F cores once its rank has begun training (the first line of its eval
    log), so its start-up runs at the others' speed as a sleeping straggler's does: a synchronous peer's first round
    would otherwise wait out a start-up F times as slow, on the clock. stop() restores the cap."""

    POLL_S = 0.02

    def __init__(self, caps, node: int, factor: float, eval_log: str):
        super().__init__(daemon=True, name="bench-straggler-cap")
        self.caps, self.node, self.factor, self.eval_log = caps, node, factor, eval_log
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.POLL_S):
            if started(self.eval_log):
                self.caps.set_cores(self.node, self.caps.cores / self.factor)
                return

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)
        self.caps.set_cores(self.node, self.caps.cores)


def capped_straggler_figures(rank: int, factor: float, compute_per_step: list[float]) -> dict:
    """The report's `straggler` of a capped straggler: the factor asked for and the one measured, its compute seconds
    per step / the median of the other workers' (compute = step time less the time blocked on communication)."""
    median = statistics.median(c for r, c in enumerate(compute_per_step) if r != rank)
    return {"rank": rank, "factor": factor, "how": "cpu cap / factor",
            "achieved_factor": compute_per_step[rank] / median if median else None}


class _Down:
    """Stands in for a killed worker's process: still running (poll() None) until its restart replaces it; a
    worker killed for good counts as finished (0) so the others' results are still collected."""

    def __init__(self, restarting: bool):
        self.restarting = restarting

    def poll(self):
        return None if self.restarting else 0

    def kill(self) -> None:
        self.restarting = False

    def wait(self, timeout=None):
        return 0

    def send_signal(self, sig) -> None:
        self.restarting = False


class KillScript(threading.Thread):
    """Runs the kills of a fault script against `workers` (a list of Popen the bench waits on, edited in place):
    each once clock() (rank 0's training seconds so far, None before it started) reaches its time; relaunch(rank)
    starts a worker again. events: what happened, in rank 0's training seconds and wall seconds since start()."""

    POLL_S = 0.02

    def __init__(self, kills: list[Kill], workers: list, relaunch: Callable[[int], subprocess.Popen],
                 clock: Callable[[], float | None]):
        super().__init__(daemon=True, name="bench-kills")
        self.kills = sorted(kills, key=lambda k: k.at_s)
        self.workers, self.relaunch, self.clock = workers, relaunch, clock
        self.stopped = threading.Event()
        self.events: list[dict] = []
        self.t0 = time.monotonic()

    def _now(self) -> dict:
        return {"training_s": self.clock(), "wall_s": round(time.monotonic() - self.t0, 3)}

    def run(self) -> None:
        restarts = []      # (monotonic time, rank)
        for k in self.kills:
            while True:       # restarts due before this kill happen first
                if restarts and restarts[0][0] <= time.monotonic():
                    self._restart(restarts.pop(0)[1])
                trained = self.clock()
                if trained is not None and trained >= k.at_s:
                    break
                if self.stopped.wait(self.POLL_S):
                    return
            proc = self.workers[k.worker]
            if proc.poll() is not None:      # already finished (or still down): nothing to kill
                self.events.append({"worker": k.worker, "skipped": "not running", **self._now()})
                continue
            self.workers[k.worker] = _Down(k.restart_s is not None)   # before the kill: never seen as failed
            proc.kill()
            proc.wait()
            self.events.append({"worker": k.worker, "killed": True, **self._now()})
            if k.restart_s is not None:
                restarts = sorted(restarts + [(time.monotonic() + k.restart_s, k.worker)])
        for when, rank in restarts:
            if self.stopped.wait(max(0.0, when - time.monotonic())):
                return
            self._restart(rank)

    def _restart(self, rank: int) -> None:
        self.workers[rank] = self.relaunch(rank)
        self.events.append({"worker": rank, "restarted": True, **self._now()})

    def stop(self) -> None:
        self.stopped.set()


def training_clock(eval_log: str) -> Callable[[], float | None]:
    """Rank 0's training seconds so far, from its eval log (the latest evaluation's time_s; None before the first)."""
    def clock() -> float | None:
        rows = read_eval_logs([eval_log])[0]
        return rows[-1]["time_s"] if rows else None
    return clock


def goodput(healthy_s: float | None, faulty_s: float | None) -> float | None:
    """Healthy time to target / faulty time to target (1.0: the faults cost nothing); None if either missed."""
    return healthy_s / faulty_s if healthy_s is not None and faulty_s else None


def add_goodput(report: dict, healthy: dict[str, dict]) -> None:
    """Per mode of a faulty race: its healthy run's time to target and the goodput (medians over seeds)."""
    for spec, m in report["modes"].items():
        h = healthy.get(spec, {})
        m["healthy_time_to_target_s"] = h.get("time_to_target_s")
        m["goodput"] = goodput(m["healthy_time_to_target_s"], m.get("time_to_target_s"))
        for seed_figures, h_seed in zip(m.get("seeds", ()), h.get("seeds", ())):
            seed_figures["healthy_time_to_target_s"] = h_seed.get("time_to_target_s")
            seed_figures["goodput"] = goodput(h_seed.get("time_to_target_s"), seed_figures.get("time_to_target_s"))


# ---- a DDP job as torchrun's users run it on a failing cluster ----------------------------------------------------
TORCHRUN_MAX_RESTARTS = 8      # torchrun --max-restarts: more than a fault script's kills
TORCHRUN_MONITOR_S = 0.5       # how often an agent polls its worker (torchrun's default is 5 s)
# A dead node leaves the rendezvous after 2 missed keep-alives of 1 s (torchrun's default: 3 of 5 s): the same
# 2 s a deltaps shard gives a worker's heartbeats under quorum.
TORCHRUN_KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=2"
# torch 2.13's shared rendezvous TCP store is not rebuilt for a new round when the same node stays rank 0, so a
# restarted node waits forever for the round's MASTER_ADDR (found by trying: dynamic_rendezvous.next_rendezvous);
# torch's own opt-out makes every round publish it
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(nodes: int, rendezvous: str, local_addr: str, hosts_store: bool) -> list[str]:
    """The torchrun elastic-agent prefix of one node's worker command (then `deltaps worker ...`; its environment
    needs TORCHRUN_ENV): a c10d rendezvous of `nodes` nodes, one process each, at `rendezvous` (host:port; the agent
    with hosts_store runs the store there), this node advertised as local_addr (its namespace's address: every node
    has the same hostname)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous, "--rdzv-id", "deltaps-bench",
            "--rdzv-conf", f"is_host={str(hosts_store).lower()},{TORCHRUN_KEEP_ALIVE}", "--local-addr", local_addr,
            "--max-restarts", str(TORCHRUN_MAX_RESTARTS), "--monitor-interval", str(TORCHRUN_MONITOR_S), "-m"]


def start_torchrun_worker(net, node: int, nodes: int, rendezvous: str, hosts_store: bool, worker_args: list[str],
                          log: str, env: dict) -> "TreeProcess":
    """`deltaps worker <worker_args>` under torchrun's agent on node i of a bench_nodes.Nodes (rank and world from
    torchrun: ranks may move between nodes at a restart), output appended to log."""
    program = torchrun_command(nodes, rendezvous, net.addr(node), hosts_store) + ["deltaps", "worker", *worker_args]
    with open(log, "a") as out:
        return net.started(node, TreeProcess(net.prefix(node) + program, stdout=out, stderr=subprocess.STDOUT,
                                             env={**env, **TORCHRUN_ENV}))


class TreeProcess(subprocess.Popen):
    """A worker's process whose kill() is the death of its whole tree (SIGKILL to every descendant, then itself):
    torchrun's agent runs its worker in a session of its own, which a kill of the agent alone would leave running."""

    def kill(self) -> None:
        kill_descendants(self.pid)
        super().kill()
