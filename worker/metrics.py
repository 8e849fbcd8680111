"""Prometheus exporter of one training worker: step-time split, throughput, bytes, RPC latency, loss, GPU.

    m = WorkerMetrics(rank)              # own CollectorRegistry
    start_exporter(m.registry, port)     # deltaps.exporter.start_exporter
    m.attach(opt)                        # a DistributedOptimizer (after construction)
    ... per step: m.on_step(step_seconds, loss, batch_size)

Byte/RPC counters are read from the client's CommStats at scrape time; per-RPC latencies are observed
by swapping in a CommStats subclass; the step split comes from DistributedOptimizer.timing deltas, using
the same definitions as the trainer's result JSON: compute = step - blocked, comm = blocked - wait,
wait = server-side wait (bounded by blocked). GPU gauges appear only when torch sees a CUDA device and
pynvml imports; otherwise they are skipped silently.
"""
from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deltaps.exporter import LATENCY_BUCKETS
from worker.comm_stats import CommStats

log = logging.getLogger("deltaps.metrics")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ObservedCommStats(CommStats):
    """CommStats that also feeds push/pull RPC latency histograms."""

    def __init__(self, push_hist, pull_hist, push_pull_hist, start: dict | None = None):
        super().__init__()
        self.c.update(start or {})
        self._hists = {"push_s": push_hist, "pull_s": pull_hist, "push_pull_s": push_pull_hist}

    def add(self, **kw) -> None:
        super().add(**kw)
        for key, hist in self._hists.items():
            if key in kw:
                hist.observe(kw[key])


class _ClientCollector:
    def __init__(self, metrics: "WorkerMetrics"):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.m
        client = m.client
        snap = client.stats.snapshot() if client is not None else {}
        w = m.worker
        for name, key, doc in (
                ("deltaps_worker_pushed_raw_bytes", "bytes_pushed_raw", "Uncompressed bytes of gradients pushed"),
                ("deltaps_worker_pushed_wire_bytes", "bytes_pushed_wire", "Wire bytes of gradients pushed (after codec)"),
                ("deltaps_worker_pulled_wire_bytes", "bytes_pulled_wire", "Wire bytes of parameters pulled"),
                ("deltaps_worker_push_rpcs", "push_rpcs", "Pushes completed (plain Push RPCs + PushPull RPCs)"),
                ("deltaps_worker_pull_rpcs", "pull_rpcs", "Pulls completed (plain Pull RPCs + PushPull RPCs)"),
                ("deltaps_worker_push_pull_rpcs", "push_pull_rpcs", "Fused PushPull RPCs completed"),
        ):
            f = CounterMetricFamily(name, doc, labels=["worker"])
            f.add_metric([w], float(snap.get(key, 0)))
            yield f
        raw, wire = snap.get("bytes_pushed_raw", 0), snap.get("bytes_pushed_wire", 0)
        g = GaugeMetricFamily("deltaps_worker_compression_ratio",
                              "Raw / wire bytes pushed so far (1 = uncompressed)", labels=["worker"])
        g.add_metric([w], raw / wire if wire else 1.0)
        yield g
        codec = client.codec if client is not None else m.codec
        info = GaugeMetricFamily("deltaps_worker_codec_info", "Codec the worker is using (value 1)",
                                 labels=["worker", "codec"])
        info.add_metric([w, codec or "none"], 1.0)
        yield info
        yield from m._gpu.collect(w)


class _GPUCollector:
    """NVML gauges; lazily imported, disabled for good on the first failure (no GPU / no pynvml)."""

    def __init__(self):
        self.handles = None
        self.enabled = True

    def _init(self) -> bool:
        if self.handles is not None:
            return True
        if not self.enabled:
            return False
        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            import pynvml  # type: ignore
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            return True
        except Exception as e:  # noqa: BLE001 - any failure means "no GPU metrics"
            log.debug("GPU metrics disabled: %s", e)
            self.enabled = False
            return False

    def collect(self, worker: str):
        if not self._init():
            return
        util = GaugeMetricFamily("deltaps_gpu_utilization_ratio", "GPU busy fraction over the last NVML sample period",
                                 labels=["worker", "gpu"])
        used = GaugeMetricFamily("deltaps_gpu_memory_used_bytes", "GPU memory in use (all processes)",
                                 labels=["worker", "gpu"])
        total = GaugeMetricFamily("deltaps_gpu_memory_total_bytes", "GPU memory capacity", labels=["worker", "gpu"])
        for i, h in enumerate(self.handles):
            try:
                u = self.nvml.nvmlDeviceGetUtilizationRates(h)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # noqa: BLE001
                continue
            util.add_metric([worker, str(i)], u.gpu / 100.0)
            used.add_metric([worker, str(i)], float(mem.used))
            total.add_metric([worker, str(i)], float(mem.total))
        yield util
        yield used
        yield total


class WorkerMetrics:
    def __init__(self, worker: int, registry: CollectorRegistry | None = None, codec: str = "none",
                 process: bool = True):
        self.worker = str(worker)
        self.codec = codec
        self.registry = registry if registry is not None else CollectorRegistry()
        self.client = None
        self.opt = None
        self._lock = threading.Lock()
        self._last_timing = {"blocked_s": 0.0, "wait_s": 0.0}
        self._recent: list[tuple[float, int]] = []   # (perf_counter at step end, samples) for samples/s
        r, w = self.registry, [self.worker]
        self.steps = Counter("deltaps_worker_steps", "Training steps completed", ["worker"], registry=r).labels(*w)
        self.samples = Counter("deltaps_worker_samples", "Training samples processed", ["worker"],
                               registry=r).labels(*w)
        self.compute = Counter("deltaps_worker_compute_seconds", "Step time spent computing (not blocked on the PS)",
                               ["worker"], registry=r).labels(*w)
        self.comm = Counter("deltaps_worker_comm_seconds",
                            "Step time blocked on push/pull transfers (excluding server-side waiting)",
                            ["worker"], registry=r).labels(*w)
        self.wait = Counter("deltaps_worker_wait_seconds",
                            "Step time blocked waiting on the servers for other workers (sync gating)",
                            ["worker"], registry=r).labels(*w)
        self.step_s = Histogram("deltaps_worker_step_seconds", "Wall time of one training step", ["worker"],
                                buckets=STEP_BUCKETS, registry=r).labels(*w)
        self.push_s = Histogram("deltaps_worker_push_rpc_seconds", "Latency of one Push RPC", ["worker"],
                                buckets=LATENCY_BUCKETS, registry=r).labels(*w)
        self.pull_s = Histogram("deltaps_worker_pull_rpc_seconds", "Latency of one Pull RPC (includes server wait)",
                                ["worker"], buckets=LATENCY_BUCKETS, registry=r).labels(*w)
        self.push_pull_s = Histogram("deltaps_worker_push_pull_rpc_seconds",
                                     "Latency of one fused PushPull RPC (push, server wait for the step, pull)",
                                     ["worker"], buckets=LATENCY_BUCKETS, registry=r).labels(*w)
        self.loss = Gauge("deltaps_worker_loss", "Training loss of the last step", ["worker"], registry=r).labels(*w)
        self.last_step = Gauge("deltaps_worker_last_step_timestamp_seconds",
                               "Unix time the last step finished (alert when it stops moving)", ["worker"],
                               registry=r).labels(*w)
        self.sps = Gauge("deltaps_worker_samples_per_second", "Samples/s over the last ~5 s of steps", ["worker"],
                         registry=r).labels(*w)
        self.fallbacks = Counter("deltaps_worker_codec_fallbacks",
                                 "Automatic codec rollbacks this worker triggered, by reason", ["worker", "reason"],
                                 registry=r)
        # local-update jobs (--local-steps): inner steps, rounds adopted, size of what a round pushes
        self.local_steps = Counter("deltaps_worker_local_steps", "Inner steps taken (local-update jobs)", ["worker"],
                                   registry=r).labels(*w)
        self.outer_rounds = Counter("deltaps_worker_outer_rounds",
                                    "Outer rounds (fragment rounds when streaming) pushed and adopted",
                                    ["worker"], registry=r).labels(*w)
        self.delta_norm = Gauge("deltaps_worker_delta_norm", "L2 norm of the last parameter delta pushed",
                                ["worker"], registry=r).labels(*w)
        self.payload_share = Gauge("deltaps_worker_payload_energy_share",
                                   "Share of the last round's delta + error-feedback residual (squared L2 norm) that "
                                   "its payloads carried; the rest waits in the error feedback (1 = lossless)",
                                   ["worker"], registry=r).labels(*w)
        self._rounds_seen = 0
        self.fallbacks.labels(self.worker, "nonfinite_loss")
        self.fallbacks.labels(self.worker, "loss_rise")
        self.last_step.set(time.time())
        r.register(_ClientCollector(self))
        self._gpu = _GPUCollector()
        if process:
            from prometheus_client import ProcessCollector
            try:
                ProcessCollector(registry=r)
            except Exception:  # noqa: BLE001
                pass

    def attach(self, opt) -> None:
        """Follow a DistributedOptimizer (its client's CommStats and timing)."""
        self.opt = opt
        self.client = opt.client
        old = opt.client.stats
        with old.lock:
            opt.client.stats = ObservedCommStats(self.push_s, self.pull_s, self.push_pull_s, dict(old.c))
        self._last_timing = {k: opt.timing.get(k, 0.0) for k in ("blocked_s", "wait_s")}

    def on_step(self, step_seconds: float, loss: float, samples: int) -> None:
        if self.opt is not None:     # the split is measured where a DistributedOptimizer is attached (ps modes);
            t = self.opt.timing      # elsewhere it is not known, and is not exported as all compute
            blocked = t["blocked_s"] - self._last_timing["blocked_s"]
            wait = t["wait_s"] - self._last_timing["wait_s"]
            self._last_timing = {"blocked_s": t["blocked_s"], "wait_s": t["wait_s"]}
            self.compute.inc(max(0.0, step_seconds - blocked))
            self.comm.inc(max(0.0, blocked - wait))
            self.wait.inc(max(0.0, wait))
        self.step_s.observe(step_seconds)
        self.steps.inc()
        self.samples.inc(samples)
        local = getattr(self.opt, "local", None)
        if local is not None:
            self.local_steps.inc()
            self.outer_rounds.inc(local.outer_rounds - self._rounds_seen)
            self._rounds_seen = local.outer_rounds
            self.delta_norm.set(local.last_delta_norm)
            if local.last_payload_share is not None:
                self.payload_share.set(local.last_payload_share)
        if loss == loss and abs(loss) != float("inf"):
            self.loss.set(loss)
        self.last_step.set(time.time())
        now = time.perf_counter()
        with self._lock:
            self._recent.append((now, samples))
            while len(self._recent) > 2 and now - self._recent[0][0] > 5.0:
                self._recent.pop(0)
            if len(self._recent) >= 2:
                span = now - self._recent[0][0]
                n = sum(s for _, s in self._recent[1:])
                if span > 0:
                    self.sps.set(n / span)

    def on_fallback(self, reason: str) -> None:
        kind = "nonfinite_loss" if reason.startswith("loss is") else "loss_rise"
        self.fallbacks.labels(self.worker, kind).inc()
