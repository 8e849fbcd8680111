"""`deltaps advise`: a measured profile -> predicted step time and cost of each strategy at cluster scale.

    deltaps advise --calibrate --json profile.json --bandwidth 1gbit      # short probes on this host
    deltaps advise --profile profile.json --profile bench.json --gpus 8,64,256 --bandwidth 25gbit \
        --gpu-hour-usd 2.5 --steps 100000 --json advice.json --plot advice.png
    python -m deltaps.tools.advise validate --workers 2,4 --bandwidths 100mbit,1gbit,10gbit --steps 30

The equations are in deltaps/tools/costmodel.py. Every parameter of the model comes from a probe: compute per
step (forward/backward/optimizer of the model timed with 1..k concurrent processes), codec speed
(deltaps.tools.bench_codecs.run_codec_bench on the model's gradient size), server optimizer and reduction
speed, gRPC per-call and per-byte cost (a real `deltaps server` on loopback), achieved bandwidth with
1..k concurrent streams and per-message latency (socket probes across the shaped namespace network,
deltaps/tools/netns.py, where root/iproute2 allow; otherwise the nominal rate is used and the profile says so).
Accuracy deltas and measured compression ratios come from `deltaps bench compare` reports.
"""
from __future__ import annotations

import importlib

# name -> the module that holds it (relative to this package), imported on first use (PEP 562): `deltaps`'s parser
# reads add_arguments on every command, and the probes and the cost model import torch, which the rollback switch
# (`deltaps ctl`) need not
_HOMES = {
    "COMM_SHARE_THRESHOLD": ".advice", "advise": ".advice", "recommend": ".advice",
    "DEFAULT_STRATEGIES": "..cost_inputs", "auto_chunk_bytes": ".calibration", "calibrate": ".calibration",
    "calibration_for": ".calibration", "job_for": ".calibration", "merge_profiles": ".calibration",
    "add_arguments": ".cli", "main": ".cli", "main_args": ".cli",
    "probe_allreduce": ".netprobes", "probe_host_network": ".netprobes", "probe_network": ".netprobes",
    "probe_ps_host": ".netprobes",
    "probe_codecs": ".probes", "probe_compute": ".probes", "probe_cpu_kernels": ".probes", "probe_grpc": ".probes",
    "ps_cycle_time": ".probes",
    "format_report": ".report", "plot": ".report",
    "predict_cell": ".validation", "validate": ".validation",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
