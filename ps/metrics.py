"""Prometheus exporter of one parameter-server shard (and the exporter plumbing workers share).

Every process gets its own CollectorRegistry (tests run several shards in one process), served by
prometheus_client's start_http_server. Labels stay low-cardinality: shard, rpc, codec, reason — never
a parameter or key name.

Most values are read from the Shard at scrape time (its counters, staleness tally, key versions, live
set), so the hot path pays nothing for them; what the shard does not keep (latencies, per-codec bytes,
rejections, barrier waits) is recorded by wrapping the servicer's RPC methods (`instrument`).

Embedding tables (ps/embedding/) add a `table` label: tables are declared by the job, a handful per shard,
so it stays low-cardinality (never a row id).
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deltaps.exporter import LATENCY_BUCKETS, STALENESS_BUCKETS
from ps.handlers import method_types

log = logging.getLogger("deltaps.metrics")

SERVER_RPCS = tuple(method_types())   # every RPC of the service, embedding ones included


def _raw_nbytes(chunk) -> int:
    """Bytes the chunk's tensor would take uncompressed (dense float32 on the wire, as codec none sends)."""
    n = 1
    for d in chunk.shape:
        n *= int(d)
    return 4 * n


class _ShardCollector:
    """Scrape-time view of a Shard's own state."""

    def __init__(self, shard):
        self.shard = shard

    def describe(self):   # no describe-time collect (the shard may not have a job yet)
        return []

    def collect(self):
        sh = self.shard
        sid = str(sh.shard_id)
        c = dict(sh.counters)
        for name, key, doc in (
                ("deltaps_server_pushes", "pushes", "Push requests accepted (one per worker RPC, duplicates included)"),
                ("deltaps_server_pulls", "pulls", "Pull requests served"),
                ("deltaps_server_duplicate_pushes", "duplicates", "Per-key pushes ignored as retried duplicates"),
                ("deltaps_server_grads_applied", "grads_applied", "Optimizer updates applied to keys"),
                ("deltaps_server_sent_bytes", "bytes_sent", "Wire bytes of parameter values sent in pull responses"),
                ("deltaps_server_evictions", "evictions",
                 "Workers evicted from the live set for silence (--worker-timeout, or 4 missed heartbeats)"),
                ("deltaps_server_rejoins", "rejoins", "Workers that (re)joined a running job"),
                ("deltaps_server_nonfinite_skipped", "nonfinite_skipped",
                 "Per-key NaN/Inf gradients acknowledged but not applied (--nonfinite skip)"),
                ("deltaps_server_checkpoints", "checkpoints", "Checkpoints written by this server process"),
                ("deltaps_server_outer_updates", "outer_updates",
                 "Local-update jobs (--local-steps): outer-optimizer steps applied to keys"),
                ("deltaps_server_late_contributions", "late_contributions",
                 "Quorum rounds: per-key deltas that arrived after their round closed (folded into the open one)"),
                ("deltaps_server_pushes_after_stop", "after_stop",
                 "Per-key pushes acknowledged but not applied because a worker had stopped the job (Stop)"),
        ):
            m = CounterMetricFamily(name, doc, labels=["shard"])
            m.add_metric([sid], float(c.get(key, 0)))
            yield m

        states = list(sh.keys.values())
        versions = [ks.version for ks in states] or [0]
        for name, val, doc in (
                ("deltaps_server_key_version_min", min(versions), "Lowest key version (clock) on this shard"),
                ("deltaps_server_key_version_max", max(versions), "Highest key version (clock) on this shard"),
                ("deltaps_server_keys", len(states), "Keys (parameter chunks) held by this shard"),
                ("deltaps_server_live_workers", len(sh.live), "Live workers of the registered job"),
                ("deltaps_server_min_workers", sh.job.min_workers if sh.job else 0,
                 "Elastic job: live workers below which it pauses (1 when not elastic)"),
                ("deltaps_server_paused", int(sh.paused), "1 while an elastic job waits for workers to join"),
                ("deltaps_server_stopped", int(sh.stopped is not None),
                 "1 once a worker stopped the job (quorum rounds: rank 0 reached the target)"),
                ("deltaps_server_codec_epoch", sh.codec_epoch, "Codec switches announced by this shard"),
        ):
            m = GaugeMetricFamily(name, doc, labels=["shard"])
            m.add_metric([sid], float(val))
            yield m
        info = GaugeMetricFamily("deltaps_server_codec_info", "Gradient codec the shard announces (value 1)",
                                 labels=["shard", "codec"])
        info.add_metric([sid, sh.codec], 1.0)
        yield info

        tally = dict(sh.staleness)    # staleness (versions behind at apply) -> per-key pushes
        buckets, acc = [], 0
        for b in STALENESS_BUCKETS:
            acc = sum(n for s, n in tally.items() if s <= b)
            buckets.append((str(b), float(acc)))
        total = sum(tally.values())
        buckets.append(("+Inf", float(total)))
        h = HistogramMetricFamily("deltaps_server_staleness_versions",
                                  "Staleness of applied per-key pushes: key version at apply minus version pulled",
                                  labels=["shard"])
        h.add_metric([sid], buckets, sum_value=float(sum(s * n for s, n in tally.items())))
        yield h
        g = GaugeMetricFamily("deltaps_server_staleness_max_versions", "Largest staleness seen so far",
                              labels=["shard"])
        g.add_metric([sid], float(max(tally, default=0)))
        yield g
        job = sh.job
        if job is not None and job.sync.kind in ("bsp", "ssp"):   # asp has no bound: no series
            b = GaugeMetricFamily("deltaps_server_staleness_bound_versions",
                                  "Staleness the sync mode allows (bsp 0, ssp:S S); absent under asp",
                                  labels=["shard", "sync"])
            b.add_metric([sid, str(job.sync)], float(job.sync.bound if job.sync.kind == "ssp" else 0))
            yield b
        yield from _embedding_families(sh, sid)


_EMBEDDING = (   # (name, kind, stats key, doc); dynamic-only keys read 0 for fixed tables
    ("deltaps_server_embedding_rows", "gauge", "rows_held", "Embedding rows held (allocated) per table"),
    ("deltaps_server_embedding_bytes", "gauge", "bytes", "Bytes of embedding values + optimizer state per table"),
    ("deltaps_server_embedding_pending_ids", "gauge", "pending_ids",
     "Dynamic tables: ids counted by the frequency filter, not admitted yet"),
    ("deltaps_server_embedding_rows_evicted", "counter", "rows_evicted",
     "Dynamic tables: rows evicted for not being touched for ttl_steps table steps"),
    ("deltaps_server_embedding_filtered_pushes", "counter", "filtered_pushes",
     "Dynamic tables: gradient rows dropped because the row was not held (frequency filter, or evicted)"),
    ("deltaps_server_embedding_filtered_pulls", "counter", "filtered_pulls",
     "Dynamic tables: rows pulled before the frequency filter admitted them (served their init value)"),
)


def _embedding_families(sh, sid: str):
    """Always yielded (empty without tables), so every family is exposed from the start."""
    store = getattr(sh, "embedding", None)
    tables = store.stats()["tables"] if store is not None else {}
    for name, kind, key, doc in _EMBEDDING:
        fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["shard", "table"])
        for table, st in sorted(tables.items()):
            fam.add_metric([sid, table], float(st.get(key, 0)))
        yield fam


class ServerMetrics:
    """Metrics of one shard. `instrument(servicer)` hooks the RPC methods; the rest is read at scrape."""

    def __init__(self, shard, registry: CollectorRegistry | None = None, process: bool = True):
        self.shard = shard
        self.registry = registry if registry is not None else CollectorRegistry()
        self.sid = str(shard.shard_id)
        r = self.registry
        self.received = Counter("deltaps_server_received_bytes", "Wire bytes of gradients received in pushes",
                                ["shard", "codec"], registry=r)
        self.received_raw = Counter("deltaps_server_received_raw_bytes",
                                    "Uncompressed (dense float32) equivalent of the gradients received",
                                    ["shard", "codec"], registry=r)
        self.apply_s = Histogram("deltaps_server_apply_seconds",
                                 "Time to validate and apply one push request (all its keys)", ["shard"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.rpc_s = Histogram("deltaps_server_rpc_seconds", "Server-side handling time of an RPC, by method",
                               ["shard", "rpc"], buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("deltaps_server_rejected_requests",
                                "Requests refused, by RPC and gRPC status code", ["shard", "rpc", "reason"],
                                registry=r)
        self.barrier_wait = Counter("deltaps_server_barrier_wait_seconds",
                                    "Seconds workers spent blocked in barriers on this shard", ["shard"], registry=r)
        self.barriers = Counter("deltaps_server_barriers", "Barrier calls completed", ["shard"], registry=r)
        self.pull_wait = Counter("deltaps_server_pull_wait_seconds",
                                 "Seconds pulls waited for keys to reach the requested version", ["shard"], registry=r)
        r.register(_ShardCollector(shard))
        if process:
            from prometheus_client import ProcessCollector
            try:
                ProcessCollector(registry=r)
            except Exception:  # noqa: BLE001 - non-Linux
                pass
        for rpc in SERVER_RPCS:   # make the series exist from the start (rate() needs two samples)
            self.rpc_s.labels(self.sid, rpc)
        self.apply_s.labels(self.sid)
        self.barrier_wait.labels(self.sid)
        self.barriers.labels(self.sid)
        self.pull_wait.labels(self.sid)
        self._instrumented = False

    # ---- hooks -----------------------------------------------------------------------------
    def instrument(self, servicer) -> None:
        """Wrap the servicer's RPC methods (instance attributes shadow the class's guarded ones)."""
        if self._instrumented:
            return
        self._instrumented = True
        for rpc in SERVER_RPCS:
            orig = getattr(servicer, rpc, None)
            if orig is not None:
                setattr(servicer, rpc, self._wrap(rpc, orig))
        shard_push = servicer.shard.push
        hist = self.apply_s.labels(self.sid)

        def timed_push(*a, **kw):
            t0 = time.perf_counter()
            out = shard_push(*a, **kw)
            hist.observe(time.perf_counter() - t0)
            return out
        servicer.shard.push = timed_push

    def count_refusal(self, rpc: str, reason: str) -> None:
        """A request refused before it reached the servicer (bad token, undecodable bytes). A method name
        outside the service is counted as "other" (callers choose it: it must not grow the label set)."""
        self.rejected.labels(self.sid, rpc if rpc in SERVER_RPCS else "other", reason).inc()

    def _wrap(self, rpc: str, fn):
        hist = self.rpc_s.labels(self.sid, rpc)
        sid = self.sid

        def handler(request, context):
            t0 = time.perf_counter()
            try:
                rep = fn(request, context)
            except BaseException:
                code = None
                try:
                    code = context.code()
                except Exception:  # noqa: BLE001
                    pass
                self.rejected.labels(sid, rpc, getattr(code, "name", None) or "UNKNOWN").inc()
                raise
            finally:
                hist.observe(time.perf_counter() - t0)
            if rpc in ("Push", "PushPull"):
                for c in (request.grads if rpc == "Push" else request.push.grads):
                    codec = c.codec or "none"
                    self.received.labels(sid, codec).inc(len(c.data) + len(c.header))
                    self.received_raw.labels(sid, codec).inc(_raw_nbytes(c))
            if rpc in ("Pull", "PushPull"):
                self.pull_wait.labels(sid).inc(max(0.0, (rep if rpc == "Pull" else rep.pull).waited_s))
            elif rpc == "Barrier":
                self.barrier_wait.labels(sid).inc(max(0.0, rep.waited_s))
                self.barriers.labels(sid).inc()
            return rep
        handler.__name__ = rpc
        return handler
