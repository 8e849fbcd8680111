"""A small instrumented cluster for the metrics tests: shards + workers, each with its own registry/exporter."""
from __future__ import annotations

import threading

from deltaps.config import TrainConfig
from deltaps.exporter import start_exporter, stop_exporter
from ps.metrics import ServerMetrics
from ps.server import start_server
from ps.shard import Shard
from worker.metrics import WorkerMetrics


def small_config(**kw) -> TrainConfig:
    base = dict(servers=2, workers=2, steps=20, batch_size=16, hidden=32, layers=1, codec="int8",
                sync="ssp:1", optimizer="sgd", lr=0.05, progress=False, timeout_s=30.0, min_compress_bytes=64)
    base.update(kw)
    cfg = TrainConfig(**base)
    cfg.validate()
    return cfg


class MetricsCluster:
    """In-process shards (gRPC on port 0) and worker threads, every one exporting on a port-0 /metrics."""

    def __init__(self, cfg: TrainConfig, server_addrs: list[str] | None = None, server_metrics_ports=None):
        self.cfg = cfg
        self.grpc_servers, self.httpds = [], []
        self.server_metrics: list[ServerMetrics] = []
        self.server_metrics_ports: list[int] = list(server_metrics_ports or [])
        if server_addrs is None:
            server_addrs = []
            for i in range(cfg.servers):
                shard = Shard(i, cfg.servers, wait_timeout_s=30.0)
                m = ServerMetrics(shard)
                srv, port = start_server(shard, "127.0.0.1", 0, metrics=m)
                httpd, mport = start_exporter(m.registry, 0, what=f"test shard={i}")
                self.grpc_servers.append(srv)
                self.httpds.append(httpd)
                self.server_metrics.append(m)
                self.server_metrics_ports.append(mport)
                server_addrs.append(f"127.0.0.1:{port}")
        self.addrs = server_addrs
        self.worker_metrics = [WorkerMetrics(r, codec=cfg.codec) for r in range(cfg.workers)]
        self.worker_metrics_ports = []
        for r, m in enumerate(self.worker_metrics):
            httpd, port = start_exporter(m.registry, 0, what=f"test worker={r}")
            self.httpds.append(httpd)
            self.worker_metrics_ports.append(port)
        self.results: list[dict | None] = [None] * cfg.workers
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    @property
    def metrics_endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.server_metrics_ports + self.worker_metrics_ports]

    def start_training(self) -> None:
        from worker.trainers.context import RunContext
        from worker.trainers.loop import train

        def run(r):
            try:
                ctx = RunContext(r, self.cfg.workers, servers=self.addrs, metrics=self.worker_metrics[r])
                self.results[r] = train(self.cfg, ctx)
            except BaseException as e:  # noqa: BLE001
                self.errors.append(e)
        self.threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(self.cfg.workers)]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 120.0) -> list[dict]:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "worker thread hung"
        if self.errors:
            raise self.errors[0]
        return self.results

    def stop(self) -> None:
        for h in self.httpds:
            stop_exporter(h)
        for s in self.grpc_servers:
            s.stop(grace=None)
