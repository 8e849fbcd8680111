"""Network probes: achieved bandwidth and latency on shaped namespace links, the host's veth throughput,
and the floors of allreduce and of the PS step path when every process shares this host's cores."""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from deltaps.tools import costmodel as cm
from deltaps.tools import socket_probes, torch_probes
from deltaps.tools.children import checkout_env
from deltaps.units import parse_rate


def probe_network(rate: str, streams=(1, 2, 4), prefix: str = "dpsa", nbytes: int | None = None) -> dict:
    """Achieved per-link bandwidth with k concurrent streams (node i -> i+1 in a ring of k nodes; k=1:
    one stream) and one-way per-message latency, on a namespace network shaped to `rate`."""
    from deltaps.tools import netns
    ok, why = netns.shaping_available()
    nominal = parse_rate(rate) / 8
    if not ok:
        return {"rate": rate, "shaped": False, "note": f"not measured ({why}): nominal rate used",
                "bandwidth_by_streams": {1: nominal}, "alpha_s": 0.0}
    want = nbytes or int(min(64 << 20, max(2 << 20, nominal * 0.5)))
    nodes = max(2, max(streams))
    res = {"rate": rate, "shaped": True, "bandwidth_by_streams": {}, "probe_bytes": want}
    with netns.Topology(nodes, rate=rate, prefix=prefix) as topo:
        time.sleep(0.2)
        res["alpha_s"] = socket_probes.one_way_latency(topo, 0, 1, port=5301)
        for k in streams:
            pairs = [(0, 1)] if k == 1 else [(i, (i + 1) % k) for i in range(k)]
            port = 5400 + 10 * k
            secs = socket_probes.stream_seconds(topo, pairs, port, want)
            res["bandwidth_by_streams"][k] = statistics.median(want / s for s in secs)
    return res


def probe_host_network(streams=(1, 2, 4), prefix: str = "dpsa", nbytes: int = 32 << 20) -> dict:
    """What the host's CPUs can push through veth links at all: k concurrent streams on UNshaped
    namespace links (ring i -> i+1), bytes/s summed over the streams."""
    from deltaps.tools import netns
    ok, _ = netns.shaping_available()
    if not ok:
        return {}
    out = {}
    with netns.Topology(max(2, max(streams)), rate=None, prefix=prefix) as topo:
        time.sleep(0.2)
        for k in streams:
            pairs = [(0, 1)] if k == 1 else [(i, (i + 1) % k) for i in range(k)]
            port = 5600 + 10 * k
            secs = socket_probes.stream_seconds(topo, pairs, port, nbytes)
            out[k] = k * nbytes / max(secs)
    return out


@contextlib.contextmanager
def _unshaped_topology(nodes: int, prefix: str):
    """Unshaped namespace links for `nodes` processes (torn down on exit), or None: plain loopback
    where namespaces are unavailable."""
    from deltaps.tools import netns
    if not netns.shaping_available()[0]:
        yield None
        return
    with netns.Topology(nodes, rate=None, prefix=prefix) as topo:
        yield topo


def probe_allreduce(grad_bytes: int, procs=(2, 4), prefix: str = "dpsa", bucket_bytes: int = 25 << 20,
                    repeats: int = 30, rounds: int = 2) -> dict:
    """Seconds per step of gloo's ring allreduce of the model's gradient with k processes of this
    host, over unshaped namespace links (plain loopback where namespaces are unavailable): the CPU
    floor of allreduce on a shared host (copies, sums, veth), which a shaped link cannot go below.
    The fastest of `rounds` runs is kept (a floor: other load on the box only adds time)."""
    from deltaps.tools.launch import free_port
    out = {}
    for k in sorted(p for p in set(procs) if p >= 2):
        with _unshaped_topology(k, prefix) as topo:
            addr = topo.addr(0) if topo else "127.0.0.1"
            for i in range(max(1, rounds)):
                port = str(29611 + i) if topo else str(free_port())
                procs_ = []
                for r in range(k):
                    env = {**checkout_env(), "GLOO_SOCKET_IFNAME": topo.ifname(r) if topo else "lo"}
                    cmd = torch_probes.command("allreduce", r, k, addr, port, grad_bytes, bucket_bytes, repeats)
                    procs_.append(subprocess.Popen((topo.exec_prefix(r) if topo else []) + cmd, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
                outs = [p.communicate(timeout=300)[0] for p in procs_]
                if procs_[0].returncode != 0:
                    raise RuntimeError(f"allreduce probe with {k} processes failed (exit {procs_[0].returncode})")
                out[k] = min(out.get(k, math.inf), float(outs[0].strip()))
    return out


def probe_ps_host(tensors, codecs, procs=(2, 4), shards: int = 2, prefix: str = "dpsa", steps: int = 30,
                  rounds: int = 2) -> dict:
    """{codec: {k: s}}: the training step's PS path alone (DistributedOptimizer: bucketed PushPulls,
    codec kernels, BSP wait, loading the pulled values; no forward/backward) of k worker processes with
    the model's tensors against `shards` real `deltaps server`s, all on this host over unshaped
    namespace links (loopback without namespaces): the PS counterpart of probe_allreduce, the floor
    a shaped link cannot go below when every process shares these cores. Rounds interleave the
    codecs and keep each one's fastest."""
    from deltaps.tools.launch import wait_port_file
    from deltaps.tools.process_tree import stop_processes
    out: dict = {}
    spec = json.dumps([[name, int(numel)] for name, numel in tensors])
    for k in sorted(p for p in set(procs) if p >= 2):
        with _unshaped_topology(k + shards, prefix) as topo:
            host = [topo.addr(i) if topo else "127.0.0.1" for i in range(k + shards)]
            run = [topo.exec_prefix(i) if topo else [] for i in range(k + shards)]
            for codec in [c for _ in range(max(1, rounds)) for c in codecs]:
                with tempfile.TemporaryDirectory(prefix="deltaps-advise-ps-") as tmp:
                    srvs = [subprocess.Popen(run[i] + [
                                sys.executable, "-m", "deltaps", "server", "--host", host[i], "--port", "0", "--shard-id",
                                str(i), "--num-shards", str(shards), "--port-file", os.path.join(tmp, f"p{i}")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=checkout_env()) for i in range(shards)]
                    clients = []
                    try:
                        addrs = ",".join(f"{host[i]}:{wait_port_file(os.path.join(tmp, f'p{i}'), s)}"
                                         for i, s in enumerate(srvs))
                        clients = [subprocess.Popen(
                                       run[shards + r] + torch_probes.command("ps-step", addrs, r, k, codec, spec, steps),
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=checkout_env())
                                   for r in range(k)]
                        outs = [c.communicate(timeout=300)[0] for c in clients]
                        if any(c.returncode for c in clients):
                            raise RuntimeError(f"PS step probe ({codec}, {k} workers, {shards} shards) failed")
                        got = out.setdefault(cm.canonical(codec), {})
                        got[k] = min(got.get(k, math.inf),
                                     statistics.median(float(o.strip().splitlines()[-1]) for o in outs))
                    finally:
                        for c in clients:
                            if c.poll() is None:
                                c.kill()
                        stop_processes(srvs)
    return out
