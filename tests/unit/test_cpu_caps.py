"""CpuCaps (deltaps/tools/cpu_caps.py) against fake cgroup trees of both layouts: what it writes and reads."""
from __future__ import annotations

import os

import pytest

from deltaps.tools.cpu_caps import PERIOD_US, CpuCaps, layout


def _v2_tree(root):
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    return CpuCaps(0.4, [4, 5], "tst", v2_root=str(root), kind="v2")


def test_v2_caps_each_node_at_its_share_of_a_short_period(tmp_path):
    caps = _v2_tree(tmp_path).up()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    for node in (4, 5):
        assert (tmp_path / f"tst-cap{node}" / "cpu.max").read_text() == f"{int(0.4 * PERIOD_US)} {PERIOD_US}"
    caps.adopt(5, 4242)
    assert (tmp_path / "tst-cap5" / "cgroup.procs").read_text() == "4242"
    (tmp_path / "tst-cap5" / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nthrottled_usec 750000\n")
    assert caps.usage_s(5) == 2.5 and caps.throttled_s(5) == 0.75
    assert caps.describe()["cgroup"] == "v2" and caps.describe()["quota_ms"] == 4.0
    caps.set_cores(5, 0.2)       # a straggler at factor 2
    assert (tmp_path / "tst-cap5" / "cpu.max").read_text() == f"{int(0.2 * PERIOD_US)} {PERIOD_US}"


def test_v1_sets_the_period_before_the_quota_and_reads_cpuacct(tmp_path):
    cpu, acct = tmp_path / "cpu", tmp_path / "cpuacct"
    cpu.mkdir()
    acct.mkdir()
    caps = CpuCaps(1.5, [3], "tst", v1_cpu=str(cpu), v1_acct=str(acct), kind="v1").up()
    d = cpu / "tst-cap3"
    assert (d / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
    assert (d / "cpu.cfs_quota_us").read_text() == str(int(1.5 * PERIOD_US))
    caps.adopt(3, 77)      # both hierarchies: cpu for the quota, cpuacct for the usage
    assert (d / "cgroup.procs").read_text() == "77" and (acct / "tst-cap3" / "cgroup.procs").read_text() == "77"
    (acct / "tst-cap3" / "cpuacct.usage").write_text("3000000000\n")
    (d / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 500000000\n")
    assert caps.usage_s(3) == 3.0 and caps.throttled_s(3) == 0.5


def test_a_crashed_runs_cgroup_is_reused_and_its_processes_moved_out(tmp_path):
    caps = _v2_tree(tmp_path)
    stale = tmp_path / "tst-cap4"
    stale.mkdir()
    (stale / "cgroup.procs").write_text("111\n")
    caps.up()
    assert (tmp_path / "cgroup.procs").read_text() == "111"     # moved to the parent (the fake keeps the last write)


@pytest.mark.parametrize("cores", [0.0, -1.0, (os.cpu_count() or 1) + 1])
def test_a_share_outside_the_machine_is_refused_by_name(cores, tmp_path):
    with pytest.raises(ValueError, match="--cpus-per-worker must be in"):
        CpuCaps(cores, [1], "tst", v2_root=str(tmp_path), kind="v2")


def test_layout_prefers_the_unified_hierarchy_when_it_has_the_cpu_controller(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("layout() refuses without root before looking")
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    assert layout(str(tmp_path), str(tmp_path / "none")) == "v2"
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert layout(str(tmp_path), str(v1)) == "v1"
    with pytest.raises(RuntimeError, match="no cpu cgroup controller"):
        layout(str(tmp_path), str(tmp_path / "none"))
