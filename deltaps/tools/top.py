"""`deltaps top`: a refreshing terminal view of a live cluster, read from its /metrics endpoints.

    deltaps top --metrics 127.0.0.1:9100,127.0.0.1:9101,...   # servers and workers, any order
    deltaps top --metrics ... --once                            # one snapshot (two scrapes --interval apart)

Rates (pushes/s, MB/s, samples/s) come from the difference of two scrapes; comm share is the fraction
of step time a worker spent blocked on communication over that window (cumulative when there is only one
scrape). "comm share" = transfers + waiting on the servers (the COMM and WAIT columns). Endpoints are told apart by
the metrics they expose (deltaps_server_* vs deltaps_worker_*).
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def add_top_parser(sub) -> None:
    t = sub.add_parser("top", help="live terminal view of a cluster from its Prometheus /metrics endpoints")
    t.add_argument("--metrics", "--servers", dest="endpoints", required=True,
                   help="comma-separated host:port (or URL) of every /metrics endpoint to watch")
    t.add_argument("--interval", type=float, default=2.0, help="refresh period, seconds (default 2)")
    t.add_argument("--once", action="store_true", help="print one snapshot and exit")
    t.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    t.add_argument("--timeout", type=float, default=3.0, help="per-endpoint scrape timeout, seconds")


def _url(ep: str) -> str:
    ep = ep.strip()
    if not ep.startswith(("http://", "https://")):
        ep = "http://" + ep
    if ep.rstrip("/").count("/") < 3:
        ep = ep.rstrip("/") + "/metrics"
    return ep


def scrape(url: str, timeout: float = 3.0) -> dict:
    """{'t': monotonic time, 'samples': {(name, frozenset(labels)): value}} or {'error': ...}."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except Exception as e:  # noqa: BLE001 - shown in the view
        return {"t": time.monotonic(), "error": str(e), "samples": {}}
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return {"t": time.monotonic(), "samples": samples}


def _sum(snap: dict, name: str, **match) -> float:
    tot = 0.0
    for (n, labels), v in snap.get("samples", {}).items():
        if n == name and all(dict(labels).get(k) == val for k, val in match.items()):
            tot += v
    return tot


def _labels_of(snap: dict, name: str, key: str) -> list[str]:
    return sorted({dict(labels).get(key) for (n, labels) in snap.get("samples", {}) if n == name} - {None},
                  key=lambda x: (len(x), x))


def _hist_mean(snap, prev, name, **match) -> float | None:
    s = _sum(snap, name + "_sum", **match) - (_sum(prev, name + "_sum", **match) if prev else 0)
    c = _sum(snap, name + "_count", **match) - (_sum(prev, name + "_count", **match) if prev else 0)
    return s / c if c > 0 else None


def summarize(endpoints: list[str], cur: dict, prev: dict | None) -> dict:
    """Numbers the view shows: per shard, per worker, and cluster totals."""
    servers, workers, errors = [], [], []
    for ep in endpoints:
        snap, old = cur[ep], (prev or {}).get(ep)
        if snap.get("error"):
            errors.append({"endpoint": ep, "error": snap["error"]})
            continue
        dt = (snap["t"] - old["t"]) if old and not old.get("error") else None
        if old is not None and old.get("error"):
            old = None

        def rate(name, **m):
            if not dt or dt <= 0:
                return None
            return (_sum(snap, name, **m) - _sum(old, name, **m)) / dt

        for sid in _labels_of(snap, "deltaps_server_pushes_total", "shard"):
            m = {"shard": sid}
            servers.append({
                "endpoint": ep, "shard": int(sid),
                "pushes_total": _sum(snap, "deltaps_server_pushes_total", **m),
                "pushes_per_s": rate("deltaps_server_pushes_total", **m),
                "pulls_per_s": rate("deltaps_server_pulls_total", **m),
                "in_wire_bytes_per_s": rate("deltaps_server_received_bytes_total", **m),
                "in_raw_bytes_per_s": rate("deltaps_server_received_raw_bytes_total", **m),
                "out_bytes_per_s": rate("deltaps_server_sent_bytes_total", **m),
                "received_bytes_total": _sum(snap, "deltaps_server_received_bytes_total", **m),
                "version_min": _sum(snap, "deltaps_server_key_version_min", **m),
                "version_max": _sum(snap, "deltaps_server_key_version_max", **m),
                "live_workers": _sum(snap, "deltaps_server_live_workers", **m),
                # over the window; lifetime mean when nothing was applied in it (or only one scrape)
                "staleness_mean": _first(_hist_mean(snap, old, "deltaps_server_staleness_versions", **m) if old else None,
                                         _hist_mean(snap, None, "deltaps_server_staleness_versions", **m)),
                "staleness_max": _sum(snap, "deltaps_server_staleness_max_versions", **m),
                "apply_mean_s": _hist_mean(snap, old, "deltaps_server_apply_seconds", **m),
                "rejected_total": _sum(snap, "deltaps_server_rejected_requests_total", **m),
            })
        for wid in _labels_of(snap, "deltaps_worker_steps_total", "worker"):
            m = {"worker": wid}
            parts = {}
            for k in ("compute", "comm", "wait"):
                name = f"deltaps_worker_{k}_seconds_total"
                parts[k] = (_sum(snap, name, **m) - _sum(old, name, **m)) if old else _sum(snap, name, **m)
            tot = sum(parts.values())
            last = _sum(snap, "deltaps_worker_last_step_timestamp_seconds", **m)
            codecs = [dict(lbl).get("codec") for (n, lbl) in snap["samples"]
                      if n == "deltaps_worker_codec_info" and dict(lbl).get("worker") == wid]
            gpu = [v for (n, lbl), v in snap["samples"].items()
                   if n == "deltaps_gpu_utilization_ratio" and dict(lbl).get("worker") == wid]
            workers.append({
                "endpoint": ep, "worker": int(wid),
                "steps_total": _sum(snap, "deltaps_worker_steps_total", **m),
                "steps_per_s": rate("deltaps_worker_steps_total", **m),
                "samples_per_s": rate("deltaps_worker_samples_total", **m)
                if dt else _sum(snap, "deltaps_worker_samples_per_second", **m),
                "push_rpcs_total": _sum(snap, "deltaps_worker_push_rpcs_total", **m),
                "pushed_wire_bytes_per_s": rate("deltaps_worker_pushed_wire_bytes_total", **m),
                "compression_ratio": _sum(snap, "deltaps_worker_compression_ratio", **m),
                "compute_share": parts["compute"] / tot if tot else None,
                "transfer_share": parts["comm"] / tot if tot else None,
                "comm_share": (parts["comm"] + parts["wait"]) / tot if tot else None,   # transfers + waiting
                "wait_share": parts["wait"] / tot if tot else None,
                "loss": _sum(snap, "deltaps_worker_loss", **m),
                "last_step_age_s": time.time() - last if last else None,
                "codec": codecs[0] if codecs else "",
                "gpu_util": max(gpu) if gpu else None,
                "fallbacks_total": _sum(snap, "deltaps_worker_codec_fallbacks_total", **m),
            })
    def tot(rows, k):
        vals = [r[k] for r in rows if r[k] is not None]
        return sum(vals) if vals else None
    stale = [r["staleness_mean"] for r in servers if r["staleness_mean"] is not None]
    comm = [r["comm_share"] for r in workers if r["comm_share"] is not None]
    cluster = {
        "shards": len(servers), "workers": len(workers),
        "pushes_per_s": tot(servers, "pushes_per_s"), "samples_per_s": tot(workers, "samples_per_s"),
        "in_wire_bytes_per_s": tot(servers, "in_wire_bytes_per_s"),
        "in_raw_bytes_per_s": tot(servers, "in_raw_bytes_per_s"),
        "pushes_total": tot(servers, "pushes_total"), "worker_push_rpcs_total": tot(workers, "push_rpcs_total"),
        "staleness_mean": sum(stale) / len(stale) if stale else None,
        "staleness_max": max((r["staleness_max"] for r in servers), default=None),
        "comm_share": sum(comm) / len(comm) if comm else None,
        "load_imbalance": _imbalance([r["in_wire_bytes_per_s"] or r["received_bytes_total"] for r in servers]),
    }
    return {"cluster": cluster, "servers": sorted(servers, key=lambda r: r["shard"]),
            "workers": sorted(workers, key=lambda r: r["worker"]), "errors": errors}


def _first(*vals):
    return next((v for v in vals if v is not None), None)


def _imbalance(vals):
    vals = [v for v in vals if v is not None]
    if not vals or max(vals) <= 0:
        return None
    return max(vals) / (sum(vals) / len(vals))


def _f(v, fmt="{:.1f}", none="-"):
    return none if v is None else fmt.format(v)


def _mb(v):
    return _f(None if v is None else v / (1 << 20), "{:.2f}")


def _pct(v):
    return _f(None if v is None else 100 * v, "{:.0f}%")


def render(s: dict) -> str:
    c = s["cluster"]
    lines = [f"deltaps top — {time.strftime('%H:%M:%S')}   shards {c['shards']}  workers {c['workers']}",
             f"cluster: pushes/s {_f(c['pushes_per_s'])}  samples/s {_f(c['samples_per_s'])}  "
             f"in {_mb(c['in_wire_bytes_per_s'])} MiB/s wire / {_mb(c['in_raw_bytes_per_s'])} raw  "
             f"staleness mean {_f(c['staleness_mean'], '{:.2f}')} max {_f(c['staleness_max'], '{:.0f}')}  "
             f"comm share {_pct(c['comm_share'])}  shard imbalance {_f(c['load_imbalance'], '{:.2f}x')}",
             "",
             f"{'SHARD':>5} {'PUSH/s':>8} {'PULL/s':>8} {'IN MiB/s':>9} {'RAW MiB/s':>9} {'OUT MiB/s':>9} "
             f"{'VERSION':>11} {'LIVE':>4} {'STALE':>6} {'MAXST':>5} {'APPLY ms':>8} {'REJ':>4}  ENDPOINT"]
    for r in s["servers"]:
        lines.append(f"{r['shard']:>5} {_f(r['pushes_per_s']):>8} {_f(r['pulls_per_s']):>8} "
                     f"{_mb(r['in_wire_bytes_per_s']):>9} {_mb(r['in_raw_bytes_per_s']):>9} {_mb(r['out_bytes_per_s']):>9} "
                     f"{int(r['version_min']):>5}-{int(r['version_max']):<5} {int(r['live_workers']):>4} "
                     f"{_f(r['staleness_mean'], '{:.2f}'):>6} {int(r['staleness_max']):>5} "
                     f"{_f(None if r['apply_mean_s'] is None else r['apply_mean_s'] * 1e3, '{:.2f}'):>8} "
                     f"{int(r['rejected_total']):>4}  {r['endpoint']}")
    lines += ["", f"{'WORKER':>6} {'STEP/s':>7} {'SAMP/s':>8} {'COMPUTE':>7} {'COMM':>5} {'WAIT':>5} "
                  f"{'PUSH MiB/s':>10} {'RATIO':>6} {'LOSS':>8} {'AGE s':>6} {'GPU':>5} {'CODEC':<10} ENDPOINT"]
    for r in s["workers"]:
        lines.append(f"{r['worker']:>6} {_f(r['steps_per_s']):>7} {_f(r['samples_per_s']):>8} "
                     f"{_pct(r['compute_share']):>7} {_pct(r['transfer_share']):>5} {_pct(r['wait_share']):>5} "
                     f"{_mb(r['pushed_wire_bytes_per_s']):>10} {_f(r['compression_ratio'], '{:.1f}x'):>6} "
                     f"{_f(r['loss'], '{:.4f}'):>8} {_f(r['last_step_age_s']):>6} {_pct(r['gpu_util']):>5} "
                     f"{r['codec'][:10]:<10} {r['endpoint']}")
    for e in s["errors"]:
        lines.append(f"! {e['endpoint']}: {e['error']}")
    return "\n".join(lines)


def _scrape_all(urls, timeout):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return dict(zip(urls, pool.map(lambda u: scrape(u, timeout), urls)))


def cmd_top(args) -> int:
    urls = [_url(e) for e in args.endpoints.split(",") if e.strip()]
    if not urls:
        raise ValueError("--metrics needs at least one host:port")
    prev = None
    if args.once:
        if args.interval > 0:
            prev = _scrape_all(urls, args.timeout)
            time.sleep(args.interval)
        s = summarize(urls, _scrape_all(urls, args.timeout), prev)
        print(json.dumps(s, indent=2) if args.json else render(s), flush=True)
        return 0 if len(s["errors"]) < len(urls) else 1
    tty = sys.stdout.isatty()
    try:
        while True:
            cur = _scrape_all(urls, args.timeout)
            text = render(summarize(urls, cur, prev))
            print(("\x1b[H\x1b[2J" if tty else "") + text + ("" if tty else "\n"), flush=True)
            prev = cur
            time.sleep(max(0.1, args.interval))
    except KeyboardInterrupt:
        return 0
