"""Staleness as exported: ssp:2 with a deliberately slowed worker has mass at 1 and 2 and none above;
bsp is all 0. Read from the shard's real /metrics endpoint."""
import time
import urllib.request

import pytest
import torch
from conftest import run_threads
from helpers import client

from deltaps.exporter import start_exporter, stop_exporter
from ps.metrics import ServerMetrics
from ps.server import start_server
from ps.shard import Shard


def _buckets(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("deltaps_server_staleness_versions_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("sync", ["ssp:2", "bsp"])
def test_exported_staleness_histogram(sync):
    shard = Shard(0, 1, wait_timeout_s=30)
    m = ServerMetrics(shard)
    server, port = start_server(shard, "127.0.0.1", 0, metrics=m)
    httpd, mport = start_exporter(m.registry, 0, what="staleness test")
    addr = [f"127.0.0.1:{port}"]
    try:
        cls = [client(addr, r, 2, sync=sync) for r in range(2)]
        for cl in cls:
            cl.setup([("w", torch.zeros(64))])
        g = {"w": torch.full((64,), 0.01)}

        def work(r, delay):
            cl = cls[r]
            for clock in range(15):
                cl.pull(min_version=cl.sync.pull_min_version(clock))
                time.sleep(delay)
                cl.push(g, clock)

        run_threads([lambda: work(0, 0.0), lambda: work(1, 0.03)])   # worker 1 is the slow one
        b = _buckets(mport)
        assert b["+Inf"] == 30                                        # every push recorded once
        if sync == "bsp":
            assert b["0"] == 30
        else:
            assert b["0"] < b["1"] < b["2"] == b["+Inf"], b      # mass at 1 and at 2, none above 2
        for cl in cls:
            cl.close()
    finally:
        stop_exporter(httpd)
        server.stop(None)
