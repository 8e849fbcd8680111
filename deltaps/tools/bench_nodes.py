"""Where each process of a `deltaps bench compare` race runs: node i's network namespace of the shaped topology
(deltaps/tools/netns.py; loopback without one) and, with --cpus-per-worker, the worker nodes' CPU caps
(deltaps/tools/cpu_caps.py). Nodes 0 .. servers-1 hold shards (or torchft's Lighthouse), the rest workers.
--colocate: the shards live on the workers' machines (shard i on worker i mod W's namespace, link and CPU cap, as
BytePS's colocated mode), so a ps race uses the peers' W links instead of S + W."""
from __future__ import annotations

import os
import shutil
import tempfile

from deltaps.tools import netns
from deltaps.tools.cpu_caps import CpuCaps
from deltaps.tools.process_tree import stop_processes
from deltaps.tools.zygote import Starter, Zygote


def topology_nodes(servers: int, workers: int, colocate: bool) -> int:
    """Namespaces (links) the race's topology needs."""
    return workers if colocate else servers + workers


class Nodes:
    def __init__(self, topo: "netns.Topology | None", caps: CpuCaps | None = None, *, servers: int = 0,
                 workers: int = 0, colocate: bool = False, zygotes: bool = True, workdir: str | None = None):
        """workdir: where the zygotes' sockets and logs go (the caller's to remove; default: a new temporary
        directory that close() removes)."""
        self.topo, self.caps = topo, caps
        self._shared = (servers, workers) if colocate else None
        self._zygotes = zygotes
        self._starters: dict[tuple, Starter] = {}        # one per machine (exec prefix)
        self._hub: Zygote | None = None     # with a topology: the zygote the nodes' zygotes are forked from
        self._zygote_dir, self._owns_dir = workdir, workdir is None

    def host(self, i: int) -> int:
        """The node whose machine runs node i: i, or with --colocate a shard's worker node."""
        if self._shared is None or i >= self._shared[0]:
            return i
        servers, workers = self._shared
        return servers + i % workers

    def topology_index(self, i: int) -> int:
        return self.host(i) - (self._shared[0] if self._shared else 0)

    def prefix(self, i: int) -> list[str]:
        return self.topo.exec_prefix(self.topology_index(i)) if self.topo else []

    def addr(self, i: int) -> str:
        return self.topo.addr(self.topology_index(i)) if self.topo else "127.0.0.1"

    def ifname(self, i: int) -> str:
        return self.topo.ifname(self.topology_index(i)) if self.topo else "lo"

    def counters(self, nodes) -> dict:
        return {i: self.topo.link_bytes(self.topology_index(i)) for i in nodes} if self.topo else {}

    def started(self, i: int, proc):
        """proc, just started on node i, moved into its machine's CPU cap (if it has one)."""
        if self.caps and self.host(i) in self.caps.nodes:
            self.caps.adopt(self.host(i), proc.pid)
        return proc

    def spawn(self, i: int, argv: list[str], log: str, env: dict | None = None, append: bool = False):
        """`deltaps <argv...>` on node i, output to log: forked from its machine's zygote (started on first use,
        kept until close(): deltaps/tools/zygote.py), or with zygotes off a fresh `python -m deltaps`."""
        machine = tuple(self.prefix(i))
        if machine not in self._starters:
            self.start_zygotes([i])
        with open(log, "a" if append else "w") as out:
            return self.started(i, self._starters[machine](argv, out, env))

    def start_zygotes(self, nodes) -> None:
        """Start the zygotes of these nodes' machines side by side and wait for them (a zygote started by a spawn
        would make that node's program start ~2 s after the others: start skew on the clock of a race's first run)."""
        started = []
        for i in nodes:
            machine = tuple(self.prefix(i))
            if machine in self._starters:
                continue
            path = None
            if self._zygotes:
                if self._zygote_dir is None:
                    self._zygote_dir = tempfile.mkdtemp(prefix="deltaps-zygotes-")
                os.makedirs(self._zygote_dir, exist_ok=True)
                path = os.path.join(self._zygote_dir, f"node{self.topology_index(i)}" if self.topo else "local")
                if self.topo and self._hub is None:     # torch imported once, not once per node on shared cores
                    hub = os.path.join(self._zygote_dir, "hub")
                    self._hub = Zygote(hub, log=hub + ".log")     # held before ready(): close() stops it
                    self._hub.ready()
            node = self.topo.node(self.topology_index(i)) if self._hub else None
            self._starters[machine] = Starter(path, list(machine), hub=self._hub, node=node)
            started.append(self._starters[machine])
        for starter in started:
            starter.ready()

    def close(self) -> None:
        """Stop the zygotes (their children are the caller's to stop first)."""
        stop_processes([s.zygote.proc for s in self._starters.values() if s.zygote is not None])   # all at once
        self._starters.clear()
        if self._hub is not None:       # after the zygotes it forked: it reports their exits
            self._hub.stop()
            self._hub = None
        if self._owns_dir and self._zygote_dir:
            shutil.rmtree(self._zygote_dir, ignore_errors=True)
            self._zygote_dir = None

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
