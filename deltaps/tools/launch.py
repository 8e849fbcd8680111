"""`deltaps launch`: a local cluster of real processes on loopback — shards, then workers — and a summary."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time

from deltaps.cli.lighthouse import torchft_missing
from deltaps.config import TrainConfig, save_config
from deltaps.errors import JobFailed
from deltaps.tools.process_tree import ask_for_stacks, stop_processes
from deltaps.tools.zygote import Starter
from worker.trainers.strategy import strategy_class


def wait_port_file(path: str, proc: subprocess.Popen, timeout: float = 60.0, log: str | None = None,
                   what: str = "server") -> int:
    """The port a child (`what`: a server, a server's or a worker's metrics exporter) wrote to path; a child that
    exits first, or never writes it, fails the job (JobFailed) naming log and its tail."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if os.path.exists(path):
            return int(open(path).read())
        if proc.poll() is not None:
            raise JobFailed(f"{what} exited with code {proc.returncode} before listening" + _log_tail(log))
        time.sleep(0.05)
    raise JobFailed(f"{what} did not start listening in {timeout:g} s" + _log_tail(log))


def _log_tail(log: str | None) -> str:
    return f" (log {log}):\n{tail_file(log)}" if log else ""


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a child to listen on (a torch rendezvous, a Prometheus), picked below the kernel's ephemeral
    range: a port bind(0) gives lies inside it, and between the pick and the child's bind any outgoing
    connection (gloo, gRPC) may take it as its source port — CI saw the rendezvous fail with EADDRINUSE so."""
    import random
    import socket
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 20000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:    # every probe taken (a tiny ephemeral floor): the old way
        s.bind((host, 0))
        return s.getsockname()[1]


def tail_file(path: str, n: int = 30) -> str:
    try:
        return "".join(open(path).readlines()[-n:])
    except OSError:
        return ""


def _metrics_args(on: bool, host: str, port_file: str) -> list[str]:
    """Exporter flags for a server/worker process: a free port, written next to the gRPC port file."""
    return ["--metrics-port", "0", "--metrics-addr", host, "--metrics-port-file", port_file] if on else []


def launch(cfg: TrainConfig, json_path: str | None = None, host: str = "127.0.0.1", quiet: bool = False,
           metrics: bool = False, security=None, server_args: list[str] | None = None, zygote: bool = True) -> dict:
    """metrics: start a Prometheus exporter in every server and (ps-mode) worker; the summary's
    metrics_urls lists them (they live as long as the cluster does).
    security: a deltaps.security.LaunchSecurity; its token reaches the children as $DELTAPS_TOKEN (never argv),
    its TLS files as --tls-* flags.
    zygote: fork the shards and workers from one process that imported torch once (deltaps/tools/zygote.py: ~2 s of
    a core less per process); False: a fresh interpreter each."""
    from deltaps.security import LaunchSecurity
    security = security or LaunchSecurity()
    child_env = security.child_env()
    t_launch = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="deltaps-launch-")
    cfg_path = os.path.join(tmp, "config.yaml")
    save_config(cfg, cfg_path)
    servers, workers = [], []
    metrics_urls: list[str] = []
    needs = strategy_class(cfg.mode)    # what the mode needs beside its workers: shards, a rendezvous, a Lighthouse
    start = Starter(os.path.join(tmp, "zygote") if zygote else None, env=child_env).ready()
    drop_dir = False
    try:
        server_logs = [os.path.join(tmp, f"server{i}.log") for i in range(cfg.servers if needs.needs_servers else 0)]
        for i, log_path in enumerate(server_logs):
            with open(log_path, "w") as log:
                servers.append(start(["server", "--host", host, "--port", "0", "--shard-id", str(i),
                                      "--num-shards", str(cfg.servers), "--port-file", os.path.join(tmp, f"server{i}.port"),
                                      "--max-message-bytes", str(cfg.max_message_bytes),    # the job's, as its workers'
                                      *_metrics_args(metrics, host, os.path.join(tmp, f"server{i}.metrics.port")),
                                      *security.server.argv("server"), *(server_args or [])], log))
        addrs = [f"{host}:{wait_port_file(os.path.join(tmp, f'server{i}.port'), p, log=server_logs[i])}"
                 for i, p in enumerate(servers)]
        target = ["--servers", ",".join(addrs)] if needs.needs_servers else []
        if needs.collective:         # a gloo rendezvous (DDP, hybrid's dense allreduce, pipeline stages' p2p)
            target += ["--master-addr", host, "--master-port", str(free_port(host))]
        if needs.needs_lighthouse:
            replicas = cfg.torchft_min_replicas or cfg.workers      # the quorum's minimum
            with open(os.path.join(tmp, "lighthouse.log"), "w") as log:
                servers.append(start_lighthouse(host, replicas, lambda argv: start(argv, log)))
            target += ["--lighthouse", servers[-1].url]
        if not quiet and not needs.needs_servers:
            print(f"deltaps launch: {cfg.mode} ({' '.join(target)}); {cfg.workers} workers", flush=True)
        elif not quiet:
            print(f"deltaps launch: {cfg.servers} shards at {','.join(addrs)}; {cfg.workers} workers, "
                  f"sync={cfg.sync} codec={cfg.codec}", flush=True)
        for r in range(cfg.workers):
            show = r == 0 and cfg.progress and not quiet      # rank 0's progress bar on this terminal
            with contextlib.nullcontext() if show else open(os.path.join(tmp, f"worker{r}.log"), "w") as log:
                workers.append(start(
                    ["worker", *target, "--rank", str(r), "--world-size", str(cfg.workers),
                     "--config", cfg_path, "--result-json", os.path.join(tmp, f"worker{r}.json"),
                     "--progress" if show else "--no-progress",
                     *_metrics_args(metrics and cfg.mode == "ps", host, os.path.join(tmp, f"worker{r}.metrics.port")),
                     *(security.client.argv("client") if needs.needs_servers else [])],
                    log))
        if metrics:     # the shards' exporters (not a Lighthouse's: it has none), then the ps workers'
            metrics_urls = [f"http://{host}:{_metrics_port(tmp, f'server{i}', p, 'server')}/metrics"
                            for i, p in enumerate(servers[:len(server_logs)])]
            if cfg.mode == "ps":
                metrics_urls += [f"http://{host}:{_metrics_port(tmp, f'worker{r}', p, 'worker')}/metrics"
                                 for r, p in enumerate(workers)]
            if not quiet:
                print("deltaps launch: metrics at " + " ".join(metrics_urls), flush=True)
        failed = wait_workers(workers, cfg.timeout_s * 4 + 60 + cfg.steps * 2.0)
        if any(code == "timeout" for _, code in failed):
            ask_for_stacks(workers)
        if failed:
            raise workers_failed(failed, tmp)
    except JobFailed as e:      # the job's directory stays for its logs: say where
        raise e if tmp in str(e) else JobFailed(f"{e} (logs in {tmp})") from e
    except BaseException:       # not the children's failure (a bad flag, torchft missing, ^C): nothing to keep
        drop_dir = True
        raise
    finally:
        stop_processes(workers)
        stop_processes(servers)
        start.close()
        if drop_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    results = [json.load(open(os.path.join(tmp, f"worker{r}.json"))) for r in range(cfg.workers)]
    shutil.rmtree(tmp, ignore_errors=True)      # a failed job's directory stays: its error names it
    summary = summarize(cfg, results, time.perf_counter() - t_launch)
    summary["metrics_urls"] = metrics_urls
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _metrics_port(tmp: str, name: str, proc, what: str) -> int:
    return wait_port_file(os.path.join(tmp, f"{name}.metrics.port"), proc, log=os.path.join(tmp, f"{name}.log"),
                          what=f"{what} metrics exporter")


def start_lighthouse(host: str, replicas: int, spawn, port: int | None = None):
    """torchft's Lighthouse (`deltaps lighthouse`: torchft's own LighthouseServer) for `replicas` replica groups,
    bound to host:port (a free one by default), started by spawn(argv) (a zygote's fork or a fresh process, with its
    log); `.url` on the process it returns is where the Managers reach it."""
    why = torchft_missing()
    if why:
        raise ValueError(f"--mode torchft: {why}")
    port = port or free_port(host)
    # torchft_lighthouse's join timeout (60 s, `deltaps lighthouse`'s default: with every heartbeating replica joined a
    # quorum forms at once; below --min-replicas = the workers, a short one drops a replica a little late for a round,
    # which must then heal)
    proc = spawn(["lighthouse", "--bind", f"{host}:{port}", "--min-replicas", str(replicas), "--quorum-tick-ms", "10"])
    proc.url = f"http://{host}:{port}"
    return proc


def wait_workers(workers, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in workers]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad
        if all(c == 0 for c in codes):
            return []
        time.sleep(0.1)
    return [(r, "timeout") for r, p in enumerate(workers) if p.poll() is None]


def workers_failed(failed: list[tuple[int, int | str]], log_dir: str, job: str = "") -> JobFailed:
    """The error for workers (rank, exit code) that failed: each one's code and the tail of log_dir/worker<rank>.log."""
    logs = "\n".join(f"--- worker {r} (exit {c}) ---\n{tail_file(os.path.join(log_dir, f'worker{r}.log'))}"
                     for r, c in failed)
    return JobFailed(f"{job}{len(failed)} worker(s) failed (logs in {log_dir}):\n{logs}")


def summarize(cfg: TrainConfig, results: list[dict], launch_wall_s: float) -> dict:
    mean = lambda k: sum(r[k] for r in results) / len(results)  # noqa: E731
    total = lambda k: sum(r[k] for r in results)  # noqa: E731
    raw, wire = total("bytes_pushed_raw"), total("bytes_pushed_wire")
    r0 = results[0]
    steps = max(r.get("steps", cfg.steps) for r in results)   # fewer than cfg.steps when a target stopped the job
    return {
        "mode": cfg.mode, "sync": cfg.sync, "codec": cfg.codec, "workers": cfg.workers, "servers": cfg.servers,
        "device": r0.get("device", "cpu"), "steps": steps, "batch_size": cfg.batch_size, "optimizer": cfg.optimizer, "lr": cfg.lr,
        "model_params": r0["model_params"],
        "final_test_accuracy": r0["final_test_accuracy"],
        "final_train_loss": mean("final_train_loss"),
        "wall_s": max(r["wall_s"] for r in results), "launch_wall_s": launch_wall_s,
        "mean_step_s": mean("mean_step_s"), "median_step_s": mean("median_step_s"),
        "compute_s": mean("compute_s"), "comm_s": mean("comm_s"), "wait_s": mean("wait_s"),
        "samples_per_s": total("samples_per_s"),
        "bytes_pushed_wire": wire, "bytes_pushed_raw": raw, "bytes_pulled_wire": total("bytes_pulled_wire"),
        "compression_ratio": raw / wire if wire else 1.0,
        "payload_energy_share": _mean_or_none([r.get("payload_energy_share") for r in results]),
        "bytes_pushed_wire_per_step": wire / max(1, steps),
        "final_codec": r0["final_codec"], "codec_switches": r0["codec_switches"],
        "codec_fallbacks": sum(len(r["codec_fallbacks"]) for r in results),
        "server_stats": r0.get("server_stats", []),
        "per_worker": [{k: v for k, v in r.items() if k not in ("losses", "server_stats", "bytes_pushed_wire_steps")}
                       for r in results],
        "bytes_pushed_wire_steps_rank0": r0["bytes_pushed_wire_steps"],
        "loss_curve_rank0": r0["losses"][:: max(1, len(r0["losses"]) // 100)],
    }


def _mean_or_none(values: list) -> float | None:
    return None if not values or None in values else sum(values) / len(values)


def print_summary(s: dict) -> None:
    mb = 1 << 20
    print(f"\n== deltaps summary: mode={s['mode']} sync={s['sync']} codec={s['codec']} "
          f"workers={s['workers']} servers={s['servers']} steps={s['steps']} device={s['device']}")
    print(f"   final test accuracy : {s['final_test_accuracy'] * 100:.2f} %   (model params {s['model_params']:,})")
    print(f"   wall / step         : {s['wall_s']:.2f} s total, {s['mean_step_s'] * 1e3:.2f} ms mean step")
    tot = max(1e-12, s["compute_s"] + s["comm_s"] + s["wait_s"])
    print(f"   step split          : compute {s['compute_s'] / tot:.0%}, comm {s['comm_s'] / tot:.0%}, "
          f"wait {s['wait_s'] / tot:.0%}")
    print(f"   bytes pushed        : {s['bytes_pushed_wire'] / mb:.2f} MiB wire / {s['bytes_pushed_raw'] / mb:.2f} MiB raw "
          f"(x{s['compression_ratio']:.1f}); pulled {s['bytes_pulled_wire'] / mb:.2f} MiB")
    if s.get("payload_energy_share") is not None:      # local-update rounds
        print(f"   round payloads      : carried {s['payload_energy_share']:.1%} of the deltas + residuals "
              f"(squared L2 norm; the rest waits in the error feedback, or is dropped without it)")
