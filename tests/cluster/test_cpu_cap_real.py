"""A real cgroup cap (deltaps/tools/cpu_caps.py): a busy process and its children stay within X cores."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from deltaps.tools.cpu_caps import CapsUnavailable, CpuCaps, layout

try:
    layout()
    WHY = ""
except CapsUnavailable as e:
    WHY = str(e)


def _spin_pair(go, seconds: float) -> None:
    """Wait for `go`, then fork and spin in both processes (the child must inherit its parent's cgroup)."""
    go.wait()
    child = os.fork()
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        pass
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)


@pytest.mark.skipif(bool(WHY), reason=WHY or "-")
def test_a_capped_busy_tree_uses_at_most_its_share_and_the_cgroup_goes_away():
    caps = CpuCaps(0.25, [9], f"tcap{os.getpid()}").up()
    go = multiprocessing.Event()
    try:
        proc = multiprocessing.Process(target=_spin_pair, args=(go, 1.5))
        proc.start()
        caps.adopt(9, proc.pid)      # before its fork: the child inherits the cgroup
        t0 = time.monotonic()
        go.set()
        proc.join(10)
        wall = time.monotonic() - t0
        used, held = caps.usage_s(9), caps.throttled_s(9)
    finally:
        caps.down()
    assert used <= 0.25 * wall * 1.15 + 0.05, (used, wall)       # two spinning processes held to a quarter core
    assert used >= 0.25 * wall * 0.5, (used, wall)
    assert held > 0.5
    assert not any(os.path.exists(d) for d in caps._dirs(9))
