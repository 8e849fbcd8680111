"""Calibration: run every probe into a profile, merge profiles with `bench compare` / `launch` reports,
and turn a profile into the cost model's Calibration and Job."""
from __future__ import annotations

import math
import os
import statistics
import time

from deltaps.strategies import parse_mode_spec, ps_codecs
from deltaps.tools import costmodel as cm
from deltaps.tools.advise.netprobes import probe_allreduce, probe_host_network, probe_network, probe_ps_host
from deltaps.tools.advise.probes import probe_codecs, probe_compute, probe_cpu_kernels, probe_grpc
from deltaps.tools.cost_inputs import DEFAULT_STRATEGIES
from deltaps.units import parse_rate


def calibrate(hidden: int, layers: int, batch_size: int, bandwidths: list[str], concurrency=(1, 2, 4),
              codecs=None, prefix: str = "dpsa", log=print, shards: int = 2) -> dict:
    """Run every probe; returns a profile (JSON-able)."""
    tensors = cm.mlp_tensors(hidden, layers)
    G = 4 * sum(n for _, n in tensors)
    codecs = codecs or ps_codecs(DEFAULT_STRATEGIES)
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
            for spec, m in d["modes"].items():
                if "error" in m:
                    continue
                mode = parse_mode_spec(spec)
                name = str(mode)       # the canonical name advise looks up: allreduce, ps:int8, ps-local8:int8, ...
                if m.get("accuracy_delta_vs_allreduce") is not None:
                    out["accuracy_delta"][name] = m["accuracy_delta_vs_allreduce"]
                if mode.family == "ps":
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
    nets = prof.get("networks", {})
    if bandwidth in nets:
        net = nets[bandwidth]
        bws = {int(k): float(v) for k, v in net["bandwidth_by_streams"].items()}
        alpha = float(net.get("alpha_s", 0.0))
    else:
        nominal = parse_rate(bandwidth or "10gbit") / 8
        eff, alpha = 1.0, 0.0
        if nets:   # protocol efficiency: the best achieved/nominal seen (slower probes are CPU-bound, not the link)
            def eff_of(b):
                got = nets[b]["bandwidth_by_streams"]
                return float(got.get("1", got.get(1))) / (parse_rate(b) / 8)
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

