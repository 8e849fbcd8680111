"""Prometheus exporters: server/worker metric values, GPU gauges, `deltaps top`, dashboard + docs vs live names,
promtool on deploy/prometheus."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
import urllib.request
from contextlib import redirect_stdout

import grpc
import pytest
from metrics_cluster import MetricsCluster, small_config

from deltaps.exporter import metric_names
from protos import pb, rpc
from worker.metrics import WorkerMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")


def _v(m, name, **labels):
    return m.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def trained():
    cfg = small_config()
    c = MetricsCluster(cfg)
    c.start_training()
    results = c.join()
    # one rejected request, to see the reason label: worker 7 is no member of the job
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
    with pytest.raises(grpc.RpcError) as e:
        stub.Push(pb.PushRequest(worker_id=7, step=0, seq=1), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    yield c, results
    c.stop()


def _gpu_fake(monkeypatch):
    """A pynvml stand-in with one GPU at 42 % and 1 GiB of 16 GiB used; torch claims CUDA."""
    nv = types.ModuleType("pynvml")
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=42, memory=10)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=1 << 30, total=16 << 30, free=15 << 30)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_server_counters_match_worker_counters(trained):
    c, results = trained
    sm, cfg = c.server_metrics, c.cfg
    pushes = sum(_v(m, "deltaps_server_pushes_total", shard=str(i)) for i, m in enumerate(sm))
    assert pushes == sum(r["push_rpcs"] for r in results) > 0
    wire = sum(_v(m, "deltaps_server_received_bytes_total", shard=str(i), codec=k)
               for i, m in enumerate(sm) for k in ("int8", "none"))
    raw = sum(_v(m, "deltaps_server_received_raw_bytes_total", shard=str(i), codec=k)
              for i, m in enumerate(sm) for k in ("int8", "none"))
    assert wire == sum(r["bytes_pushed_wire"] for r in results)
    assert raw == sum(r["bytes_pushed_raw"] for r in results)
    assert raw / wire > 2.0                       # int8 on most bytes
    for i, m in enumerate(sm):
        s = str(i)
        assert _v(m, "deltaps_server_live_workers", shard=s) == cfg.workers
        assert _v(m, "deltaps_server_key_version_min", shard=s) == cfg.steps
        assert _v(m, "deltaps_server_key_version_max", shard=s) == cfg.steps
        n = _v(m, "deltaps_server_staleness_versions_count", shard=s)
        assert n > 0 and _v(m, "deltaps_server_staleness_versions_bucket", shard=s, le="+Inf") == n
        assert _v(m, "deltaps_server_staleness_versions_bucket", shard=s, le="1") == n   # ssp:1 bound holds
        assert _v(m, "deltaps_server_staleness_max_versions", shard=s) <= 1
        assert _v(m, "deltaps_server_staleness_bound_versions", shard=s, sync="ssp:1") == 1
        assert _v(m, "deltaps_server_apply_seconds_count", shard=s) == _v(m, "deltaps_server_pushes_total", shard=s)
        assert _v(m, "deltaps_server_barriers_total", shard=s) == 2 * cfg.workers   # train-done + exit
        assert _v(m, "deltaps_server_rpc_seconds_count", shard=s, rpc="Pull") > 0
    assert _v(sm[0], "deltaps_server_rejected_requests_total", shard="0", rpc="Push",
              reason="FAILED_PRECONDITION") == 1


def test_worker_metrics(trained):
    c, results = trained
    cfg = c.cfg
    for r, (m, res) in enumerate(zip(c.worker_metrics, results)):
        w = str(r)
        assert _v(m, "deltaps_worker_steps_total", worker=w) == cfg.steps
        assert _v(m, "deltaps_worker_samples_total", worker=w) == cfg.steps * cfg.batch_size
        split = {k: _v(m, f"deltaps_worker_{k}_seconds_total", worker=w) for k in ("compute", "comm", "wait")}
        assert split["compute"] == pytest.approx(res["compute_s"], rel=1e-6, abs=1e-6)
        assert split["comm"] == pytest.approx(res["comm_s"], rel=1e-6, abs=1e-6)
        assert split["wait"] == pytest.approx(res["wait_s"], rel=1e-6, abs=1e-6)
        assert _v(m, "deltaps_worker_step_seconds_count", worker=w) == cfg.steps
        assert _v(m, "deltaps_worker_step_seconds_sum", worker=w) == pytest.approx(sum(split.values()), rel=1e-6)
        assert _v(m, "deltaps_worker_push_rpcs_total", worker=w) == res["push_rpcs"]
        # training pushes ride fused PushPull RPCs (one push + one pull each); the setup pull is a plain Pull
        assert res["push_pull_rpcs"] == res["push_rpcs"] > 0
        assert _v(m, "deltaps_worker_push_pull_rpcs_total", worker=w) == res["push_pull_rpcs"]
        assert _v(m, "deltaps_worker_push_pull_rpc_seconds_count", worker=w) == res["push_pull_rpcs"]
        assert _v(m, "deltaps_worker_push_rpc_seconds_count", worker=w) == 0
        assert _v(m, "deltaps_worker_pull_rpcs_total", worker=w) == res["pull_rpcs"] > res["push_pull_rpcs"]
        assert _v(m, "deltaps_worker_pushed_raw_bytes_total", worker=w) == res["bytes_pushed_raw"]
        assert _v(m, "deltaps_worker_pushed_wire_bytes_total", worker=w) == res["bytes_pushed_wire"]
        assert _v(m, "deltaps_worker_compression_ratio", worker=w) == pytest.approx(
            res["bytes_pushed_raw"] / res["bytes_pushed_wire"])
        assert _v(m, "deltaps_worker_loss", worker=w) == pytest.approx(res["losses"][-1])
        assert time.time() - _v(m, "deltaps_worker_last_step_timestamp_seconds", worker=w) < 120
        assert _v(m, "deltaps_worker_samples_per_second", worker=w) > 0
        assert _v(m, "deltaps_worker_codec_info", worker=w, codec="int8") == 1
        assert _v(m, "deltaps_worker_codec_fallbacks_total", worker=w, reason="loss_rise") == 0
        assert not any(n.startswith("deltaps_gpu_") for n in metric_names(m.registry))   # CPU box: skipped


def test_fallback_counter():
    m = WorkerMetrics(3, process=False)
    m.on_fallback("loss is nan")
    m.on_fallback("smoothed loss 9 > 3 x running minimum 1")
    assert _v(m, "deltaps_worker_codec_fallbacks_total", worker="3", reason="nonfinite_loss") == 1
    assert _v(m, "deltaps_worker_codec_fallbacks_total", worker="3", reason="loss_rise") == 1


def test_gpu_metrics_with_nvml(monkeypatch):
    _gpu_fake(monkeypatch)
    m = WorkerMetrics(0, process=False)
    assert _v(m, "deltaps_gpu_utilization_ratio", worker="0", gpu="0") == pytest.approx(0.42)
    assert _v(m, "deltaps_gpu_memory_used_bytes", worker="0", gpu="0") == 1 << 30
    assert _v(m, "deltaps_gpu_memory_total_bytes", worker="0", gpu="0") == 16 << 30


def test_gpu_metrics_skip_without_nvml(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynvml", None)       # import pynvml -> ImportError
    m = WorkerMetrics(0, process=False)
    assert not any(n.startswith("deltaps_gpu_") for n in metric_names(m.registry))


def test_exporter_serves_http(trained):
    c, _ = trained
    body = urllib.request.urlopen(f"http://127.0.0.1:{c.server_metrics_ports[1]}/metrics", timeout=5).read().decode()
    assert 'deltaps_server_pushes_total{shard="1"}' in body
    body = urllib.request.urlopen(f"http://127.0.0.1:{c.worker_metrics_ports[0]}/metrics", timeout=5).read().decode()
    assert 'deltaps_worker_steps_total{worker="0"} 20.0' in body


def test_labels_are_low_cardinality(trained):
    c, _ = trained
    allowed = {"shard", "worker", "codec", "rpc", "reason", "sync", "le", "gpu", "table"}
    for m in c.server_metrics + c.worker_metrics:
        for fam in m.registry.collect():
            for s in fam.samples:
                assert set(s.labels) <= allowed, (s.name, s.labels)


# ---- deltaps top -------------------------------------------------------------------------------
def test_top_once_json(trained):
    from deltaps.cli import main
    c, results = trained
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["top", "--metrics", ",".join(c.metrics_endpoints), "--once", "--json", "--interval", "0.2"]) == 0
    s = json.loads(buf.getvalue())
    assert s["cluster"]["shards"] == 2 and s["cluster"]["workers"] == 2 and not s["errors"]
    assert s["cluster"]["pushes_total"] == sum(r["push_rpcs"] for r in results)
    assert s["cluster"]["worker_push_rpcs_total"] == s["cluster"]["pushes_total"]
    assert s["cluster"]["pushes_per_s"] == 0           # training is over: nothing moves between the scrapes
    assert 0 <= s["cluster"]["staleness_mean"] <= 1
    assert all(w["compression_ratio"] > 2 for w in s["workers"])


def test_top_once_text(trained):
    from deltaps.cli import main
    c, _ = trained
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["top", "--metrics", ",".join(c.metrics_endpoints + ["127.0.0.1:1"]), "--once",
                     "--interval", "0"]) == 0
    out = buf.getvalue()
    assert "SHARD" in out and "WORKER" in out and "comm share" in out
    assert "! http://127.0.0.1:1/metrics" in out           # an unreachable endpoint is shown, not fatal


# ---- dashboard + docs against the names the exporters really expose ------------------------------
def _exposed(trained, monkeypatch) -> tuple[set[str], set[str]]:
    """(sample names, documented family names) from the live registries, plus GPU gauges via a fake NVML."""
    c, _ = trained
    _gpu_fake(monkeypatch)
    regs = [m.registry for m in c.server_metrics + c.worker_metrics] + [WorkerMetrics(9, process=False).registry]
    samples, families = set(), set()
    for r in regs:
        samples |= metric_names(r)
        for fam in r.collect():
            if fam.name.startswith("deltaps_"):
                families.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    return samples, families


def _dashboard_exprs():
    d = json.load(open(os.path.join(DEPLOY, "grafana", "deltaps-dashboard.json")))
    panels = []
    for p in d["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    return d, [(p["title"], t["expr"]) for p in panels if p.get("type") != "row" for t in p.get("targets", [])]


def test_dashboard_queries_use_exposed_metrics(trained, monkeypatch):
    samples, _ = _exposed(trained, monkeypatch)
    d, exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    used = set()
    for title, expr in exprs:
        names = set(re.findall(r"\b(deltaps_[a-zA-Z0-9_]+)", expr))
        assert names, f"panel {title!r} queries no deltaps metric: {expr}"
        missing = names - samples
        assert not missing, f"panel {title!r} uses unknown metric(s) {sorted(missing)}: {expr}"
        used |= names
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for want in ("samples / s", "raw vs wire", "compression ratio", "staleness heatmap", "step-time split",
                 "per shard", "live workers", "gpu"):
        assert want in titles, want
    assert any(p["type"] == "heatmap" for p in d["panels"])
    for needed in ("deltaps_worker_pushed_raw_bytes_total", "deltaps_worker_pushed_wire_bytes_total",
                   "deltaps_server_staleness_versions_bucket", "deltaps_server_live_workers"):
        assert needed in used


def test_alert_rules_use_exposed_metrics(trained, monkeypatch):
    import yaml
    samples, _ = _exposed(trained, monkeypatch)
    rules = yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "alerts.yml")))
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {"DeltapsWorkerStalled", "DeltapsStalenessAboveBound", "DeltapsCommShareHigh"} <= names
    for g in rules["groups"]:
        for r in g["rules"]:
            missing = set(re.findall(r"\b(deltaps_[a-zA-Z0-9_]+)", r["expr"])) - samples
            assert not missing, (r["alert"], missing)


def test_docs_table_lists_every_metric(trained, monkeypatch):
    _, families = _exposed(trained, monkeypatch)
    text = open(os.path.join(ROOT, "docs", "metrics.md")).read()   # the metric reference tables
    documented = set(re.findall(r"^\|\s*`(deltaps_[a-z0-9_]+)`", text, flags=re.M))
    assert families - documented == set(), f"undocumented: {sorted(families - documented)}"
    assert documented - families == set(), f"documented but not exposed: {sorted(documented - families)}"


# ---- promtool -----------------------------------------------------------------------------------
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (make prometheus)")


def _promtool(*args):
    return subprocess.run([promtool, *args], cwd=os.path.join(DEPLOY, "prometheus"), capture_output=True,
                          text=True, timeout=60)


@needs_promtool
def test_promtool_check_config_and_rules():
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"),
                 ("test", "rules", "alerts_test.yml")):
        r = _promtool(*args)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"


@needs_promtool
def test_promtool_kubernetes_variant():
    r = _promtool("check", "config", "prometheus-kubernetes.yml")
    if r.returncode != 0 and "kubernetes_sd_configs not found" in r.stdout + r.stderr:
        pytest.skip("this promtool build has no Kubernetes service discovery (Debian builds omit it)")
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_variant_structure():
    import yaml
    cfg = yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "prometheus-kubernetes.yml")))
    job = cfg["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    assert cfg["rule_files"] == ["alerts.yml"]
    assert any(rc.get("target_label") == "__address__" for rc in job["relabel_configs"])


# ---- CLI processes ------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_server_exporter_port_file(tmp_path):
    pf, mf = tmp_path / "s.port", tmp_path / "s.metrics.port"
    p = subprocess.Popen([sys.executable, "-m", "deltaps", "server", "--port", "0", "--shard-id", "0", "--num-shards", "1",
                          "--port-file", str(pf), "--metrics-port", "0", "--metrics-port-file", str(mf)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        t0 = time.monotonic()
        while not (pf.exists() and mf.exists()) and time.monotonic() - t0 < 30:
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.05)
        port = int(mf.read_text())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'deltaps_server_live_workers{shard="0"} 0.0' in body
        assert "process_cpu_seconds_total" in body
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=15)
    assert f"metrics on http://127.0.0.1:{port}/metrics" in out


@pytest.mark.slow
def test_launch_metrics_urls():
    from deltaps.tools.launch import launch
    s = launch(small_config(steps=10), quiet=True, metrics=True)
    assert len(s["metrics_urls"]) == 4 and all(u.startswith("http://127.0.0.1:") and u.endswith("/metrics")
                                               for u in s["metrics_urls"])
    assert launch(small_config(steps=3, workers=1, servers=1), quiet=True)["metrics_urls"] == []


@pytest.mark.parametrize("codec, carried", [("chunktopk:density=0.05,chunk=64", (0.02, 0.9)), ("int8", (0.999, 1.0))])
def test_local_update_rounds_report_the_share_of_their_deltas_the_payloads_carried(codec, carried):
    """A sparse round payload leaves most of a delta in the residual; int8 carries nearly all of it."""
    c = MetricsCluster(small_config(codec=codec, sync="bsp", local_steps=4, steps=16, hidden=64))
    try:
        c.start_training()
        results = c.join()
    finally:
        c.stop()
    lo, hi = carried
    for r, (m, res) in enumerate(zip(c.worker_metrics, results)):
        assert lo < _v(m, "deltaps_worker_payload_energy_share", worker=str(r)) <= hi
        assert lo < res["payload_energy_share"] <= hi
        # bench's pulled per step counts the loop's pulls only: the initial full fp32 pull (and the final one) apart
        assert 0 < res["loop_bytes_pulled_wire"] <= res["steady_bytes_moved"]
        assert res["bytes_pulled_wire"] - res["loop_bytes_pulled_wire"] >= 4 * res["model_params"]
