"""Faults and heterogeneity in `deltaps bench compare`, applied identically to every mode (docs/faults.md).

  --straggler RANK:FACTOR            that worker's compute takes FACTOR times as long (TrainConfig.straggler: it
                                     sleeps (FACTOR - 1) x its measured compute after every step, on the clock)
  --kill WORKER@SECONDS[:restart=S]  (repeatable: a fault script) kill -9 that worker's process SECONDS after the
                                     mode's workers were started; with restart=S the same command starts it again
                                     S seconds later (its start-up time counts), as a supervisor would

With either, every mode runs twice per seed, healthy and then with the faults, in the same invocation: the
report's figures are the faulty runs', with `healthy_time_to_target_s` and `goodput` = healthy time to target /
faulty time to target (medians over seeds; per seed in `seeds`). A killed worker that is not restarted leaves
no result: the mode's figures come from the workers that finished.
"""
from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

KILL = re.compile(r"(\d+)@(\d+(?:\.\d+)?)(?::restart=(\d+(?:\.\d+)?))?")


@dataclass(frozen=True)
class Kill:
    worker: int
    at_s: float
    restart_s: float | None = None

    def __str__(self) -> str:
        return f"{self.worker}@{self.at_s:g}" + (f":restart={self.restart_s:g}" if self.restart_s is not None else "")


def parse_kill(text: str) -> Kill:
    m = KILL.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad --kill {text!r}: want WORKER@SECONDS[:restart=S], e.g. 1@4.5:restart=2")
    return Kill(int(m[1]), float(m[2]), float(m[3]) if m[3] else None)


def add_arguments(p) -> None:
    p.add_argument("--straggler", default="", help="RANK:FACTOR: that worker's compute takes FACTOR times as long, "
                   "in every mode (it sleeps (FACTOR-1) x its measured compute each step); runs each mode healthy too")
    p.add_argument("--kill", action="append", default=[], type=parse_kill, metavar="WORKER@SECONDS[:restart=S]",
                   help="kill -9 that worker SECONDS after start, restarted S seconds later if given; repeatable; "
                        "runs each mode healthy too")


def check(args) -> None:
    for k in args.kill:
        if not 0 <= k.worker < args.workers:
            raise ValueError(f"--kill {k}: worker {k.worker} is not one of the {args.workers} workers")


def variants(args) -> list[tuple[str, dict, list[Kill]]]:
    """(name, TrainConfig overrides, kills) of each run of a mode per seed: one plain run without faults."""
    if not (args.straggler or args.kill):
        return [("", {}, [])]
    return [("healthy", {"straggler": ""}, []), ("faulty", {"straggler": args.straggler}, list(args.kill))]


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
    """Runs the kills of a fault script against `workers` (a list of Popen the bench waits on, edited in place);
    relaunch(rank) starts a worker again. events: what happened, seconds after start()."""

    def __init__(self, kills: list[Kill], workers: list, relaunch: Callable[[int], subprocess.Popen]):
        super().__init__(daemon=True, name="bench-kills")
        self.kills = sorted(kills, key=lambda k: k.at_s)
        self.workers, self.relaunch = workers, relaunch
        self.stopped = threading.Event()
        self.events: list[dict] = []
        self.t0 = time.monotonic()

    def _sleep_until(self, t: float) -> bool:
        return not self.stopped.wait(max(0.0, self.t0 + t - time.monotonic()))

    def run(self) -> None:
        pending = []      # (restart time, rank)
        for k in self.kills:
            while pending and pending[0][0] <= k.at_s:
                self._restart(*pending.pop(0))
            if not self._sleep_until(k.at_s):
                return
            proc = self.workers[k.worker]
            if proc.poll() is not None:      # already finished (or still down): nothing to kill
                self.events.append({"worker": k.worker, "at_s": k.at_s, "skipped": "not running"})
                continue
            self.workers[k.worker] = _Down(k.restart_s is not None)   # before the kill: never seen as failed
            proc.kill()
            proc.wait()
            self.events.append({"worker": k.worker, "killed_at_s": round(time.monotonic() - self.t0, 3)})
            if k.restart_s is not None:
                pending.append((k.at_s + k.restart_s, k.worker))
                pending.sort()
        for item in pending:
            self._restart(*item)

    def _restart(self, at_s: float, rank: int) -> None:
        if not self._sleep_until(at_s):
            return
        self.workers[rank] = self.relaunch(rank)
        self.events.append({"worker": rank, "restarted_at_s": round(time.monotonic() - self.t0, 3)})

    def stop(self) -> None:
        self.stopped.set()


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
