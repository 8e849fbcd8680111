"""Where a race's CPU goes while it trains: every process of one `deltaps bench compare` run, sampled from /proc.

A mode's report gets `cpu_cores_in_training`: the cores each role used on average over the training window, from
the moment every rank has begun training (its eval log's start line: start-up and imports excluded) to the first
worker's exit or kill for good (a worker killed by `--kill` and restarted does not end it; its restarted process
counts whole, start-up included):
- `worker_main`: the workers' main threads — forward, backward, the inner optimizer, evaluations, and whatever
  part of the exchange the training loop itself runs;
- `worker_threads`: every other thread of the workers (gRPC's, gloo's, a background exchange, torchft's Manager);
- `servers`: the processes on the server nodes (deltaps' shards, torchft's Lighthouse);
- `window_s`, and `host_cores` to read them against: on this 2-core box what the servers and the workers' other
  threads use is taken from the training threads.
A process's figure is its thread group's (exited threads included), read from /proc/PID/stat; its main thread's
from /proc/PID/task/PID/stat; every process of a node's tree counts (torchrun's agent and the ranks it restarts:
its main thread is a `worker_main` too, a sleeping one). Sampled every PERIOD_S; a process gone between two samples,
a child of a node's tree included, keeps its last reading (its CPU is not lost when its parent reaps it).
A run the time cap (--time-cap) stopped has no figures, nor has a run whose sampler failed (`cpu_roles_error` says why).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from deltaps.tools.process_tree import descendants, stat_fields

PERIOD_S = 0.25
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, task: int | None = None) -> float | None:
    """utime + stime of a process (or one of its threads), seconds; None once it is gone."""
    fields = stat_fields(pid, task)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_S   # fields 14 and 15 of proc(5), after pid and (comm)


def readings(pid: int) -> dict[int, tuple[float, float]]:
    """{pid or a descendant: (CPU seconds of its thread group, of its main thread alone)} so far, of the processes
    whose two stat files could both be read (one that ends between the two reads is left for the next sample)."""
    out = {}
    for p in [pid, *descendants(pid)]:
        whole, first = _cpu_s(p), _cpu_s(p, task=p)
        if whole is not None and first is not None:
            out[p] = (whole, first)
    return out


class CpuRoles(threading.Thread):
    """Samples the processes of a run (worker and server Popen lists, read live: a restarted worker is followed)
    from the moment begun() is true until stop() or the first worker exits; figures() gives the cores per role."""

    def __init__(self, workers: list, servers: list, begun: Callable[[], bool]):
        super().__init__(name="cpu-roles", daemon=True)
        self.workers, self.servers, self.begun = workers, servers, begun
        self._halt = threading.Event()
        self._last: dict[int, tuple[float, float]] = {}    # pid (any process of a tree) -> latest (total, main)
        self._first: dict[int, tuple[float, float]] = {}   # pid -> its reading at the window's start
        self._roles: dict[int, str] = {}                    # pid -> the role of the node whose tree holds it
        self._window: list[float] = []
        self.error: str | None = None                         # why the sampler stopped early, if it failed

    def _sample(self) -> None:
        for role, procs in (("worker", list(self.workers)), ("server", list(self.servers))):
            for p in procs:
                if not hasattr(p, "pid"):      # a killed worker's stand-in until its restart (bench_faults._Down)
                    continue
                for pid, reading in readings(p.pid).items():
                    self._last[pid] = reading
                    self._roles[pid] = role

    def run(self) -> None:
        try:
            while not self._halt.wait(PERIOD_S) and not self.begun():
                pass
            if self._halt.is_set():
                return
            self._window = [time.monotonic()]
            self._sample()
            self._first = dict(self._last)
            while not self._halt.wait(PERIOD_S):
                self._sample()
                self._window[1:] = [time.monotonic()]
                if any(p.poll() is not None for p in list(self.workers)):
                    return
        except Exception as e:     # a figure over a window cut short would pass for a real one: none instead
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def figures(self) -> dict:
        """{"cpu_cores_in_training": {...}} (see the module docstring); {} when the window never opened;
        {"cpu_roles_error": why} when the sampler failed."""
        if self.error:
            return {"cpu_roles_error": self.error}
        if len(self._window) < 2:
            return {}
        span = self._window[1] - self._window[0]
        used = {"worker_main": 0.0, "worker_threads": 0.0, "servers": 0.0}
        for pid, (total, main) in self._last.items():
            total0, main0 = self._first.get(pid, (0.0, 0.0))    # a process started in the window: all of it
            if self._roles[pid] == "server":
                used["servers"] += total - total0
            else:
                used["worker_main"] += main - main0
                used["worker_threads"] += (total - total0) - (main - main0)
        return {"cpu_cores_in_training": {**{k: round(v / span, 3) for k, v in used.items()},
                                          "window_s": round(span, 2), "host_cores": os.cpu_count()}}


def describe(mode: dict) -> str:
    """The one-line summary of a mode's figures (empty without them)."""
    c = mode.get("cpu_cores_in_training")
    return "" if not c else (f"; cores in training: workers' loops {c['worker_main']:.2f}, their other threads "
                             f"{c['worker_threads']:.2f}, servers {c['servers']:.2f} (of {c['host_cores']})")
