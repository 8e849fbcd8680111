"""The cost model's inputs (deltaps/tools/costmodel.py): a measured `Calibration` of this host and its links
(deltaps/tools/advise measures one: `deltaps advise --calibrate`), the codecs' measured speeds, the `Job` and the
strategies it predicts. No torch here: `deltaps advise`'s flags are built from this module on every command."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from deltaps.layout import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES, fused_message_bytes

PREDICTED = "allreduce (alias ddp), ps:<codec> (alias ps-bsp:<codec>) or ps-local<H>[x<F>][o<tau>]:<codec>"
DEFAULT_STRATEGIES = ["allreduce", "ps:none", "ps:int8", "ps:topk:ratio=0.01"]    # what `deltaps advise` compares


@dataclass
class CodecSpeed:
    compress_Bps: float           # raw bytes / s
    decompress_Bps: float
    ratio: float                  # raw / wire bytes
    path_s_per_byte: float = 0.0  # PS push+pull path cost beyond the kernels (measured cycle), s per raw byte

    @classmethod
    def from_dict(cls, d: dict) -> "CodecSpeed":
        return cls(float(d["compress_Bps"]), float(d["decompress_Bps"]), float(d["ratio"]),
                   float(d.get("path_s_per_byte", 0.0)))


IDENTITY = CodecSpeed(math.inf, math.inf, 1.0)


@dataclass
class Calibration:
    bandwidth_Bps: float                       # achieved per link, per direction
    alpha_s: float = 0.0                       # per-message one-way latency
    rpc_s: float = 0.0                         # fixed cost of one gRPC call (client + server)
    grpc_Bps: float = math.inf                 # per-byte cost of the gRPC path (serialise, copy)
    fwd_bwd_s: dict = field(default_factory=dict)    # {concurrent processes: s per step}
    bwd_fraction: float = 0.6                  # measured share of backward in fwd_bwd
    optimizer_s: dict = field(default_factory=dict)  # {concurrent processes: local optimizer step s}
    apply_Bps: float = math.inf                # server optimizer throughput (parameter bytes / s)
    reduce_Bps: float = math.inf               # elementwise sum (allreduce reduction)
    codecs: dict = field(default_factory=dict)       # spec -> CodecSpeed
    cores: int | None = None                   # cores of the calibrating host
    bandwidth_by_streams: dict = field(default_factory=dict)  # {concurrent streams: achieved B}
    host_network_Bps: dict = field(default_factory=dict)      # {streams: bytes/s all unshaped veths move}
    # host floors, measured with a gradient of host_probe_bytes over unshaped links of this host:
    allreduce_host_s: dict = field(default_factory=dict)      # {processes: s of one gloo allreduce}
    ps_host_s: dict = field(default_factory=dict)             # {codec: {workers: s of the PS step path
    ps_host_shards: int = 0                                   #  against this many shards}}
    host_probe_bytes: float = 0.0

    def compute(self, k: int, table: dict | None = None) -> float:
        """Per-step time of a CPU phase with k processes doing it at once (measured; interpolated
        linearly in k between measured points, extrapolated with max(1, k/cores) past them)."""
        table = self.fwd_bwd_s if table is None else table
        if not table:
            return 0.0
        pts = sorted((int(a), float(b)) for a, b in table.items())
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, t0), (k1, t1) in zip(pts, pts[1:]):
            if k0 <= k <= k1:
                return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        kmax, tmax = pts[-1]
        c = self.cores or kmax
        return tmax * max(1.0, k / c) / max(1.0, kmax / c)

    def stretch(self, m: int) -> float:
        """Measured slowdown of a CPU phase with m processes busy at once vs one alone (the compute
        probe's t(m) / t(1)); max(1, m / cores) when only one point was measured."""
        if 1 in self.fwd_bwd_s and len(self.fwd_bwd_s) > 1 and self.fwd_bwd_s[1] > 0:
            return max(1.0, self.compute(m) / self.fwd_bwd_s[1])
        return max(1.0, m / self.cores) if self.cores else 1.0

    def effective_cores(self) -> float:
        """Cores this job's processes actually get (other load included): k / stretch(k), largest k probed."""
        k = max(self.fwd_bwd_s) if self.fwd_bwd_s else (self.cores or 1)
        return max(1e-3, min(float(self.cores or k), k / self.stretch(k)))

    def host_network(self, streams: int) -> float:
        """Bytes/s all links of one host move together with this many concurrent streams (veth copies
        cost CPU), measured on unshaped links; inf when not measured."""
        if not self.host_network_Bps:
            return math.inf
        pts = sorted(self.host_network_Bps.items())
        return next((v for k, v in reversed(pts) if k <= streams), pts[0][1])

    def bandwidth(self, streams: int = 1) -> float:
        """Achieved per-link bandwidth with this many concurrent streams (measured where available)."""
        if not self.bandwidth_by_streams:
            return self.bandwidth_Bps
        pts = sorted((int(a), float(b)) for a, b in self.bandwidth_by_streams.items())
        best = pts[0][1]
        for k, b in pts:
            if k <= streams:
                best = b
        return best

    def codec(self, spec: str) -> CodecSpeed:
        spec = canonical(spec)
        if spec == "none":        # raw tensors: no codec kernels (their copies are in the gRPC per-byte cost)
            return IDENTITY
        if spec not in self.codecs:
            raise KeyError(f"codec {spec!r} was not calibrated (have: {', '.join(sorted(self.codecs))})")
        c = self.codecs[spec]
        return c if isinstance(c, CodecSpeed) else CodecSpeed.from_dict(c)

    def to_dict(self) -> dict:
        return {"bandwidth_Bps": self.bandwidth_Bps, "alpha_s": self.alpha_s, "rpc_s": self.rpc_s,
                "grpc_Bps": self.grpc_Bps, "fwd_bwd_s": {str(k): v for k, v in self.fwd_bwd_s.items()},
                "bwd_fraction": self.bwd_fraction,
                "optimizer_s": {str(k): v for k, v in self.optimizer_s.items()}, "apply_Bps": self.apply_Bps,
                "reduce_Bps": self.reduce_Bps, "cores": self.cores,
                "bandwidth_by_streams": {str(k): v for k, v in self.bandwidth_by_streams.items()},
                "host_network_Bps": {str(k): v for k, v in self.host_network_Bps.items()},
                "allreduce_host_s": {str(k): v for k, v in self.allreduce_host_s.items()},
                "ps_host_s": {c: {str(k): v for k, v in t.items()} for c, t in self.ps_host_s.items()},
                "ps_host_shards": self.ps_host_shards, "host_probe_bytes": self.host_probe_bytes,
                "codecs": {k: (vars(v) if isinstance(v, CodecSpeed) else v) for k, v in self.codecs.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(bandwidth_Bps=float(d["bandwidth_Bps"]), alpha_s=float(d.get("alpha_s", 0.0)),
                   rpc_s=float(d.get("rpc_s", 0.0)), grpc_Bps=float(d.get("grpc_Bps", math.inf)),
                   fwd_bwd_s={int(k): float(v) for k, v in d.get("fwd_bwd_s", {}).items()},
                   bwd_fraction=float(d.get("bwd_fraction", 0.6)),
                   optimizer_s={int(k): float(v) for k, v in d.get("optimizer_s", {}).items()},
                   apply_Bps=float(d.get("apply_Bps", math.inf)), reduce_Bps=float(d.get("reduce_Bps", math.inf)),
                   cores=d.get("cores"),
                   bandwidth_by_streams={int(k): float(v) for k, v in d.get("bandwidth_by_streams", {}).items()},
                   host_network_Bps={int(k): float(v) for k, v in d.get("host_network_Bps", {}).items()},
                   allreduce_host_s={int(k): float(v) for k, v in d.get("allreduce_host_s", {}).items()},
                   ps_host_s={c: {int(k): float(v) for k, v in t.items()} for c, t in d.get("ps_host_s", {}).items()},
                   ps_host_shards=int(d.get("ps_host_shards", 0)),
                   host_probe_bytes=float(d.get("host_probe_bytes", 0.0)),
                   codecs={k: CodecSpeed.from_dict(v) for k, v in d.get("codecs", {}).items()})


@dataclass
class Job:
    tensors: list                 # [(name, numel)] in model order (backward produces them in reverse)
    workers: int
    shards: int = 2
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    bucket_cap_bytes: int = DEFAULT_BUCKET_BYTES    # DDP buckets (allreduce) and deltaps' --bucket-bytes (PS)
    max_message_bytes: int = 64 << 20
    host_cores: int | None = None     # all processes share this many cores (None: one device each)

    @property
    def fused_bytes(self) -> int:
        """Raw bytes per PushPull message, as the client sizes them."""
        return fused_message_bytes(self.chunk_bytes, self.max_message_bytes)

    @property
    def grad_bytes(self) -> int:
        return 4 * sum(n for _, n in self.tensors)


def canonical(spec: str) -> str:
    return (spec or "none").strip()
