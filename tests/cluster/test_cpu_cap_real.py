"""A real cgroup cap (deltaps/tools/cpu_caps.py): a busy process and its children stay within X cores."""
from __future__ import annotations

import json
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
    assert not any(os.path.exists(d) for d in caps.dirs(9))


@pytest.mark.skipif(bool(WHY), reason=WHY or "-")
def test_bench_compare_caps_every_worker_and_slows_the_straggler_by_its_cap(tmp_path):
    """End to end: a capped straggler (its cap over the factor once it trains) is about that much slower per step,
    every worker's CPU is accounted, and no cgroup is left behind."""
    from deltaps.tools import bench_compare as bc
    out = tmp_path / "caps.json"
    # hidden 256 and 96 steps: ~1.5 ms of compute per step at 64 left the ratio to where the 10 ms CFS periods fell
    # (1.09-1.63 over four runs); here it was 2.1-2.4
    rc = bc.main(["--workers", "2", "--servers", "1", "--steps", "96", "--workload", "clf", "--hidden", "256",
                  "--eval-every", "16", "--modes", "ddp", "--no-shaping", "--straggler", "1:2",
                  "--cpus-per-worker", "0.5", "--netns-prefix", "dpsc", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["cpu_caps"]["cores_per_worker"] == 0.5
    m = r["modes"]["ddp"]
    # The healthy worker waits out the straggler in every allreduce, so it seldom spends its 0.5-core quota and computes
    # at up to a whole free core: the factor lies between F (both held to their caps) and F x 1 / 0.5 = 4 (alone
    # 2.1-2.5; 3.02-3.05 in two fresh clones' `make test`; 1.37 once when the other worker did not get its own core
    # either). A cap that did not hold leaves it near 1; one applied twice, near 4-8.
    assert m["straggler"]["how"] == "cpu cap / factor" and 1.25 <= m["straggler"]["achieved_factor"] <= 4.0, m["straggler"]
    assert len(m["cpu_s_per_worker"]) == 2 and all(c > 0 for c in m["cpu_s_per_worker"])
    assert m["throttled_s_per_worker"][1] > 0                  # the straggler was held to its cap
    assert m["healthy_time_to_target_s"] is None and m["goodput"] is None      # no target: nothing to compare
    caps = CpuCaps(0.5, [1, 2], "dpsc")
    assert not any(os.path.exists(d) for node in caps.nodes for d in caps.dirs(node))
