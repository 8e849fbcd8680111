"""Probes of this host's compute, codec and CPU kernel speed and of the deltaps gRPC path (a real
`deltaps server` on loopback), each timed in subprocesses shaped like the training processes."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from deltaps.tools import costmodel as cm
from deltaps.tools import torch_probes
from deltaps.tools.children import checkout_env


def probe_compute(hidden: int, layers: int, batch: int, concurrency: int, steps: int = 40) -> dict:
    """Forward+backward and local-optimizer time per step with `concurrency` processes doing it at once
    (medians over processes of each process's median)."""
    start = time.time() + 2.0 + 0.3 * concurrency
    procs = [subprocess.Popen(torch_probes.command("compute", hidden, layers, batch, steps, start),
                              stdout=subprocess.PIPE, text=True, env=checkout_env())
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
    torch.set_num_threads(1)        # as the workers run (worker/trainers/)
    try:
        res = run_codec_bench(max(4096, grad_bytes), specs, "cpu", repeats)
    finally:
        torch.set_num_threads(threads)
    return {s: {"compress_Bps": r["compress_gbps"] * 1e9, "decompress_Bps": r["decompress_gbps"] * 1e9,
                "ratio": r["compression_ratio"]} for s, r in res["codecs"].items()}


def ps_cycle_time(numel: int, codec: str = "none", n: int = 60) -> float:
    """Median PushPull cycle (push, delta pull) of a worker process with one tensor of numel floats
    against one real `deltaps server` on loopback (world size 1)."""
    from deltaps.tools.launch import wait_port_file
    from deltaps.tools.process_tree import stop_processes
    with tempfile.TemporaryDirectory(prefix="deltaps-advise-rpc-") as tmp:
        pf = os.path.join(tmp, "port")
        srv = subprocess.Popen([sys.executable, "-m", "deltaps", "server", "--host", "127.0.0.1", "--port", "0",
                                "--shard-id", "0", "--num-shards", "1", "--port-file", pf],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=checkout_env())
        client = None
        try:
            addr = f"127.0.0.1:{wait_port_file(pf, srv)}"
            client = subprocess.Popen(torch_probes.command("ps-cycle", addr, codec, numel, n),
                                      stdout=subprocess.PIPE, text=True, env=checkout_env())
            out = client.communicate(timeout=300)[0]
            if client.returncode:
                raise RuntimeError(f"PushPull cycle probe ({codec}) failed")
            return float(out.strip().splitlines()[-1])
        finally:
            if client and client.poll() is None:
                client.kill()
            stop_processes([srv])


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
