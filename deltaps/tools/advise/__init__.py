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

from deltaps.tools.advise.advice import COMM_SHARE_THRESHOLD, advise, recommend
from deltaps.tools.advise.calibration import (
    DEFAULT_STRATEGIES,
    auto_chunk_bytes,
    calibrate,
    calibration_for,
    job_for,
    merge_profiles,
)
from deltaps.tools.advise.cli import add_arguments, main, main_args
from deltaps.tools.advise.netprobes import probe_allreduce, probe_host_network, probe_network, probe_ps_host
from deltaps.tools.advise.probes import probe_codecs, probe_compute, probe_cpu_kernels, probe_grpc, ps_cycle_time
from deltaps.tools.advise.report import format_report, plot
from deltaps.tools.advise.validation import predict_cell, validate

__all__ = [
    "COMM_SHARE_THRESHOLD", "DEFAULT_STRATEGIES", "add_arguments", "advise", "auto_chunk_bytes", "calibrate",
    "calibration_for", "format_report", "job_for", "main", "main_args", "merge_profiles", "plot", "predict_cell",
    "probe_allreduce", "probe_codecs", "probe_compute", "probe_cpu_kernels", "probe_grpc", "probe_host_network",
    "probe_network", "probe_ps_host", "ps_cycle_time", "recommend", "validate",
]
