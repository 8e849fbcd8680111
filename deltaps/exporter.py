"""Prometheus exporter plumbing shared by shards and workers: histogram buckets, the /metrics HTTP server,
its command-line flags and the atomic port file (also used for gRPC ports)."""
from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("deltaps.metrics")

# Latency buckets: 100 us .. 60 s (pushes of small models take ~1 ms, a blocked bsp pull can take seconds).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)
# Staleness in versions (integers; bucket le=N counts pushes at most N versions behind).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


def start_exporter(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1",
                   port_file: str | None = None, what: str = "deltaps") -> tuple[object, int]:
    """Serve /metrics of `registry` on addr:port (0 = a free port); returns (http server, bound port).

    The bound port is logged, printed, and written atomically to port_file when given."""
    httpd, _thread = start_http_server(port, addr=addr, registry=registry)
    bound = httpd.server_port
    log.info("%s metrics on http://%s:%d/metrics", what, addr, bound)
    print(f"{what} metrics on http://{addr}:{bound}/metrics", flush=True)
    if port_file:
        write_port_file(port_file, bound)
    return httpd, bound


def write_port_file(path: str, port: int) -> None:
    """Publish a bound port atomically (temp file + rename): a reader never sees a partial number."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def stop_exporter(httpd) -> None:
    try:
        httpd.shutdown()
        httpd.server_close()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


def metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry exposes (with _total/_bucket/_count/_sum/_created suffixes)."""
    names = set()
    for fam in registry.collect():
        for s in fam.samples:
            names.add(s.name)
    return names


# ---- command-line plumbing (deltaps server / worker) ----------------------------------------
def add_metrics_args(p) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0 = a free port, printed); default off")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    p.add_argument("--metrics-port-file", help="write the bound metrics port to this file")


def maybe_start_exporter(args, registry: CollectorRegistry, what: str):
    """Start the exporter if --metrics-port was given; returns the http server or None."""
    if getattr(args, "metrics_port", None) is None:
        return None
    httpd, _ = start_exporter(registry, args.metrics_port, args.metrics_addr, args.metrics_port_file, what)
    return httpd
