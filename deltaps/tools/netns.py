"""A bandwidth-limited test network out of Linux network namespaces (needs root and iproute2).

    with Topology(6, rate="1gbit") as topo:          # node i: namespace topo.ns(i), address topo.addr(i)
        subprocess.Popen(topo.exec_prefix(0) + ["python", "-m", "deltaps", "server", "--host", topo.addr(0), ...])

Layout: one namespace per process ("<prefix>-<i>") holding one end of a veth pair ("<prefix><i>",
address 198.18.0.<i+2>/24); the other end ("<prefix><i>b") sits in a bridge namespace of its own
("<prefix>-br") and is enslaved to a bridge there. Nothing is attached to the host's namespace, so
the addresses (198.18.0.0/24, the RFC 2544 benchmarking range) exist only inside these namespaces.
Every byte between two processes leaves one veth and enters another, and both ends of every veth
carry a tbf qdisc at the given rate: each process has `rate` up and `rate` down.

Latency: with the netem qdisc available, `latency` (one-way, process to process) is split in two
halves, one on each veth end it crosses; without netem (this project's CI machine), latency is not
applied and `latency_applied` says so.

Cleanup: `down()` deletes the namespaces (which destroys their veths and the bridge); `up()` first
removes anything left with the same prefix by a crashed run. Use as a context manager, and let the
caller turn SIGTERM/SIGHUP into exceptions so `finally`/`__exit__` runs (deltaps/tools/children.py
install_signal_handlers).
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

from deltaps.tools.node_host import NETNS_ETC  # per-namespace /etc files that `ip netns exec` bind-mounts
from deltaps.tools.socket_probes import stream_seconds
from deltaps.units import parse_rate, parse_time_ms

PREFIX = "dpsb"
SUBNET = "198.18.0"


def shaping_available() -> tuple[bool, str]:
    """(ok, reason): can this process build namespaces and shape links?"""
    if not sys.platform.startswith("linux"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return False, f"`{tool}` (iproute2) not found"
    return True, "ok"


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def list_leftovers(prefix: str = PREFIX) -> dict:
    """Namespaces and host links whose names start with the prefix."""
    ns = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if line.strip()]
    links = []
    out = _run(["ip", "-j", "link", "show"], check=False).stdout
    try:
        links = [link["ifname"] for link in json.loads(out or "[]")]
    except json.JSONDecodeError:
        pass
    return {"netns": [n for n in ns if n.startswith(prefix + "-")],
            "links": [name for name in links if name.startswith(prefix)]}


class PrefixInUse(RuntimeError):
    pass


def _lock_path(prefix: str) -> str:
    d = "/run/lock" if os.path.isdir("/run/lock") else "/tmp"
    return os.path.join(d, f"deltaps-netns-{prefix}.lock")


def acquire_prefix(prefix: str = PREFIX) -> int:
    """Own the prefix: an flock held while a run uses it, so a second run can tell live namespaces
    from a crashed run's leftovers (the kernel drops the lock when its holder dies)."""
    fd = os.open(_lock_path(prefix), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise PrefixInUse(f"namespace prefix {prefix!r} is in use by a running process (pid {holder}); "
                          "use another prefix (bench compare: --netns-prefix)") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def release_prefix(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def cleanup(prefix: str = PREFIX) -> dict:
    """Remove a crashed run's leftovers with this prefix; refuses (PrefixInUse) while a run owns it."""
    fd = acquire_prefix(prefix)
    try:
        return _cleanup(prefix)
    finally:
        release_prefix(fd)


def _cleanup(prefix: str) -> dict:
    left = list_leftovers(prefix)
    for name in left["links"]:
        _run(["ip", "link", "del", name], check=False)
    for name in left["netns"]:
        _run(["ip", "netns", "del", name], check=False)
    for path in glob.glob(os.path.join(NETNS_ETC, f"{prefix}-*")):
        shutil.rmtree(path, ignore_errors=True)
    return left


def host_names_here(ns: str, addr: str, nodes: dict[str, str]) -> None:
    """Inside namespace `ns` (`ip netns exec` bind-mounts /etc/netns/<ns>/hosts) every node's host name (`nodes`:
    name -> address; exec_prefix gives each node's processes its name) resolves to that node's address, and this
    machine's own name to the namespace's address: programs that advertise gethostname() (gloo's default device,
    torchft's Manager and checkpoint server) then reach each other as on separate hosts."""
    os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
    with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
        f.writelines(f"{a} {name}\n" for name, a in nodes.items())


class Topology:
    def __init__(self, nodes: int, rate: str | None = "1gbit", latency: str | None = None,
                 prefix: str = PREFIX, subnet: str = SUBNET):
        if not 1 <= nodes <= 250:
            raise ValueError("1..250 nodes")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ValueError("prefix: up to 8 lowercase letters/digits (interface names are short)")
        self.nodes, self.rate, self.latency, self.prefix, self.subnet = nodes, rate, latency, prefix, subnet
        self.rate_bps = parse_rate(rate) if rate else None
        self.latency_applied = False
        self.notes: list[str] = []
        self.is_up = False
        self._lock: int | None = None

    # ---- names -------------------------------------------------------------------------------
    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    def ifname(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def exec_prefix(self, i: int) -> list[str]:
        """Run a command on node i: in its namespace, under a host name of its own (deltaps/tools/node_host.py)."""
        node = self.node(i)
        return ["ip", "netns", "exec", node["netns"], "unshare", "--uts", sys.executable, "-m",
                "deltaps.tools.node_host", node["hostname"]]

    def node(self, i: int) -> dict:
        """Node i as a process enters it in-process (node_host.enter): its namespace and host name."""
        return {"netns": self.ns(i), "hostname": self.ns(i)}

    # ---- lifecycle -------------------------------------------------------------------------
    def up(self) -> "Topology":
        ok, why = shaping_available()
        if not ok:
            raise RuntimeError(f"cannot build namespaces: {why}")
        self._lock = acquire_prefix(self.prefix)      # raises PrefixInUse if a live run has it
        stale = _cleanup(self.prefix)                  # whatever is left now belongs to a dead run
        if stale["netns"] or stale["links"]:
            self.notes.append(f"removed leftovers of an earlier run: {stale}")
        self.is_up = True     # from here on, down() has something to remove
        br = self.bridge_ns
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        netem = bool(self.latency) and self._netem_available()
        if self.latency and not netem:
            self.notes.append(f"latency {self.latency} requested but the netem qdisc is not available "
                              "on this kernel: latency NOT applied (bandwidth shaping only)")
        self.latency_applied = netem
        for i in range(self.nodes):
            ns, dev, peer = self.ns(i), self.ifname(i), self.ifname(i) + "b"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", br])
            _run(["ip", "-n", br, "link", "set", peer, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", peer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            host_names_here(ns, self.addr(i), {self.ns(j): self.addr(j) for j in range(self.nodes)})
            for where, d in ((ns, dev), (br, peer)):      # egress of both ends = both directions
                self._shape(where, d, netem)
        return self

    def _netem_available(self) -> bool:
        p = _run(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                 check=False)
        if p.returncode == 0:
            _run(["tc", "-n", self.bridge_ns, "qdisc", "del", "dev", "lo", "root"], check=False)
            return True
        return False

    def _shape(self, ns: str, dev: str, netem: bool) -> None:
        if not self.rate_bps and not netem:
            return
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        parent = ["root"]
        if netem:
            half_ms = parse_time_ms(self.latency) / 2
            _run(tc + ["root", "handle", "1:", "netem", "delay", f"{half_ms * 1000:.0f}us", "limit", "100000"])
            parent = ["parent", "1:1"]
        if self.rate_bps:
            burst = link_burst_bytes(self.rate_bps)
            _run(tc + parent + ["handle", "10:", "tbf", "rate", f"{int(self.rate_bps)}bit",
                                "burst", str(burst), "latency", "50ms"])

    def down(self) -> None:
        if self.is_up:
            _cleanup(self.prefix)
            self.is_up = False
        if self._lock is not None:
            release_prefix(self._lock)
            self._lock = None

    def __enter__(self) -> "Topology":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    # ---- measurements ----------------------------------------------------------------------
    def link_bytes(self, i: int) -> tuple[int, int]:
        """(tx, rx) byte counters of node i's veth, as seen from the node."""
        out = _run(["ip", "-n", self.ns(i), "-j", "-s", "link", "show", "dev", self.ifname(i)]).stdout
        st = json.loads(out)[0]["stats64"]
        return int(st["tx"]["bytes"]), int(st["rx"]["bytes"])

    def describe(self) -> str:
        lat = (f", latency {self.latency} one-way" if self.latency_applied
               else (f", latency {self.latency} NOT applied (no netem)" if self.latency else ""))
        return (f"{self.nodes} namespaces ({self.prefix}-0..{self.nodes - 1}) on bridge {self.bridge_ns}, "
                f"veth links shaped with tbf at {self.rate or 'unlimited'} each way{lat}, "
                f"addresses {self.subnet}.2-{self.nodes + 1}")


BURST_MIN_BYTES = 8 * 1024


def link_burst_bytes(rate_bps: float) -> int:
    """tbf's bucket: 1 ms of traffic, at least BURST_MIN_BYTES (a few full frames). A bucket refills while a link is
    idle and its contents then leave at veth speed: 128 KiB (the old size) sent a 160 KB message after a second's idle
    at 38.8 Mbit/s on a "10 Mbit/s" link, so a compressed round, idle between exchanges, went mostly unshaped while
    a megabyte allreduce did not (measured: /tmp/burst_probe.py, docs/compare.md). tbf cuts a GSO super-packet larger
    than its bucket into segments, so a small bucket drops nothing."""
    return int(max(BURST_MIN_BYTES, rate_bps / 8 * 0.001))


def measure_throughput(topo: Topology, src: int, dst: int, nbytes: int = 8 << 20, port: int = 5201) -> float:
    """Bits per second of one TCP stream from node src to node dst (Python sockets, no iperf needed)."""
    return nbytes * 8 / stream_seconds(topo, [(src, dst)], port, nbytes)[0]


if __name__ == "__main__":   # python -m deltaps.tools.netns [cleanup|selftest RATE]
    if len(sys.argv) > 1 and sys.argv[1] == "cleanup":
        print(cleanup())
    else:
        rate = sys.argv[2] if len(sys.argv) > 2 else "1gbit"
        with Topology(2, rate=rate) as t:
            print(t.describe())
            time.sleep(0.2)
            print(f"measured {measure_throughput(t, 0, 1, 64 << 20) / 1e9:.3f} Gbit/s")
        print("leftovers after teardown:", list_leftovers())
