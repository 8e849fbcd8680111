"""Where each process of a `deltaps bench compare` race runs: node i's network namespace of the shaped topology
(deltaps/tools/netns.py; loopback without one) and, with --cpus-per-worker, the worker nodes' CPU caps
(deltaps/tools/cpu_caps.py). Nodes 0 .. servers-1 hold shards (or torchft's Lighthouse), the rest workers."""
from __future__ import annotations

from deltaps.tools import netns
from deltaps.tools.cpu_caps import CpuCaps


class Nodes:
    def __init__(self, topo: "netns.Topology | None", caps: CpuCaps | None = None):
        self.topo, self.caps = topo, caps

    def prefix(self, i: int) -> list[str]:
        return self.topo.exec_prefix(i) if self.topo else []

    def addr(self, i: int) -> str:
        return self.topo.addr(i) if self.topo else "127.0.0.1"

    def ifname(self, i: int) -> str:
        return self.topo.ifname(i) if self.topo else "lo"

    def counters(self, nodes) -> dict:
        return {i: self.topo.link_bytes(i) for i in nodes} if self.topo else {}

    def started(self, i: int, proc):
        """proc, just started on node i, moved into the node's CPU cap (if it has one)."""
        if self.caps and i in self.caps.nodes:
            self.caps.adopt(i, proc.pid)
        return proc

    def cpu(self, nodes) -> dict:
        """{node: (CPU seconds used, seconds throttled by the cap)} so far; {} without caps."""
        return {i: (self.caps.usage_s(i), self.caps.throttled_s(i)) for i in nodes} if self.caps else {}


def cpu_figures(before: dict, after: dict) -> dict:
    """A run's CPU seconds and throttled seconds per worker (node order), from Nodes.cpu() before and after it."""
    if not before:
        return {}
    nodes = sorted(before)
    return {"cpu_s_per_worker": [round(after[i][0] - before[i][0], 3) for i in nodes],
            "throttled_s_per_worker": [round(after[i][1] - before[i][1], 3) for i in nodes]}
