"""Per-worker CPU caps for `deltaps bench compare --cpus-per-worker X` (Linux cgroups, needs root).

Every worker's process tree runs in a cgroup of its own whose CFS quota is X cores, so the time one worker does not
use (a sleeping straggler, a rank waiting on the network or for its peers) is not handed to the other workers: the
box behaves like a cluster where each worker has a machine of its own, X cores wide. Without caps, 4 workers on
2 shared cores trade CPU among themselves and a straggler that sleeps speeds its peers up. Shards, the torchft
Lighthouse and the bench itself run uncapped on what is left.

A straggler under caps (`--straggler RANK:F` with `--cpus-per-worker X`, deltaps/tools/bench_faults.py) is its node
capped at X / F cores: a machine F times slower that is busy all the time. Sleeping (F - 1) x its compute, as without
caps, would cost a capped worker nothing: the sleep falls in the part of each period its quota keeps it off the CPU
anyway (measured: a sleeping straggler at factor 2 under a 0.4-core cap ran as fast as the others).

    caps = CpuCaps(0.4, nodes=[4, 5, 6, 7], prefix="dpsb")   # one cgroup per worker node
    caps.up(); caps.adopt(4, proc.pid); ...; caps.usage_s(4); caps.down()

A process is moved into its node's cgroup right after it starts (the interpreter is still importing; children it
forks later, torchrun's workers included, inherit the cgroup). The period is short (PERIOD_US) so a capped rank is
never held off the CPU for long stretches: a quota spent early in a 100 ms period would stall a rank that its
peers wait on for up to 100 ms, which no separate machine does.

Both cgroup layouts: v2 (cpu.max, cpu.stat usage_usec / throttled_usec) when the unified hierarchy has the cpu
controller, else v1 (cpu.cfs_quota_us / cpu.cfs_period_us, cpuacct.usage, cpu.stat throttled_time).
"""
from __future__ import annotations

import os
import sys

PERIOD_US = 10_000                         # 10 ms: a capped rank waits at most 10 ms x (1 - X) for its quota
V2_ROOT = "/sys/fs/cgroup"
V1_CPU, V1_ACCT = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpuacct"


def quota_us(cores: float) -> int:
    """The CFS quota per PERIOD_US that caps a cgroup at `cores` (the kernel's floor is 1 ms)."""
    return max(1000, round(cores * PERIOD_US))


class CapsUnavailable(RuntimeError):
    """The machine cannot cap a process's CPU (not Linux, not root, no cpu cgroup controller)."""


def layout(v2_root: str = V2_ROOT, v1_cpu: str = V1_CPU) -> str:
    """'v2' or 'v1': the cgroup layout with a cpu controller here; CapsUnavailable names what is missing."""
    if not sys.platform.startswith("linux"):
        raise CapsUnavailable("CPU caps need Linux cgroups")
    if os.geteuid() != 0:
        raise CapsUnavailable("CPU caps need root (writing cgroups)")
    try:
        with open(os.path.join(v2_root, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return "v2"
    except OSError:
        pass
    if os.path.exists(os.path.join(v1_cpu, "cpu.cfs_quota_us")):
        return "v1"
    raise CapsUnavailable(f"no cpu cgroup controller ({v2_root}/cgroup.controllers lacks cpu, "
                          f"{v1_cpu}/cpu.cfs_quota_us missing)")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _stat(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


class CpuCaps:
    """One capped cgroup per node in `nodes`, named '<prefix>-cap<node>' (the bench's namespace prefix: a crashed
    run's cgroups are reused, their stray processes moved out)."""

    def __init__(self, cores: float, nodes, prefix: str, v2_root: str = V2_ROOT, v1_cpu: str = V1_CPU,
                 v1_acct: str = V1_ACCT, kind: str | None = None):
        if not 0.01 <= cores <= (os.cpu_count() or 1):
            raise ValueError(f"--cpus-per-worker must be in 0.01 .. {os.cpu_count()} (the cores of this machine), "
                             f"got {cores:g}")
        self.cores, self.nodes, self.prefix = cores, list(nodes), prefix
        self.kind = kind or layout(v2_root, v1_cpu)
        self.v2_root, self.v1_cpu, self.v1_acct = v2_root, v1_cpu, v1_acct

    def dirs(self, node: int) -> list[str]:
        """The node's cgroup directories: one (v2) or the cpu and cpuacct ones (v1; they may be one mount)."""
        name = f"{self.prefix}-cap{node}"
        if self.kind == "v2":
            return [os.path.join(self.v2_root, name)]
        acct = os.path.join(self.v1_acct, name)
        cpu = os.path.join(self.v1_cpu, name)
        return [cpu] if os.path.realpath(self.v1_acct) == os.path.realpath(self.v1_cpu) else [cpu, acct]

    def up(self) -> "CpuCaps":
        if self.kind == "v2":       # the root must hand the cpu controller to its children
            _write(os.path.join(self.v2_root, "cgroup.subtree_control"), "+cpu")
        for node in self.nodes:
            for d in self.dirs(node):
                if os.path.isdir(d):
                    self._evacuate(d)
                os.makedirs(d, exist_ok=True)
            self.set_cores(node, self.cores)
        return self

    def set_cores(self, node: int, cores: float) -> None:
        """Cap node's cgroup at `cores` from now on (a straggler: the cap over its slow-down factor)."""
        quota = quota_us(cores)
        cpu = self.dirs(node)[0]
        if self.kind == "v2":
            _write(os.path.join(cpu, "cpu.max"), f"{quota} {PERIOD_US}")
        else:
            _write(os.path.join(cpu, "cpu.cfs_quota_us"), "-1")     # a period below the quota is refused
            _write(os.path.join(cpu, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(quota))

    def adopt(self, node: int, pid: int) -> None:
        """Move process `pid` (and the children it forks from now on) into node's cgroup."""
        for d in self.dirs(node):
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def usage_s(self, node: int) -> float:
        """CPU seconds the node's cgroup has used since up()."""
        if self.kind == "v2":
            return _stat(_read(os.path.join(self.dirs(node)[0], "cpu.stat")))["usage_usec"] / 1e6
        return int(_read(os.path.join(self.dirs(node)[-1], "cpuacct.usage"))) / 1e9

    def throttled_s(self, node: int) -> float:
        """Seconds the node's processes were held off the CPU by the cap since up()."""
        stat = _stat(_read(os.path.join(self.dirs(node)[0], "cpu.stat")))
        return stat["throttled_usec"] / 1e6 if self.kind == "v2" else stat["throttled_time"] / 1e9

    def _evacuate(self, d: str) -> None:
        """Move whatever still runs in cgroup d to its parent (rmdir refuses a cgroup with processes)."""
        parent = os.path.join(os.path.dirname(d), "cgroup.procs")
        for pid in _read(os.path.join(d, "cgroup.procs")).split():
            try:
                _write(parent, pid)
            except OSError:      # exited meanwhile
                pass

    def down(self) -> None:
        for node in self.nodes:
            for d in self.dirs(node):
                if os.path.isdir(d):
                    self._evacuate(d)
                    os.rmdir(d)

    def describe(self) -> dict:
        return {"cores_per_worker": self.cores, "period_ms": PERIOD_US / 1000, "quota_ms": quota_us(self.cores) / 1000,
                "cgroup": self.kind, "uncapped": "shards, the torchft Lighthouse and the bench itself"}
