"""End to end against a real Prometheus: shards as `deltaps server` processes, in-process workers, all with
exporters on port-0 ports; Prometheus (Debian package, `make prometheus`) scrapes them every second and the
test asserts through its HTTP query API."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from helpers import start_program
from metrics_cluster import MetricsCluster, small_config

from deltaps.tools.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed; `make prometheus` "
                                                            "(apt-get install prometheus) could not provide it")]


def _wait_file(path, proc, timeout=30.0) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if os.path.exists(path):
            return int(open(path).read())
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        time.sleep(0.05)
    raise TimeoutError(path)


class Prom:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path, **params):
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())

    def query(self, expr) -> list[tuple[dict, float]]:
        d = self.get("/api/v1/query", query=expr)
        assert d["status"] == "success", d
        return [(r["metric"], float(r["value"][1])) for r in d["data"]["result"]]

    def scalar(self, expr) -> float | None:
        res = self.query(expr)
        return res[0][1] if len(res) == 1 else None

    def wait(self, expr, pred, timeout=30.0):
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < timeout:
            try:
                last = self.scalar(expr)
            except OSError:
                last = None
            if last is not None and pred(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"{expr}: last value {last} after {timeout}s")


@pytest.fixture
def servers(tmp_path):
    procs, addrs, mports = [], [], []
    for i in range(2):
        pf, mf = tmp_path / f"server{i}.port", tmp_path / f"server{i}.metrics.port"
        with open(tmp_path / f"server{i}.log", "w") as log:
            p = start_program(["server", "--port", "0", "--shard-id", str(i), "--num-shards", "2", "--port-file",
                               str(pf), "--wait-timeout", "30", "--metrics-port", "0", "--metrics-port-file", str(mf)],
                              log)
        procs.append(p)
    for i, p in enumerate(procs):
        addrs.append(f"127.0.0.1:{_wait_file(tmp_path / f'server{i}.port', p)}")
        mports.append(_wait_file(tmp_path / f"server{i}.metrics.port", p))
    yield addrs, mports
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def test_real_prometheus_scrapes_cluster(tmp_path, servers):
    addrs, server_mports = servers
    cfg = small_config(steps=150, sync="ssp:2")
    cluster = MetricsCluster(cfg, server_addrs=addrs, server_metrics_ports=server_mports)
    port = free_port()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files:
  - {os.path.join(ROOT, 'deploy', 'prometheus', 'alerts.yml')}
scrape_configs:
  - job_name: deltaps-server
    static_configs:
      - targets: {json.dumps([f'127.0.0.1:{p}' for p in cluster.server_metrics_ports])}
        labels: {{role: server}}
  - job_name: deltaps-worker
    static_configs:
      - targets: {json.dumps([f'127.0.0.1:{p}' for p in cluster.worker_metrics_ports])}
        labels: {{role: worker}}
""")
    log = open(tmp_path / "prometheus.log", "w")
    prom_proc = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                  f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                 stdout=log, stderr=subprocess.STDOUT)
    prom = Prom(port)
    try:
        t0 = time.monotonic()
        while True:
            assert prom_proc.poll() is None, open(tmp_path / "prometheus.log").read()
            try:
                urllib.request.urlopen(prom.base + "/-/ready", timeout=2)
                break
            except OSError:
                assert time.monotonic() - t0 < 30, "prometheus not ready in 30 s"
                time.sleep(0.2)
        prom.wait("count(up == 1)", lambda v: v == 4, timeout=20)     # every exporter scraped

        cluster.start_training()
        results = cluster.join(timeout=90)
        pushes = sum(r["push_rpcs"] for r in results)
        raw = sum(r["bytes_pushed_raw"] for r in results)
        wire = sum(r["bytes_pushed_wire"] for r in results)

        # throughput: shards' push count (a scrape after training ended) == what the workers counted
        assert prom.wait("sum(deltaps_server_pushes_total)", lambda v: v == pushes, timeout=20) == pushes > 0
        assert prom.wait("sum(deltaps_worker_push_rpcs_total)", lambda v: v == pushes) == pushes
        assert prom.wait("sum(deltaps_worker_steps_total)", lambda v: v == 2 * cfg.steps) == 2 * cfg.steps
        assert prom.scalar("sum(deltaps_worker_samples_total)") == 2 * cfg.steps * cfg.batch_size
        peak = prom.scalar("max_over_time(sum(rate(deltaps_server_pushes_total[3s]))[2m:1s])")
        assert peak is not None and peak > 0, "no push rate seen while training"
        assert (prom.scalar("max_over_time(sum(deltaps_worker_samples_per_second)[2m:1s])") or 0) > 0
        # bytes raw vs wire, both sides
        assert prom.scalar("sum(deltaps_worker_pushed_raw_bytes_total)") == raw
        assert prom.scalar("sum(deltaps_worker_pushed_wire_bytes_total)") == wire
        assert prom.scalar("sum(deltaps_server_received_bytes_total)") == wire
        assert prom.scalar("sum(deltaps_server_received_raw_bytes_total)") == raw
        # compression ratio (int8: ~4x on the big tensors, small ones go uncompressed)
        ratios = prom.query("deltaps_worker_compression_ratio")
        assert len(ratios) == 2 and all(2.0 < v <= 4.0 for _, v in ratios), ratios
        assert {m["codec"] for m, _ in prom.query("sum by (codec) (deltaps_server_received_bytes_total)")} >= {"int8"}
        # staleness: series exist, every applied key push counted, ssp:2 bound held
        count = prom.scalar("sum(deltaps_server_staleness_versions_count)")
        assert count is not None and count >= pushes
        assert prom.scalar('sum(deltaps_server_staleness_versions_bucket{le="2"})') == count
        assert prom.scalar("max(deltaps_server_staleness_max_versions)") <= 2
        assert prom.scalar("max(deltaps_server_staleness_bound_versions)") == 2
        q99 = prom.scalar("histogram_quantile(0.99, sum by (le) (deltaps_server_staleness_versions_bucket))")
        assert q99 is not None and 0 <= q99 <= 2
        # cluster state and step-time split
        live = prom.query("deltaps_server_live_workers")
        assert sorted(m["shard"] for m, _ in live) == ["0", "1"] and all(v == 2 for _, v in live)
        assert prom.scalar("min(deltaps_server_key_version_min)") == cfg.steps
        split = prom.scalar("sum(deltaps_worker_compute_seconds_total) + sum(deltaps_worker_comm_seconds_total)"
                            " + sum(deltaps_worker_wait_seconds_total)")
        assert split == pytest.approx(prom.scalar("sum(deltaps_worker_step_seconds_sum)"), rel=1e-6)
        # the shipped alert rules loaded into the real server
        groups = prom.get("/api/v1/rules")["data"]["groups"]
        assert {r["name"] for g in groups for r in g["rules"]} >= {"DeltapsWorkerStalled", "DeltapsCommShareHigh",
                                                                  "DeltapsStalenessAboveBound"}
        assert all(r.get("health") != "err" for g in groups for r in g["rules"]), groups
    finally:
        prom_proc.terminate()
        try:
            prom_proc.wait(10)
        except subprocess.TimeoutExpired:
            prom_proc.kill()
        cluster.stop()
