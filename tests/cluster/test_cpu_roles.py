"""deltaps/tools/cpu_roles.py on real processes: a training-like child's main thread, an idle server, the window."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from deltaps.tools import torch_probes
from deltaps.tools.cpu_roles import CpuRoles


def _busy_worker() -> subprocess.Popen:
    """A child whose main thread trains an MLP on one torch thread for several seconds (the advise compute probe)."""
    return subprocess.Popen(torch_probes.command("compute", 256, 2, 64, 3000, time.time()),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_busy_main_thread_is_the_workers_and_an_idle_server_costs_nothing():
    workers, servers = [_busy_worker()], [subprocess.Popen(["sleep", "60"])]
    roles = CpuRoles(workers, servers, begun=lambda: True)
    try:
        roles.start()
        time.sleep(3.0)
        roles.stop()
        got = roles.figures()["cpu_cores_in_training"]
    finally:
        for p in workers + servers:
            p.kill()
            p.wait()
    assert 2.0 < got["window_s"] < 4.0
    assert got["worker_main"] > 0.3, got            # about a core, less when the suite's other work shares them
    assert got["worker_threads"] < got["worker_main"], got
    assert got["servers"] < 0.05, got
    assert got["host_cores"] >= 1


def test_the_window_opens_when_training_has_begun_and_ends_at_the_first_worker_exit():
    quick, busy = subprocess.Popen(["sleep", "1.5"]), _busy_worker()
    opened = time.monotonic() + 0.6
    roles = CpuRoles([quick, busy], [], begun=lambda: time.monotonic() > opened)
    try:
        roles.start()
        time.sleep(3.5)                                 # the quick one exited at 1.5 s: the window closed then
        roles.stop()
        got = roles.figures()["cpu_cores_in_training"]
    finally:
        for p in (quick, busy):
            p.kill()
            p.wait()
    assert roles._window[0] >= opened and 0.5 < got["window_s"] < 1.6, got


def test_a_child_reaped_by_its_node_keeps_its_cpu():
    """A node (torchrun's agent, say) whose rank trained and was reaped inside the window: the rank's CPU counts."""
    parent = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "reaping_parent.py"), "600", "1.5"],
                              cwd=Path(__file__).parents[2])
    roles = CpuRoles([parent], [], begun=lambda: True)
    try:
        roles.start()
        assert parent.wait(60) == 0
        roles.stop()
        got = roles.figures()["cpu_cores_in_training"]
    finally:
        parent.kill()
    # the child's ~1 core while it ran, over the whole window; without the child's own reading only the parent's
    # few imports would count (~0.02-0.05)
    assert got["worker_main"] > 0.3, got


def test_a_failing_sampler_gives_no_figures_but_why():
    class Broken:
        pid = os.getpid()

        def poll(self):
            raise OSError("no /proc here")
    roles = CpuRoles([Broken()], [], begun=lambda: True)
    roles.start()
    time.sleep(0.6)
    roles.stop()
    assert roles.figures() == {"cpu_roles_error": "OSError: no /proc here"}


def test_no_figures_when_training_never_began():
    worker = subprocess.Popen(["sleep", "60"])
    roles = CpuRoles([worker], [], begun=lambda: False)
    try:
        roles.start()
        time.sleep(0.6)
        roles.stop()
    finally:
        worker.kill()
        worker.wait()
    assert roles.figures() == {}
