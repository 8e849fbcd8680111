"""`deltaps advise`: a measured profile -> predicted step time and cost of each strategy at cluster scale.

    deltaps advise --calibrate --json profile.json --bandwidth 1gbit      # short probes on this host
    deltaps advise --profile profile.json --profile bench.json --gpus 8,64,256 --bandwidth 25gbit \
        --gpu-hour-usd 2.5 --steps 100000 --json advice.json --plot advice.png
    python -m deltaps.tools.advise validate --workers 2,4 --bandwidths 100mbit,1gbit,10gbit --steps 30

The equations are in ps/costmodel.py. Every parameter of the model comes from a probe: compute per
step (forward/backward/optimizer of the model timed with 1..k concurrent processes), codec speed
(deltaps.tools.bench_codecs.run_codec_bench on the model's gradient size), server optimizer and reduction
speed, gRPC per-call and per-byte cost (a real `deltaps server` on loopback), achieved bandwidth with
1..k concurrent streams and per-message latency (socket probes across the shaped namespace network,
ps/netns.py, where root/iproute2 allow; otherwise the nominal rate is used and the profile says so).
Accuracy deltas and measured compression ratios come from `deltaps bench compare` reports.
"""
from __future__ import annotations

import argparse
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

DEFAULT_STRATEGIES = ["allreduce", "ps:none", "ps:int8", "ps:topk:ratio=0.01"]
COMM_SHARE_THRESHOLD = 0.30        # the product brief: communication > 30 % of the step -> act on it


# ---- probes ----------------------------------------------------------------------------------------------
_COMPUTE_PROBE = r"""
import json, sys, time
import torch, torch.nn.functional as F
torch.set_num_threads(1)
from worker.workloads.mlp import make_mlp
hidden, layers, batch, steps, start = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
m = make_mlp(64, hidden, layers, 10, 0)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
for _ in range(3):
    F.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
while time.time() < start:
    time.sleep(0.001)
fb, bw, op = [], [], []
for _ in range(steps):
    t0 = time.perf_counter(); loss = F.cross_entropy(m(x), y); opt.zero_grad(); t1 = time.perf_counter()
    loss.backward(); t2 = time.perf_counter(); opt.step(); t3 = time.perf_counter()
    fb.append(t2 - t0); bw.append(t2 - t1); op.append(t3 - t2)
med = lambda a: sorted(a)[len(a) // 2]
print(json.dumps({"fwd_bwd_s": med(fb), "bwd_s": med(bw), "optimizer_s": med(op)}))
"""


def _repo_env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def probe_compute(hidden: int, layers: int, batch: int, concurrency: int, steps: int = 40) -> dict:
    """Forward+backward and local-optimizer time per step with `concurrency` processes doing it at once
    (medians over processes of each process's median)."""
    start = time.time() + 2.0 + 0.3 * concurrency
    procs = [subprocess.Popen([sys.executable, "-c", _COMPUTE_PROBE, str(hidden), str(layers), str(batch), str(steps),
                               str(start)], stdout=subprocess.PIPE, text=True, env=_repo_env())
             for _ in range(concurrency)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError("compute probe failed")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: statistics.median(o[k] for o in outs) for k in outs[0]}


def probe_cpu_kernels(grad_bytes: int, repeats: int = 15) -> dict:
    """Server optimizer (fused Adam, as ps/optimizer.py) and elementwise-sum throughput, bytes/s."""
    import torch

    from deltaps.optimizer_config import OptimizerConfig
    from ps.optimizer import KeyOptimizer
    n = max(1, grad_bytes // 4)
    v, g = torch.zeros(n), torch.randn(n)
    ko = KeyOptimizer(v, OptimizerConfig("adam", lr=1e-3))
    ko.apply(g)
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ko.apply(g)
        t.append(time.perf_counter() - t0)
    apply_s = statistics.median(t)
    a, b = torch.randn(n), torch.randn(n)
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.add_(b)
        t.append(time.perf_counter() - t0)
    return {"apply_Bps": n * 4 / apply_s, "reduce_Bps": n * 4 / statistics.median(t)}


def probe_codecs(grad_bytes: int, specs: list[str], repeats: int = 15) -> dict:
    import torch

    from deltaps.tools.bench_codecs import run_codec_bench
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as the workers run (worker/train.py)
    try:
        res = run_codec_bench(max(4096, grad_bytes), specs, "cpu", repeats)
    finally:
        torch.set_num_threads(threads)
    return {s: {"compress_Bps": r["compress_gbps"] * 1e9, "decompress_Bps": r["decompress_gbps"] * 1e9,
                "ratio": r["compression_ratio"]} for s, r in res["codecs"].items()}


_PS_CYCLE_PROBE = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from deltaps.malloc import tune_malloc
tune_malloc()                      # as `deltaps worker` runs (without it 4 MiB messages page-fault in anew)
from deltaps.optimizer_config import OptimizerConfig
from worker.client import PSClient
addr, codec, numel, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
c = PSClient([addr], 0, 1, sync="bsp", optimizer=OptimizerConfig("sgd", lr=1e-6), timeout_s=60.0, codec=codec)
t = torch.randn(numel) if codec != "none" else torch.zeros(numel)
c.setup([("p", t)])
out = {"p": torch.empty(numel)}
c.pull(["p"], out=out, delta=True)
keys, times = c.by_param["p"], []
for step in range(n + 5):
    t0 = time.perf_counter()
    c.push_pull_keys(0, keys, {"p": t}, step, step + 1, out)   # the training path: one PushPull per step
    times.append(time.perf_counter() - t0)
c.close()
print(json.dumps(statistics.median(times[5:])))
"""


def ps_cycle_time(numel: int, codec: str = "none", n: int = 60) -> float:
    """Median PushPull cycle (push, delta pull) of a worker process with one tensor of numel floats
    against one real `deltaps server` on loopback (world size 1)."""
    from deltaps.tools.launch import _stop, _wait_port
    with tempfile.TemporaryDirectory(prefix="deltaps-advise-rpc-") as tmp:
        pf = os.path.join(tmp, "port")
        srv = subprocess.Popen([sys.executable, "-m", "deltaps", "server", "--host", "127.0.0.1", "--port", "0",
                                "--shard-id", "0", "--num-shards", "1", "--port-file", pf],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_repo_env())
        client = None
        try:
            addr = f"127.0.0.1:{_wait_port(pf, srv)}"
            client = subprocess.Popen([sys.executable, "-c", _PS_CYCLE_PROBE, addr, codec, str(numel), str(n)],
                                      stdout=subprocess.PIPE, text=True, env=_repo_env())
            out = client.communicate(timeout=300)[0]
            if client.returncode:
                raise RuntimeError(f"PushPull cycle probe ({codec}) failed")
            return float(out.strip().splitlines()[-1])
        finally:
            if client and client.poll() is None:
                client.kill()
            _stop([srv])


def probe_grpc(cycles: int = 60, big_bytes: int = 4 << 20, codecs=(), rounds: int = 2) -> dict:
    """Per-call and per-byte cost of the deltaps gRPC path: PushPull cycles of a tiny and of a big
    uncompressed tensor against a real `deltaps server` subprocess on loopback (world size 1, SGD);
    then the big tensor once per codec (pull codec `auto`, delta pulls as in training), whose cycle
    time the model compares with its own sum of codec kernels + gRPC bytes (see calibration_for)."""
    # rounds interleave the configurations and keep each one's fastest median: noise from the rest of
    # the host only ever adds time (the job's own contention is measured by probe_ps_host)
    specs = [cm.canonical(c) for c in codecs]
    configs = [("small", 16, "none", cycles), ("big", big_bytes // 4, "none", cycles)]
    configs += [(c, big_bytes // 4, c, cycles // 2) for c in specs if c != "none"]
    got: dict = {}
    for _ in range(max(1, rounds)):
        for name, numel, codec, n in configs:
            got[name] = min(got.get(name, math.inf), ps_cycle_time(numel, codec, n))
    small, big = got.pop("small"), got.pop("big")
    sgd = probe_cpu_kernels(big_bytes)["reduce_Bps"]      # SGD apply ~ one axpy over the tensor
    per_byte = max(1e-12, big - small - big_bytes / sgd) / (2 * big_bytes)
    return {"rpc_s": small, "grpc_Bps": 1.0 / per_byte, "cycle_small_s": small, "cycle_big_s": big,
            "cycle_bytes": big_bytes, "cycle_codec_s": got}


_PING_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(64)
    if not b: break
    c.sendall(b)
"""
_PING_CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for i in range(int(sys.argv[3])):
    t0 = time.perf_counter(); c.sendall(b"x" * 32); n = 0
    while n < 32: n += len(c.recv(64))
    ts.append(time.perf_counter() - t0)
ts.sort(); print(ts[len(ts) // 2] / 2)
"""


def _spawn_ready(cmd) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise RuntimeError("probe server did not start")
    return p


def probe_network(rate: str, streams=(1, 2, 4), prefix: str = "dpsa", nbytes: int | None = None) -> dict:
    """Achieved per-link bandwidth with k concurrent streams (node i -> i+1 in a ring of k nodes; k=1:
    one stream) and one-way per-message latency, on a namespace network shaped to `rate`."""
    from deltaps.tools import netns
    ok, why = netns.shaping_available()
    nominal = netns.parse_rate(rate) / 8
    if not ok:
        return {"rate": rate, "shaped": False, "note": f"not measured ({why}): nominal rate used",
                "bandwidth_by_streams": {1: nominal}, "alpha_s": 0.0}
    want = nbytes or int(min(64 << 20, max(2 << 20, nominal * 0.5)))
    nodes = max(2, max(streams))
    res = {"rate": rate, "shaped": True, "bandwidth_by_streams": {}, "probe_bytes": want}
    with netns.Topology(nodes, rate=rate, prefix=prefix) as topo:
        time.sleep(0.2)
        sv = _spawn_ready(topo.exec_prefix(1) + [sys.executable, "-c", _PING_SERVER, topo.addr(1), "5301"])
        try:
            out = subprocess.run(topo.exec_prefix(0) + [sys.executable, "-c", _PING_CLIENT, topo.addr(1), "5301", "300"],
                                 capture_output=True, text=True, check=True).stdout
            res["alpha_s"] = float(out.strip())
        finally:
            sv.kill()
            sv.wait()
        for k in streams:
            pairs = [(0, 1)] if k == 1 else [(i, (i + 1) % k) for i in range(k)]
            port = 5400 + 10 * k
            secs = _stream_seconds(topo, pairs, port, want)
            res["bandwidth_by_streams"][k] = statistics.median(want / s for s in secs)
    return res


def _stream_seconds(topo, pairs, port: int, nbytes: int) -> list[float]:
    """Seconds each (src, dst) namespace pair took to move nbytes over one TCP stream, all pairs at once."""
    from deltaps.tools import netns
    sinks = [_spawn_ready(topo.exec_prefix(d) + [sys.executable, "-c", netns._SINK, topo.addr(d), str(port),
                                                 str(nbytes)]) for _, d in pairs]
    try:
        srcs = [subprocess.Popen(topo.exec_prefix(s) + [sys.executable, "-c", netns._SOURCE, topo.addr(d),
                                                        str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
                for s, d in pairs]
        return [float(p.communicate(timeout=300)[0].strip()) for p in srcs]
    finally:
        for p in sinks:
            p.kill()
            p.wait()


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
            secs = _stream_seconds(topo, pairs, port, nbytes)
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


_ALLREDUCE_PROBE = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, addr, port, nbytes, bucket, n = sys.argv[1:8]
rank, world, nbytes, bucket, n = int(rank), int(world), int(nbytes), int(bucket), int(n)
dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
flat = torch.randn(max(1, nbytes // 4))
parts = flat.split(max(1, bucket // 4))     # DDP's buckets, reduced one after another
ts = []
for _ in range(n + 3):
    dist.barrier()
    t0 = time.perf_counter()
    for b in parts:
        dist.all_reduce(b)
    ts.append(time.perf_counter() - t0)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(statistics.median(ts[3:])))
"""


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
                    env = {**_repo_env(), "GLOO_SOCKET_IFNAME": topo.ifname(r) if topo else "lo"}
                    cmd = [sys.executable, "-c", _ALLREDUCE_PROBE, str(r), str(k), addr, port, str(grad_bytes),
                           str(bucket_bytes), str(repeats)]
                    procs_.append(subprocess.Popen((topo.exec_prefix(r) if topo else []) + cmd, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
                outs = [p.communicate(timeout=300)[0] for p in procs_]
                if procs_[0].returncode != 0:
                    raise RuntimeError(f"allreduce probe with {k} processes failed (exit {procs_[0].returncode})")
                out[k] = min(out.get(k, math.inf), float(outs[0].strip()))
    return out


_PS_STEP_PROBE = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from deltaps.malloc import tune_malloc
tune_malloc()
from deltaps.config import TrainConfig
from worker.optimizer import DistributedOptimizer
from worker.trainers.ps import local_optimizer
addrs, rank, world, codec, tensors, n = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), int(sys.argv[6])
torch.manual_seed(rank)
named = [(name, torch.nn.Parameter(torch.zeros(numel))) for name, numel in tensors]
grads = {name: torch.randn(numel) * 1e-3 for name, numel in tensors}
opt = DistributedOptimizer(local_optimizer(TrainConfig(), [p for _, p in named]), named_parameters=named,
                           servers=addrs, rank=rank, world_size=world, sync="bsp", codec=codec)
ts = []
for step in range(n + 5):
    t0 = time.perf_counter()
    for name, p in reversed(named):          # handed over in backward's order, as the hooks do
        p.grad = grads[name]
        opt._start(name, p.grad)
    opt.step()
    ts.append(time.perf_counter() - t0)
opt.close()
print(json.dumps(statistics.median(ts[5:])))
"""


def probe_ps_host(tensors, codecs, procs=(2, 4), shards: int = 2, prefix: str = "dpsa", steps: int = 30,
                  rounds: int = 2) -> dict:
    """{codec: {k: s}}: the training step's PS path alone (DistributedOptimizer: bucketed PushPulls,
    codec kernels, BSP wait, loading the pulled values; no forward/backward) of k worker processes with
    the model's tensors against `shards` real `deltaps server`s, all on this host over unshaped
    namespace links (loopback without namespaces): the PS counterpart of probe_allreduce, the floor
    a shaped link cannot go below when every process shares these cores. Rounds interleave the
    codecs and keep each one's fastest."""
    from deltaps.tools.launch import _stop, _wait_port
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
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_repo_env()) for i in range(shards)]
                    clients = []
                    try:
                        addrs = ",".join(f"{host[i]}:{_wait_port(os.path.join(tmp, f'p{i}'), s)}"
                                         for i, s in enumerate(srvs))
                        clients = [subprocess.Popen(run[shards + r] + [
                                       sys.executable, "-c", _PS_STEP_PROBE, addrs, str(r), str(k), codec, spec,
                                       str(steps)],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_repo_env())
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
                        _stop(srvs)
    return out


def calibrate(hidden: int, layers: int, batch_size: int, bandwidths: list[str], concurrency=(1, 2, 4),
              codecs=None, prefix: str = "dpsa", log=print, shards: int = 2) -> dict:
    """Run every probe; returns a profile (JSON-able)."""
    tensors = cm.mlp_tensors(hidden, layers)
    G = 4 * sum(n for _, n in tensors)
    codecs = codecs or [s.split(":", 1)[1] for s in DEFAULT_STRATEGIES if s.startswith("ps:")]
    specs = sorted({cm.canonical(c) for c in codecs} | {cm.pull_codec_for(c) for c in codecs})
    specs_push = sorted({cm.canonical(c) for c in codecs})
    t0 = time.perf_counter()
    prof = {"kind": "deltaps-advise-profile", "host_cores": os.cpu_count(),
            "model": {"hidden": hidden, "layers": layers, "batch_size": batch_size, "tensors": tensors,
                      "params": G // 4, "grad_bytes": G},
            "compute": {}, "networks": {}, "accuracy_delta": {}, "measured_compression_ratio": {}}
    for k in concurrency:
        log(f"advise calibrate: compute, {k} concurrent process(es) ...")
        prof["compute"][str(k)] = probe_compute(hidden, layers, batch_size, k)
    log("advise calibrate: codecs, server optimizer, reduction ...")
    prof["codecs"] = probe_codecs(G, specs)
    prof["cpu"] = probe_cpu_kernels(G)
    log("advise calibrate: gRPC per-call / per-byte cost ...")
    prof["grpc"] = probe_grpc(codecs=codecs)
    for bw in bandwidths:
        log(f"advise calibrate: network {bw} ...")
        prof["networks"][bw] = probe_network(bw, streams=tuple(sorted(set([1] + list(concurrency)))), prefix=prefix)
    log("advise calibrate: host veth throughput (unshaped) ...")
    prof["host_network_Bps"] = probe_host_network(tuple(sorted(set([1] + list(concurrency)))), prefix=prefix)
    floor_procs = tuple(sorted(set([2] + list(concurrency))))
    log("advise calibrate: gloo allreduce on this host (unshaped) ...")
    prof["allreduce_host_s"] = probe_allreduce(G, floor_procs, prefix=prefix)
    log(f"advise calibrate: PS step path, {shards} shards, on this host (unshaped) ...")
    prof["ps_host_s"] = probe_ps_host(tensors, specs_push, floor_procs, shards, prefix=prefix)
    prof["ps_host_shards"] = shards
    prof["calibrate_s"] = time.perf_counter() - t0
    prof["loadavg"] = os.getloadavg()[0]
    return prof


# ---- profiles --------------------------------------------------------------------------------------------
def merge_profiles(docs: list[dict]) -> dict:
    """Merge calibration profiles and `bench compare` / `launch` reports (later ones win per field)."""
    out = {"kind": "deltaps-advise-profile", "compute": {}, "networks": {}, "accuracy_delta": {},
           "measured_compression_ratio": {}, "codecs": {}, "sources": []}
    for d in docs:
        if d.get("kind") == "deltaps-advise-profile":
            for key in ("compute", "networks", "accuracy_delta", "measured_compression_ratio", "codecs"):
                out[key].update(d.get(key, {}))
            for key in ("model", "cpu", "grpc", "host_cores", "host_network_Bps", "allreduce_host_s", "ps_host_s",
                        "ps_host_shards"):
                if key in d:
                    out[key] = d[key]
            out["sources"].append("calibration")
        elif "modes" in d:      # deltaps bench compare report
            out["sources"].append("bench compare")
            out.setdefault("model", {"hidden": d["hidden"], "layers": d["layers"], "batch_size": d["batch_size"],
                                     "tensors": cm.mlp_tensors(d["hidden"], d["layers"]),
                                     "params": d["model_params"], "grad_bytes": 4 * d["model_params"]})
            out.setdefault("host_cores", d.get("host_cores"))
            for _spec, m in d["modes"].items():
                if "error" in m:
                    continue
                name = "allreduce" if m["mode"] == "allreduce" else f"ps:{m['codec']}"
                if m.get("accuracy_delta_vs_allreduce") is not None:
                    out["accuracy_delta"][name] = m["accuracy_delta_vs_allreduce"]
                if m["mode"] == "ps":
                    out["measured_compression_ratio"][name] = m.get("compression_ratio")
            ar = d["modes"].get("allreduce", {})
            if "compute_s_per_step" in ar and not out["compute"]:   # fallback: measured under the run's contention
                out["compute"][str(d["workers"])] = {"fwd_bwd_s": ar["compute_s_per_step"], "bwd_s": 0.0,
                                                     "optimizer_s": 0.0}
            if d.get("network", {}).get("measured_link_gbit_s") and d["bandwidth"] not in out["networks"]:
                out["networks"][d["bandwidth"]] = {"rate": d["bandwidth"], "shaped": True, "alpha_s": 0.0,
                                                   "bandwidth_by_streams": {
                                                       1: d["network"]["measured_link_gbit_s"] * 1e9 / 8}}
        elif "compute_s" in d and "model_params" in d:     # deltaps launch summary
            out["sources"].append("launch")
            out.setdefault("model", {"params": d["model_params"], "grad_bytes": 4 * d["model_params"],
                                     "batch_size": d["batch_size"], "tensors": [("params", d["model_params"])]})
            if not out["compute"]:
                out["compute"][str(d["workers"])] = {"fwd_bwd_s": d["compute_s"] / max(1, d["steps"]),
                                                     "bwd_s": 0.0, "optimizer_s": 0.0}
        else:
            raise ValueError("unrecognised profile: want `deltaps advise --calibrate`, `bench compare` or `launch` JSON")
    if "model" not in out:
        raise ValueError("no model description in the profiles")
    return out


def calibration_for(prof: dict, bandwidth: str | None, cores: int | None = None) -> cm.Calibration:
    """A cm.Calibration for one link speed. A bandwidth that was probed uses its measurements; any other
    uses the nominal rate x the best achieved/nominal ratio among the probed ones (1 if none)."""
    from deltaps.tools import netns
    nets = prof.get("networks", {})
    if bandwidth in nets:
        net = nets[bandwidth]
        bws = {int(k): float(v) for k, v in net["bandwidth_by_streams"].items()}
        alpha = float(net.get("alpha_s", 0.0))
    else:
        nominal = netns.parse_rate(bandwidth or "10gbit") / 8
        eff, alpha = 1.0, 0.0
        if nets:   # protocol efficiency: the best achieved/nominal seen (slower probes are CPU-bound, not the link)
            def eff_of(b):
                got = nets[b]["bandwidth_by_streams"]
                return float(got.get("1", got.get(1))) / (netns.parse_rate(b) / 8)
            eff = max(eff_of(b) for b in nets)
            alpha = min(float(n.get("alpha_s", 0.0)) for n in nets.values())
        bws = {1: nominal * min(1.0, eff)}
    comp = prof.get("compute", {})
    cpu, grpc = prof.get("cpu", {}), prof.get("grpc", {})
    codecs = {k: cm.CodecSpeed.from_dict(v) for k, v in prof.get("codecs", {}).items()}
    # the PS software path per codec beyond its kernels and gRPC bytes (measured cycle minus what the
    # model explains for one worker, one shard): per raw byte, shared half/half by worker and shard
    for spec, cyc in grpc.get("cycle_codec_s", {}).items():
        if spec not in codecs:
            continue
        nb = float(grpc["cycle_bytes"])
        push, pull = codecs[spec], codecs.get(cm.pull_codec_for(spec), cm.IDENTITY)
        wire = nb / push.ratio + nb / pull.ratio
        explained = (grpc["cycle_small_s"] + wire / float(grpc["grpc_Bps"]) + nb / push.compress_Bps
                     + nb / push.decompress_Bps + nb / pull.compress_Bps + nb / pull.decompress_Bps
                     + nb / float(cpu.get("reduce_Bps", math.inf)))
        codecs[spec].path_s_per_byte = max(0.0, float(cyc) - explained) / nb
    bwd = [c["bwd_s"] / c["fwd_bwd_s"] for c in comp.values() if c.get("bwd_s") and c["fwd_bwd_s"] > 0]
    return cm.Calibration(
        bandwidth_Bps=bws[min(bws)], alpha_s=alpha, rpc_s=float(grpc.get("rpc_s", 0.0)),
        grpc_Bps=float(grpc.get("grpc_Bps", math.inf)),
        fwd_bwd_s={int(k): c["fwd_bwd_s"] for k, c in comp.items()},
        bwd_fraction=statistics.median(bwd) if bwd else 0.0,
        optimizer_s={int(k): c.get("optimizer_s", 0.0) for k, c in comp.items()},
        apply_Bps=float(cpu.get("apply_Bps", math.inf)), reduce_Bps=float(cpu.get("reduce_Bps", math.inf)),
        codecs=codecs,
        cores=cores or prof.get("host_cores"), bandwidth_by_streams={1: bws[min(bws)]},
        host_network_Bps={int(k): float(v) for k, v in prof.get("host_network_Bps", {}).items()},
        allreduce_host_s={int(k): float(v) for k, v in prof.get("allreduce_host_s", {}).items()},
        ps_host_s={cm.canonical(c): {int(k): float(v) for k, v in t.items()}
                   for c, t in prof.get("ps_host_s", {}).items()},
        ps_host_shards=int(prof.get("ps_host_shards", 0)),
        host_probe_bytes=float(prof.get("model", {}).get("grad_bytes", 0.0)))


def auto_chunk_bytes(grad_bytes: int, shards: int) -> int:
    """Key size that lets the partition spread the model over the shards: about 4 keys per shard,
    between 64 KiB and deltaps' default 4 MiB (`--chunk-bytes`)."""
    return int(min(4 << 20, max(64 << 10, grad_bytes // (4 * max(1, shards)))))


def job_for(prof: dict, workers: int, shards: int, host_cores: int | None = None,
            chunk_bytes: int = 4 << 20) -> cm.Job:
    return cm.Job(tensors=[tuple(t) for t in prof["model"]["tensors"]], workers=workers, shards=shards,
                  host_cores=host_cores, chunk_bytes=chunk_bytes)


# ---- advice ----------------------------------------------------------------------------------------------
def _acc_risk(prof: dict, strategy: str, max_drop: float) -> tuple[str, float | None]:
    if strategy in ("allreduce", "ps:none"):
        return "none (exact)", 0.0
    d = prof.get("accuracy_delta", {}).get(strategy)
    if d is None:
        return "unmeasured", None
    if d >= -max_drop:
        return f"low ({d * 100:+.2f} pp measured)", d
    return f"HIGH ({d * 100:+.2f} pp measured)", d


def advise(prof: dict, gpus: list[int], bandwidth: str, strategies: list[str], steps: int, gpu_hour_usd: float,
           egress_usd_per_gb: float = 0.0, shards: int | None = None, max_acc_drop: float = 0.01,
           engineer_usd: float = 10000.0, chunk_bytes: int | None = None) -> dict:
    batch = prof["model"].get("batch_size", 32)
    cal = calibration_for(prof, bandwidth)
    rows = []
    for g in gpus:
        n = shards or max(1, g)
        G = prof["model"]["grad_bytes"]
        # PS key size: --chunk-bytes, else the best predicted of deltaps' default 4 MiB and smaller keys
        # that spread a big tensor over more shards (fewer hot links, more RPCs)
        chunks = [chunk_bytes] if chunk_bytes else sorted({4 << 20, 1 << 20, 256 << 10, auto_chunk_bytes(G, n)})
        job = job_for(prof, g, n, chunk_bytes=chunks[-1])
        preds = {}
        for s in strategies:
            try:
                if s.startswith("ps"):
                    p = min((dict(cm.predict(cal, job_for(prof, g, n, chunk_bytes=c), s), chunk_bytes=c)
                             for c in chunks), key=lambda x: x["step_s"])
                else:
                    p = cm.predict(cal, job, s)
            except KeyError as e:
                preds[s] = {"strategy": s, "error": str(e)}
                continue
            egress = p["bytes_sent_per_worker"] * g * steps
            p.update(cm.training_cost(p["step_s"], steps, g, gpu_hour_usd, egress, egress_usd_per_gb))
            p["comm_share"] = p["comm_s"] / p["step_s"] if p["step_s"] else 0.0
            p["samples_per_s"] = g * batch / p["step_s"] if p["step_s"] else 0.0
            p["accuracy_risk"], p["accuracy_delta"] = _acc_risk(prof, s, max_acc_drop)
            preds[s] = p
        rec = recommend(preds, max_acc_drop, engineer_usd, bandwidth, g, prof)
        rows.append({"gpus": g, "shards": job.shards, "predictions": preds, **rec})
    return {"bandwidth": bandwidth, "steps": steps, "gpu_hour_usd": gpu_hour_usd,
            "egress_usd_per_gb": egress_usd_per_gb, "batch_size_per_gpu": batch, "model": prof["model"],
            "calibration": cal.to_dict(), "strategies": strategies, "rows": rows}


def recommend(preds: dict, max_acc_drop: float, engineer_usd: float, bandwidth: str, gpus: int,
              prof: dict) -> dict:
    ok = {s: p for s, p in preds.items() if "error" not in p}
    base = ok.get("allreduce") or next(iter(ok.values()))
    safe = {s: p for s, p in ok.items() if p["accuracy_delta"] is None or p["accuracy_delta"] >= -max_acc_drop}
    best_s = min(safe, key=lambda s: safe[s]["step_s"])
    best = safe[best_s]
    fastest_s = min(ok, key=lambda s: ok[s]["step_s"])
    reasons = []
    share = base["comm_share"]
    params = prof["model"]["params"]
    reasons.append(f"at {gpus} GPUs on {bandwidth} links, {base['strategy']} spends {share:.0%} of its "
                   f"{base['step_s'] * 1e3:.1f} ms step communicating ({params / 1e6:.2f}M parameters)")
    saved = base["cost_usd"] - best["cost_usd"]
    speedup = base["step_s"] / best["step_s"] if best["step_s"] else 1.0
    compress = best_s.startswith("ps:") and best_s != "ps:none"
    if share <= COMM_SHARE_THRESHOLD and not (compress and speedup > 1.05):
        decision = "pure data parallel"
        reasons.append(f"communication is below the {COMM_SHARE_THRESHOLD:.0%} threshold: compression cannot win "
                       "much and its codec/RPC overhead costs more than the bytes it saves")
    elif compress:
        decision = "sparsification" if best_s.split(":")[1].startswith(("topk", "randk", "dgc")) else "gradient quantization"
    elif best_s == "allreduce" or best_s == "ps:none":
        decision = "pure data parallel"
    else:
        decision = "pure data parallel"
    if compress and speedup > 1.05 and saved > engineer_usd:
        rec = best_s
        moved = best["bytes_sent_per_worker"] + best.get("bytes_pulled_per_worker", 0.0)
        ar_moved = 2 * base["bytes_sent_per_worker"] if base["strategy"] == "allreduce" else (
            base["bytes_sent_per_worker"] + base.get("bytes_pulled_per_worker", 0.0))
        reasons.append(f"{best_s} moves {moved / 2**20:.2f} MiB per worker per step (push + pull) instead of "
                       f"{ar_moved / 2**20:.2f} MiB and is predicted at {best['step_s'] * 1e3:.1f} ms/step "
                       f"(x{speedup:.2f} vs {base['strategy']}): {best['train_hours']:.1f} h instead of "
                       f"{base['train_hours']:.1f} h, saving ${saved:,.0f} minus ${engineer_usd:,.0f} of engineering "
                       f"= ${saved - engineer_usd:,.0f}; accuracy risk {best['accuracy_risk']}")
    elif compress and speedup > 1.05:
        rec = base["strategy"]
        decision = "pure data parallel"
        reasons.append(f"{best_s} would be x{speedup:.2f} faster but saves only ${saved:,.0f}, less than the "
                       f"${engineer_usd:,.0f} engineering cost of adopting it: keep {base['strategy']}")
    else:
        rec = base["strategy"] if best["step_s"] >= base["step_s"] * 0.95 else best_s
        over = [s for s in ok if s.startswith("ps:") and s != "ps:none"]
        if over:
            s2 = min(over, key=lambda s: ok[s]["step_s"])
            reasons.append(f"compression overhead exceeds its savings: the best codec ({s2}) is predicted at "
                           f"{ok[s2]['step_s'] * 1e3:.1f} ms/step vs {base['step_s'] * 1e3:.1f} ms for {base['strategy']} "
                           f"(codec + RPC CPU {ok[s2]['cpu_comm_s'] * 1e3:.1f} ms against "
                           f"{base['network_s'] * 1e3:.1f} ms of transfer) -> plain {rec}")
    if fastest_s != best_s:
        reasons.append(f"{fastest_s} would be fastest ({ok[fastest_s]['step_s'] * 1e3:.1f} ms) but its accuracy "
                       f"risk is {ok[fastest_s]['accuracy_risk']} (limit {max_acc_drop * 100:.1f} pp): not recommended")
    if best["comm_share"] > COMM_SHARE_THRESHOLD and (rec == best_s):
        reasons.append(f"communication still dominates even with {rec} ({best['comm_share']:.0%} of the step): the "
                       "next levers are hybrid (tensor/pipeline) parallelism or a larger batch per GPU")
        if rec == base["strategy"]:
            decision = "hybrid parallel"
    return {"recommendation": rec, "decision": decision, "reasons": reasons,
            "best_safe": best_s, "speedup_vs_allreduce": speedup, "saved_usd": saved}


def _fmt_usd(x: float) -> str:
    return f"${x:,.0f}"


def format_report(rep: dict) -> str:
    m = rep["model"]
    lines = [f"deltaps advise: {m['params']:,} params ({m['grad_bytes'] / 2**20:.1f} MiB fp32 gradient), batch "
             f"{rep['batch_size_per_gpu']}/GPU, {rep['bandwidth']} links (achieved "
             f"{rep['calibration']['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s), {rep['steps']:,} steps, "
             f"${rep['gpu_hour_usd']}/GPU-hour" + (f", egress ${rep['egress_usd_per_gb']}/GB" if rep['egress_usd_per_gb'] else "")]
    for row in rep["rows"]:
        lines.append("")
        lines.append(f"== {row['gpus']} GPUs (ps:*: {row['shards']} PS shards; key size = best predicted --chunk-bytes)")
        cols = ["strategy", "step", "comm share", "samples/s", "train time", "cost", "accuracy risk"]
        body = []
        for s, p in row["predictions"].items():
            if "error" in p:
                body.append([s, "n/a: " + p["error"][:50], "", "", "", "", ""])
                continue
            t = p["train_hours"]
            body.append([s + (f" (--chunk-bytes {p['chunk_bytes']})" if "chunk_bytes" in p else ""),
                         f"{p['step_s'] * 1e3:.1f} ms", f"{p['comm_share']:.0%}", f"{p['samples_per_s']:,.0f}",
                         f"{t / 24:.1f} d" if t >= 48 else f"{t:.1f} h", _fmt_usd(p["cost_usd"]), p["accuracy_risk"]])
        lines += _table(cols, body)
        lines.append("")
        lines += _decision_table(row)
        lines.append(f"RECOMMENDATION: {row['recommendation']}   [decision table row: {row['decision']}]")
        for r in row["reasons"]:
            lines.append(f"  - {r}")
    return "\n".join(lines)


def _decision_table(row: dict) -> list[str]:
    """The product brief's decision table, filled in with this job's numbers."""
    P = row["predictions"]
    ar = P.get("allreduce", {})

    def cell(names):
        got = [(s, P[s]) for s in P if "error" not in P[s] and any(s.startswith(n) for n in names)]
        if not got:
            return "not evaluated"
        s, p = min(got, key=lambda x: x[1]["step_s"])
        return f"{s}: {p['step_s'] * 1e3:.1f} ms, comm {p['comm_share']:.0%}, {_fmt_usd(p['cost_usd'])}, risk {p['accuracy_risk']}"
    share = ar.get("comm_share")
    rows = [["pure data parallel", "comm share <= 30 %", f"allreduce comm share {share:.0%}" if share is not None else "",
             cell(["allreduce", "ps:none"])],
            ["gradient quantization", "comm share > 30 %, accuracy-neutral", "", cell(["ps:int8", "ps:fp16", "ps:bf16", "ps:qsgd"])],
            ["sparsification", "comm share > 30 % after quantization; accuracy delta acceptable", "",
             cell(["ps:topk", "ps:randk", "ps:dgc", "ps:sign"])],
            ["hybrid parallel", "comm share still > 30 % with the best codec", "", "outside deltaps (tensor/pipeline parallel)"]]
    for r in rows:
        r[2] = "; ".join(x for x in ("<- chosen" if r[0] == row["decision"] else "", r[2]) if x)
    return _table(["option", "when (brief)", "this job", "prediction"], rows)


def _table(cols, rows) -> list[str]:
    w = [max(len(str(r[i])) for r in [cols] + rows) for i in range(len(cols))]
    line = lambda r: "| " + " | ".join(str(c).ljust(x) for c, x in zip(r, w)) + " |"  # noqa: E731
    return [line(cols), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows]


def plot(rep: dict, path: str, more_gpus: list[int] | None = None, prof: dict | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = [r["gpus"] for r in rep["rows"]]
    for s in rep["strategies"]:
        ys = [(g, r["predictions"][s]["step_s"] * 1e3) for g, r in zip(gpus, rep["rows"])
              if "error" not in r["predictions"][s]]
        if ys:
            ax.plot([a for a, _ in ys], [b for _, b in ys], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (workers)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"deltaps advise: {rep['model']['params'] / 1e6:.2f}M params, {rep['bandwidth']} links", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- validation against `deltaps bench compare` ------------------------------------------------------------
def predict_cell(prof: dict, bandwidth: str, workers: int, shards: int, strategy: str) -> dict:
    cores = prof.get("host_cores") or os.cpu_count()
    cal = calibration_for(prof, bandwidth, cores)
    return cm.predict(cal, job_for(prof, workers, shards, host_cores=cores), strategy)


def validate(args) -> int:
    """For every (link, workers) cell: calibrate (probes, right before, so both see the same host load),
    then run `bench compare`; print predicted vs measured median step for every mode. Reports and
    profiles already in --dir are reused (delete them to re-measure)."""
    from deltaps.tools import bench_compare as bc
    workers = [int(w) for w in args.workers.split(",")]
    bws = [b.strip() for b in args.bandwidths.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    codecs = [m.split(":", 1)[1] for m in modes if m.startswith("ps:")]
    os.makedirs(args.dir, exist_ok=True)
    fixed = [json.load(open(p)) for p in (args.profile or [])]
    rows, worst = [], 0.0
    for bw in bws:
        for w in workers:
            path = os.path.join(args.dir, f"w{w}_{bw}.json")
            ppath = os.path.join(args.dir, f"w{w}_{bw}.profile.json")
            if not fixed and not os.path.exists(ppath):
                print(f"-- calibrating for {w} workers on {bw} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                prof = calibrate(args.hidden, args.layers, args.batch_size, [bw], concurrency=sorted({1, w}),
                                 codecs=codecs, prefix=args.netns_prefix + "c", log=lambda *_: None,
                                 shards=args.servers)
                prof["loadavg"] = os.getloadavg()[0]
                with open(ppath, "w") as f:
                    json.dump(prof, f, indent=2)
            if not os.path.exists(path):
                print(f"-- measuring: bench compare --workers {w} --bandwidth {bw} --steps {args.steps} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
                bc.main(["--workers", str(w), "--servers", str(args.servers), "--bandwidth", bw, "--hidden",
                         str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps),
                         "--batch-size", str(args.batch_size), "--modes", ",".join(modes), "--json", path,
                         "--netns-prefix", args.netns_prefix])
            prof = merge_profiles(fixed or [json.load(open(ppath))])
            rep = json.load(open(path))
            for spec in modes:
                m = rep["modes"].get(spec, {})
                if "error" in m or not m:
                    rows.append([str(w), bw, spec, "", "FAILED", "", ""])
                    continue
                p = predict_cell(prof, bw, w, rep["servers"], spec)
                meas = m["median_step_s"]
                err = p["step_s"] / meas - 1
                worst = max(worst, abs(err))
                rows.append([str(w), bw, spec, f"{p['step_s'] * 1e3:.1f}", f"{meas * 1e3:.1f}", f"{err:+.0%}",
                             f"{p['comm_s'] / p['step_s']:.0%}", f"{m['comm_share'] + m['wait_share']:.0%}"])
    print()
    print("\n".join(_table(["workers", "link", "mode", "predicted ms", "measured ms", "error", "pred. comm",
                            "meas. comm+wait"], rows)))
    print(f"worst |error| = {worst:.0%} (limit {args.tolerance:.0%}); {len(rows)} cells, "
          f"{args.steps} steps x batch {args.batch_size}, MLP 64-{args.hidden}x{args.layers}-10, "
          f"{args.servers} shards, {os.cpu_count()} cores shared by all processes")
    return 0 if worst <= args.tolerance else 1


# ---- CLI -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="append", default=[],
                   help="profile JSON (advise --calibrate, bench compare or launch); repeat to merge")
    p.add_argument("--calibrate", action="store_true", help="run the probes on this host and write a profile (--json)")
    p.add_argument("--gpus", default="8,64,256", help="comma-separated cluster sizes (workers) to predict")
    p.add_argument("--bandwidth", default=None,
                   help="link rate per worker, tc syntax (25gbit); calibrate: comma list of rates to probe")
    p.add_argument("--shards", type=int, default=None,
                   help="PS shards at scale (default: one per GPU); calibrate: shards of the host PS-path probe (2)")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="PS key size at scale (default: the best predicted of 4 MiB, 1 MiB, 256 KiB and about "
                        "4 keys per shard)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="comma-separated strategies: allreduce, ps:<codec spec>")
    p.add_argument("--steps", type=int, default=100000, help="training steps to cost")
    p.add_argument("--gpu-hour-usd", type=float, default=2.5, help="price of one GPU-hour")
    p.add_argument("--egress-usd-per-gb", type=float, default=0.0, help="price of network egress per GB sent")
    p.add_argument("--engineer-usd", type=float, default=10000.0,
                   help="one-off cost of adopting compression (the brief: one engineer, $10k)")
    p.add_argument("--max-acc-drop", type=float, default=1.0, help="accuracy loss accepted, percentage points")
    p.add_argument("--hidden", type=int, default=1024, help="calibrate: MLP hidden width")
    p.add_argument("--layers", type=int, default=2, help="calibrate: MLP hidden layers")
    p.add_argument("--batch-size", type=int, default=32, help="calibrate: batch size per worker")
    p.add_argument("--concurrency", default="1,2,4", help="calibrate: concurrent processes for the compute probe")
    p.add_argument("--json", help="write the profile (--calibrate) or the advice here")
    p.add_argument("--plot", help="write a PNG of predicted step time vs GPUs per strategy")


def _split_strategies(text: str) -> list[str]:
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part and ":" not in part and out:    # 'topk:ratio=0.01,chunk=..' continuation
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def main_args(args) -> int:
    if args.calibrate:
        bws = [b.strip() for b in (args.bandwidth or "1gbit").split(",") if b.strip()]
        codecs = [s.split(":", 1)[1] for s in _split_strategies(args.strategies) if s.startswith("ps:")]
        prof = calibrate(args.hidden, args.layers, args.batch_size, bws,
                         concurrency=[int(k) for k in args.concurrency.split(",")], codecs=codecs,
                         shards=args.shards or 2)
        docs = [json.load(open(p)) for p in args.profile]
        if docs:   # accuracy deltas / measured ratios from bench reports ride along
            m = merge_profiles([prof] + docs)
            prof["accuracy_delta"], prof["measured_compression_ratio"] = m["accuracy_delta"], m["measured_compression_ratio"]
        print(json.dumps({k: v for k, v in prof.items() if k != "model"}, indent=2, default=str))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(prof, f, indent=2)
            print(f"wrote {args.json}")
        return 0
    if not args.profile:
        raise ValueError("advise needs --profile PATH (or --calibrate to make one)")
    prof = merge_profiles([json.load(open(p)) for p in args.profile])
    rep = advise(prof, [int(g) for g in args.gpus.split(",")], args.bandwidth or "10gbit",
                 _split_strategies(args.strategies), args.steps, args.gpu_hour_usd, args.egress_usd_per_gb,
                 args.shards, args.max_acc_drop / 100, args.engineer_usd, args.chunk_bytes)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.plot:   # the curve at every power of two in range as well as at --gpus
        gs = sorted({int(g) for g in args.gpus.split(",")})
        dense = sorted(set(gs) | {1 << i for i in range(1, 20) if gs[0] <= 1 << i <= gs[-1]})
        plot(advise(prof, dense, args.bandwidth or "10gbit", _split_strategies(args.strategies), args.steps,
                    args.gpu_hour_usd, args.egress_usd_per_gb, args.shards, args.max_acc_drop / 100,
                    args.engineer_usd, args.chunk_bytes), args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "validate":
        p = argparse.ArgumentParser(prog="python -m deltaps.tools.advise validate",
                                    description="predicted vs measured step time on the bench compare grid")
        p.add_argument("--workers", default="2,4")
        p.add_argument("--bandwidths", default="100mbit,1gbit,10gbit")
        p.add_argument("--modes", default=",".join(DEFAULT_STRATEGIES))
        p.add_argument("--servers", type=int, default=2)
        p.add_argument("--hidden", type=int, default=1024)
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--batch-size", type=int, default=32)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--dir", default="advise-validate", help="bench compare reports (reused when present)")
        p.add_argument("--profile", action="append", help="use this calibration instead of probing")
        p.add_argument("--tolerance", type=float, default=0.25)
        p.add_argument("--netns-prefix", default="dpsv")
        return validate(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="deltaps advise", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
