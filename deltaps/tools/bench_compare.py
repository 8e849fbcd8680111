"""`deltaps bench compare`: DDP (plain or with torch's comm hooks) vs deltaps PS codecs, side by side, on a
shaped network:  deltaps bench compare --workers 4 --bandwidth 1gbit --modes ddp,ddp:fp16,ps:int8 --json o.json

Each process (PS shard or worker) gets a network namespace of its own, linked to a bridge by a veth pair shaped
with tbf in both directions (deltaps/tools/netns.py), so all traffic between processes crosses `--bandwidth` links.
Modes run back to back in one invocation on the same topology, with the same model, data, seed, optimizer and
steps; speed-ups and accuracy deltas are against the fp32 DDP run (`allreduce` or `ddp`) of the same invocation.
With --eval-every / --target-accuracy (ctr: --target-auc) every mode races to a test accuracy (AUC) and the report
leads with the time to reach it (deltaps/tools/bench_report.py).
Without root / iproute2, or with --no-shaping, everything runs on loopback and the report says so.

Mode specs: the grammar of deltaps/strategies.py (ddp[:<hook>], ps[:<codec spec>], ps-local<H>[x<F>][o<tau>]:<codec
spec>, torchft:diloco:sync=H, hybrid, torchrec); a PS spec's shards=N runs on the first N of the --servers shards.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from deltaps.config import DEVICES, save_config
from deltaps.strategies import parse_mode_spec, split_mode_specs
from deltaps.tools import bench_faults, bench_figures, bench_plot, bench_protocol, bench_report, bench_seeds, cpu_roles, netns
from deltaps.tools.bench_nodes import Nodes, cpu_figures, topology_nodes
from deltaps.tools.children import install_signal_handlers, restore_signal_handlers
from deltaps.tools.cpu_caps import CapsUnavailable, CpuCaps
from deltaps.tools.launch import free_port, start_lighthouse, wait_port_file, workers_failed
from deltaps.tools.process_tree import stop_processes
from worker.trainers.strategy import load_job
from worker.workloads import available_workloads, workload_class
from worker.workloads.clf import HIDDEN as CLF_HIDDEN

IN_FEATURES, CLASSES = 64, 10


def mlp_params(hidden: int, layers: int) -> int:
    return (IN_FEATURES * hidden + hidden) + (layers - 1) * (hidden * hidden + hidden) + hidden * CLASSES + CLASSES


def hidden_for_params(n: int, layers: int) -> int:
    """Smallest hidden width whose MLP has at least n parameters."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        if mlp_params(mid, layers) >= n:
            hi = mid
        else:
            lo = mid + 1
    return lo


def parse_mode(spec: str) -> dict:
    """A mode spec (the grammar of deltaps/strategies.py) -> TrainConfig overrides."""
    return parse_mode_spec(spec).overrides()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaps bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=None,
                   help="PS shards for the ps modes (default: as many as workers, as BytePS recommends: "
                        "every shard link carries workers x its share of the model)")
    p.add_argument("--bandwidth", default="1gbit", help="per-process link rate, each direction (tc syntax)")
    p.add_argument("--latency", default=None, help="one-way process-to-process latency (needs netem)")
    p.add_argument("--modes", default="allreduce,ps:none,ps:int8,ps:topk:ratio=0.01",
                   help="comma-separated mode specs (deltaps/strategies.py; an item with '=' and no ':' continues "
                        "the previous spec: ps:topk:ratio=0.01,chunk=4096)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=None, help=f"MLP hidden width (default 2048; {CLF_HIDDEN}: clf)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model-params", type=int, default=None, help="size the MLP to about this many parameters "
                   "(sets --hidden for the given --layers)")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="run every mode with seeds --seed .. --seed + N - 1 (model "
                   "init and data order), seed-major; each figure is the median over the seeds, time to target with "
                   "its min-max range (deltaps/tools/bench_seeds.py)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-RPC / collective timeout, seconds")
    p.add_argument("--workload", default=None, choices=available_workloads(),
                   help="mlp (digits MLP), clf (MLP on a synthetic 10-class task that takes hundreds of steps: the "
                        "time-to-accuracy race) or ctr (click-through model with a large embedding table); default ctr "
                        "when --modes has hybrid, else mlp")
    p.add_argument("--outer-optimizer", default="nesterov", help="ps-local modes: the shards' outer optimizer")
    p.add_argument("--outer-lr", type=float, default=None, help="ps-local modes: outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=None, help="ps-local modes: outer momentum")
    p.add_argument("--eval-every", type=int, default=0,
                   help="every worker evaluates test accuracy (ctr: test AUC) every N steps (not on the clock); 0 = off")
    p.add_argument("--target-accuracy", type=float, default=0.0,
                   help="each mode stops at the first evaluation reaching this test accuracy (or at --steps); the "
                        "report leads with the time to reach it (needs --eval-every; 0 = off)")
    p.add_argument("--target-auc", type=float, default=0.0, help="--workload ctr: as --target-accuracy, test AUC")
    p.add_argument("--target-loss", type=float, default=0.0,
                   help="--workload lm: as --target-accuracy, on the test loss in bits per byte (reached at or below)")
    p.add_argument("--common-step", type=int, default=None,
                   help="every mode trains on past its target to step S and reports its test metric there (default: "
                        "the largest steps to target of the race; modes that stopped before it report null)")
    p.add_argument("--time-cap", type=float, default=None,
                   help="stop a mode once its training time passes X x the best peer's time to target in the same "
                        "seed (peers run first): 'not reached within the cap', never extrapolated")
    p.add_argument("--select-on", choices=("test", "validation"), default="test",
                   help="what every mode's evaluations (and the target) measure: test, or a validation split held out "
                        "of the training data (to choose outer lr / momentum / H / tau / fragments; test untouched)")
    p.add_argument("--embedding-rows", type=int, default=1_000_000, help="ctr: embedding table rows")
    p.add_argument("--embedding-dim", type=int, default=64, help="ctr: embedding width")
    p.add_argument("--embedding-fields", type=int, default=8, help="ctr: categorical fields per sample")
    p.add_argument("--embedding-optimizer", default="adagrad", help="ctr: table optimizer (sgd, adagrad, adam)")
    p.add_argument("--embedding-lr", type=float, default=0.05, help="ctr: table learning rate")
    p.add_argument("--zipf-a", type=float, default=1.1, help="ctr: Zipf exponent of the ids")
    p.add_argument("--ps-params", default="embedding", help="hybrid: modules on the PS (embedding or patterns)")
    p.add_argument("--id-drift", type=float, default=0.0, help="ctr: share of the ids renewed every --drift-every steps")
    p.add_argument("--drift-every", type=int, default=100, help="ctr with --id-drift: steps per id epoch")
    p.add_argument("--worker-memory-limit", default="", help="every worker caps its data memory (RLIMIT_DATA), e.g. 1GiB")
    bench_faults.add_arguments(p)
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="where every mode's workers train (cpu; cuda: NCCL for ddp, one GPU per worker)")
    p.add_argument("--cpus-per-worker", type=float, default=None,
                   help="cap every worker's process tree at X cores (a cgroup each, needs root), so no worker gets "
                        "the CPU another leaves idle, as on machines of their own (deltaps/tools/cpu_caps.py)")
    p.add_argument("--colocate", action="store_true",
                   help="run the shards (and torchft's Lighthouse) on the workers' machines: shard i in worker i mod W's "
                        "namespace, link and CPU cap, so ps modes use the peers' W links instead of S + W")
    p.add_argument("--no-shaping", action="store_true", help="plain loopback, no namespaces")
    p.add_argument("--no-zygotes", action="store_true",
                   help="start every shard and worker as a fresh interpreter instead of forking it from its node's "
                        "zygote, which imported torch once (deltaps/tools/zygote.py; start-up only, off the clock)")
    p.add_argument("--netns-prefix", default=netns.PREFIX,
                   help="name prefix of the namespaces/links this run creates (and whose stale leftovers it removes)")
    p.add_argument("--json", help="write the report JSON here")
    p.add_argument("--plot", help="write a PNG (step-time split and accuracy per mode) here")
    p.add_argument("--keep-logs", action="store_true", help="keep the log directory (printed); a run that failed keeps it anyway")
    return p


def run_mode(spec: str, base: dict, args, net: Nodes, tmp: str, cap_s: float | None = None, kills=(),
             slow: tuple[int, float] | None = None) -> dict:
    """One run of a mode; kills: a fault script; slow: (rank, factor) of a capped straggler (bench_faults.py)."""
    d = os.path.join(tmp, spec.replace(":", "_").replace("=", "-").replace("/", "_"))
    os.makedirs(d, exist_ok=True)
    eval_log = os.path.join(d, "evals{rank}.jsonl")      # each rank's evaluations as they happen (cap, kills, CPU)
    mode = parse_mode_spec(spec)
    elastic = mode.elastic                      # ddp-elastic: under torchrun, from checkpoints (bench_faults.py)
    ckpt = os.path.join(d, "checkpoint")        # d is this seed's and variant's: every run starts afresh
    cfg = load_job(None, {**base, **mode.overrides(), "eval_log": eval_log, "eval_cache": os.path.join(d, "evals"),
                          "servers": mode.shards or args.servers, **({"ddp_checkpoint_dir": ckpt} if elastic else {})})
    cfg_path = os.path.join(d, "config.yaml")
    save_config(cfg, cfg_path)
    S, W = mode.shards or args.servers, args.workers     # a spec's shards=N: the first N shard nodes
    worker_nodes = list(range(args.servers, args.servers + W))    # nodes 0..servers-1 are shards, then workers
    servers, workers, script, slowing, roles = [], [], None, None, None
    t0 = time.perf_counter()
    try:
        if cfg.mode in ("ps", "hybrid"):
            port_files, server_logs = [[os.path.join(d, f"server{i}.{ext}") for i in range(S)] for ext in ("port", "log")]
            for i in range(S):
                servers.append(net.spawn(i, ["server", "--host", net.addr(i), "--port", "0", "--shard-id", str(i),
                                             "--num-shards", str(S), "--port-file", port_files[i],
                                             "--wait-timeout", str(args.timeout * 2)], server_logs[i]))
            addrs = [f"{net.addr(i)}:{wait_port_file(port_files[i], p, log=server_logs[i])}" for i, p in enumerate(servers)]
            target = ["--servers", ",".join(addrs)]
            if cfg.mode == "hybrid":   # + the gloo rendezvous of the dense part
                target += ["--master-addr", net.addr(worker_nodes[0]), "--master-port",
                           str(29500 if net.topo else free_port())]
        elif cfg.mode == "torchft":    # torchft's Lighthouse on a shard node (torchft has no shards)
            servers.append(start_lighthouse(net.addr(0), cfg.torchft_min_replicas or W,
                                            lambda argv: net.spawn(0, argv, os.path.join(d, "lighthouse.log")),
                                            29510 if net.topo else None))
            target = ["--lighthouse", servers[-1].url]
        elif elastic:     # torchrun's agents rendezvous (c10d, on worker node 0) and set every rank's environment
            target = []
            rendezvous = f"{net.addr(worker_nodes[0])}:{29400 if net.topo else free_port()}"
        else:
            port = 29500 if net.topo else free_port()
            target = ["--master-addr", net.addr(worker_nodes[0]), "--master-port", str(port)]
        before, cpu_before = net.counters(worker_nodes), net.cpu(worker_nodes)

        def launch(r: int, first_start: bool = False) -> subprocess.Popen:     # a restart (bench_faults) is not
            node = worker_nodes[r]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": net.ifname(node)}
            files = ["--config", cfg_path, "--result-json", os.path.join(d, f"worker{r}.json"), "--no-progress"]
            log = os.path.join(d, f"worker{r}.log")      # appended: a restarted worker's log follows its first
            if elastic:
                return bench_faults.start_torchrun_worker(net, node, W, rendezvous, r == 0, files, log, env)
            # torchft's replicas meet before their clocks start on a job's first start (a restarted one heals at a sync)
            first = ["--torchft-first-quorum"] if first_start and cfg.mode == "torchft" else []
            return net.spawn(node, ["worker", *target, "--rank", str(r), "--world-size", str(W), *files, *first], log,
                             env, append=True)
        workers.extend(launch(r, first_start=True) for r in range(W))
        if slow:
            slowing = bench_faults.CapOnceTraining(net.caps, worker_nodes[slow[0]], slow[1],
                                                   eval_log.replace("{rank}", str(slow[0])))
            slowing.start()
        if kills:         # --kill: a fault script against the running workers (bench_faults.py)
            script = bench_faults.KillScript(kills, workers, launch,
                                             bench_faults.training_clock(eval_log.replace("{rank}", "0")))
            script.start()
        logs = [eval_log.replace("{rank}", str(r)) for r in range(W)]
        roles = cpu_roles.CpuRoles(workers, servers, lambda: all(map(bench_protocol.started, logs)))
        roles.start()
        failed = bench_protocol.wait_within_cap(workers, cfg.timeout_s * 4 + 60 + cfg.steps * 5.0, logs, cap_s)
        if failed is None:
            return bench_protocol.capped_run(bench_protocol.read_eval_logs(logs), cap_s, args.time_cap)
        if failed:
            raise workers_failed(failed, d, f"mode {spec}: ")
        after, cpu_after = net.counters(worker_nodes), net.cpu(worker_nodes)
    finally:
        if roles is not None:
            roles.stop()
        if script is not None:
            script.stop()
            script.join(10)
        if slowing is not None:
            slowing.stop()
        stop_processes(workers)
        stop_processes(servers)
    results = sorted((json.load(open(path)) for path in (os.path.join(d, f"worker{r}.json") for r in range(W))
                      if os.path.exists(path)), key=lambda r: r["rank"])   # --kill: a rank killed for good leaves none;
    # ddp-elastic: node r's result may be another rank's (torchrun's rendezvous assigns the ranks)
    out = {**bench_figures.mode_figures(cfg, results, time.perf_counter() - t0, before, after, worker_nodes),
           **cpu_figures(cpu_before, cpu_after), **roles.figures(), "start_skew_s": bench_protocol.start_skew_s(logs),
           **({"shards": S} if servers and cfg.mode in ("ps", "hybrid") else {})}
    return {**out, "kills": script.events} if script is not None else out


def compare(args) -> dict:
    if args.servers is None:
        args.servers = args.workers
    bench_protocol.check_args(args)
    specs = split_mode_specs(args.modes)
    if len(set(specs)) != len(specs):
        raise ValueError("duplicate mode specs")
    if args.workload is None:
        ctr = any(m.family in ("hybrid", "torchrec") or m.sparse_embeddings for m in map(parse_mode_spec, specs))
        args.workload = "ctr" if ctr else "mlp"
    if args.hidden is None:
        args.hidden = CLF_HIDDEN if args.workload == "clf" else 2048
    hidden = hidden_for_params(args.model_params, args.layers) if args.model_params else args.hidden
    base = {"workers": args.workers, "servers": args.servers, "steps": args.steps, "batch_size": args.batch_size,
            "hidden": hidden, "layers": args.layers, "optimizer": args.optimizer, "lr": args.lr, "seed": args.seed,
            "timeout_s": args.timeout, "progress": False, "workload": args.workload, "device": args.device,
            "embedding_rows": args.embedding_rows, "embedding_dim": args.embedding_dim,
            "embedding_fields": args.embedding_fields, "embedding_optimizer": args.embedding_optimizer,
            "embedding_lr": args.embedding_lr, "zipf_a": args.zipf_a, "ps_params": args.ps_params,
            "id_drift": args.id_drift, "drift_every": args.drift_every, "worker_memory_limit": args.worker_memory_limit,
            "eval_every": args.eval_every, "target_accuracy": args.target_accuracy, "target_auc": args.target_auc,
            "target_loss": args.target_loss, "common_step": args.common_step or 0,
            "eval_split": args.select_on, "outer_optimizer": args.outer_optimizer,
            **{k: v for k, v in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum)) if v is not None},
            # a fair fight: no auto-rollback to uncompressed gradients in the middle of a measurement
            "fallback_factor": 0.0}
    bench_faults.check(args)
    for mode in map(parse_mode_spec, specs):   # fail fast on a bad spec, before any namespace exists
        load_job(None, {**base, **mode.overrides()})
        if (mode.shards or 0) > args.servers:
            raise ValueError(f"mode {mode.text!r}: shards={mode.shards} is more than --servers {args.servers}")
    report = {"workers": args.workers, "servers": args.servers, "bandwidth": args.bandwidth,
              "latency": args.latency, "shaped": False, "steps": args.steps, "batch_size": args.batch_size,
              "optimizer": args.optimizer, "lr": args.lr, "seed": args.seed, "hidden": hidden, "layers": args.layers,
              "seeds": list(range(args.seed, args.seed + args.seeds)),
              "model_params": bench_figures.model_params(base), "host_cpus": os.cpu_count(),
              "network": {"notes": []}, "modes": {}, "workload": args.workload,
              "eval_every": args.eval_every, "device": args.device, "common_step": args.common_step,
              "time_cap": args.time_cap, "select_on": args.select_on,
              "faults": {"straggler": args.straggler or None, "kill": [str(k) for k in args.kill]}}
    if args.workload == "ctr":
        dense = (args.embedding_fields * args.embedding_dim + 13) * hidden + hidden
        dense += (args.layers - 1) * (hidden * hidden + hidden) + hidden + 1
        report["model_params"] = args.embedding_rows * args.embedding_dim + dense
        report["embedding"] = {"rows": args.embedding_rows, "dim": args.embedding_dim, "fields": args.embedding_fields,
                               "optimizer": args.embedding_optimizer, "lr": args.embedding_lr, "zipf_a": args.zipf_a,
                               "id_drift": args.id_drift, "drift_every": args.drift_every}
    ok, why = netns.shaping_available()
    topo = None
    if args.no_shaping or not ok:
        reason = "--no-shaping given" if args.no_shaping else why
        report["network"]["description"] = f"plain loopback, NOT shaped ({reason}); --bandwidth ignored"
        report["network"]["notes"].append(f"ran on loopback without bandwidth limit: {reason}")
        if args.latency:
            report["network"]["notes"].append("latency NOT applied (loopback run)")
    else:
        topo = netns.Topology(topology_nodes(args.servers, args.workers, args.colocate), rate=args.bandwidth,
                              latency=args.latency, prefix=args.netns_prefix)
    caps = CpuCaps(args.cpus_per_worker, range(args.servers, args.servers + args.workers), args.netns_prefix) \
        if args.cpus_per_worker else None
    tmp = tempfile.mkdtemp(prefix="deltaps-compare-")     # logs, evaluations, zygotes: removed unless --keep-logs
    net = Nodes(topo, caps, servers=args.servers, workers=args.workers, colocate=args.colocate,
                zygotes=not args.no_zygotes, workdir=os.path.join(tmp, "zygotes"))
    report["network"]["colocated"] = args.colocate
    old = install_signal_handlers()
    try:
        if topo:
            topo.up()
            report["shaped"] = True
            report["latency_applied"] = topo.latency_applied
            report["network"]["description"] = topo.describe()
            report["network"]["notes"] += topo.notes
            try:
                w0, w1 = net.topology_index(args.servers), net.topology_index(args.servers + 1 if args.workers > 1 else 0)
                if w0 != w1:
                    bps = netns.measure_throughput(topo, w0, w1, int(min(64 << 20, max(4 << 20, topo.rate_bps / 8 / 4))))
                    report["network"]["measured_link_gbit_s"] = bps / 1e9
            except Exception as e:  # noqa: BLE001 - a failed probe is reported, not fatal
                report["network"]["notes"].append(f"link throughput probe failed: {e}")
        if caps:
            caps.up()
            report["cpu_caps"] = caps.describe()
        net.start_zygotes(range(args.servers + args.workers))    # after the link probe: their imports take the CPU
        print(bench_report.header(report), flush=True)
        runs: dict[str, list[dict]] = {spec: [] for spec in specs}
        healthy: dict[str, list[dict]] = {spec: [] for spec in specs}     # --straggler / --kill: the same, no faults
        # the order turns round every other seed; with a time cap the peers' best time to target sets it
        runs_of = ((i, seed, spec, v) for i, seed in enumerate(report["seeds"])
                   for spec in bench_seeds.run_order(specs, i, bool(args.time_cap), bench_report.is_peer)
                   for v in bench_faults.variants(args))
        for i, seed, spec, (variant, faults, kills) in runs_of:
            store = healthy if variant == "healthy" else runs
            print(f"-- running {spec}{f' (seed {seed})' if args.seeds > 1 else ''}"
                  f"{f' {variant}' if variant else ''} ...", flush=True)
            cap_s = None if bench_report.is_peer(spec) else bench_seeds.live_cap(
                store, report["seeds"], i, args.time_cap, bench_report.is_peer)
            try:
                h = healthy[spec][-1] if healthy[spec] else {}
                kills = [k.resolved(h.get("time_to_target_s")) for k in kills]    # P% of the healthy run
                faults, slow = bench_faults.straggler_by_cap(faults, caps, args.workers)
                m = run_mode(spec, {**base, "seed": seed, **faults}, args, net,
                             os.path.join(tmp, f"seed{seed}{variant}"), cap_s, kills, slow)
                if slow and "compute_s_per_step_per_worker" in m:
                    m["straggler"] = bench_faults.capped_straggler_figures(*slow, m["compute_s_per_step_per_worker"])
                store[spec].append({**m, "seed": seed})
                if m.get("capped"):
                    print(f"   {m['capped']} (stopped at step {m['steps']})", flush=True)
                    continue
                reached = "" if not getattr(args, workload_class(args.workload).target_field) else (
                    f", target not reached in {m['steps']} steps" if m.get("time_to_target_s") is None else
                    f", target reached at step {m['steps_to_target']} after {m['time_to_target_s']:.2f} s")
                print(f"   median step {m['median_step_s'] * 1e3:.1f} ms, test acc {m['final_test_accuracy'] * 100:.2f} %"
                      + reached + cpu_roles.describe(m), flush=True)
            except Exception as e:  # noqa: BLE001 - one run's failure is the report's to say; the others still run
                store[spec].append({"error": str(e), "seed": seed})
                print(f"   FAILED: {e}", file=sys.stderr, flush=True)
        for store in (runs, healthy) if healthy[specs[0]] else (runs,):
            for i in range(len(report["seeds"])):    # the race protocol is judged within each seed
                race = {spec: r[i] for spec, r in store.items()}
                cap_s = bench_protocol.cap_seconds([m for k, m in race.items() if bench_report.is_peer(k)],
                                                   args.time_cap)
                for m in race.values():
                    bench_protocol.apply_time_cap(m, cap_s, args.time_cap)
                if args.eval_every:
                    bench_protocol.add_metric_at_common_step(race, bench_report.metric_of(report), args.common_step)
        report["modes"] = {spec: bench_seeds.merge(r) if args.seeds > 1 else r[0] for spec, r in runs.items()}
        if healthy[specs[0]]:
            bench_faults.add_goodput(report, {spec: bench_seeds.merge(r) if args.seeds > 1 else r[0]
                                              for spec, r in healthy.items()})
    finally:
        net.close()
        if caps:
            caps.down()
        if topo:
            topo.down()
            left = netns.list_leftovers(topo.prefix)
            report["network"]["teardown_clean"] = not (left["netns"] or left["links"])
        restore_signal_handlers(old)
    report["failed_runs"] = failed = [spec + (" (healthy)" if store is healthy else "") for store in (runs, healthy)
                                      for spec, r in store.items() if any("error" in m for m in r)]
    if args.keep_logs or failed:      # a failed run's error names its directory in tmp: keep it
        print(f"logs: {tmp}" + (f" (kept: {len(failed)} mode(s) failed)" if failed and not args.keep_logs else ""))
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    bench_report.add_speedups(report)
    bench_report.add_time_to_accuracy(report, getattr(args, workload_class(args.workload).target_field))
    bench_report.add_common_step_deltas(report)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = compare(args)
    except (netns.PrefixInUse, CapsUnavailable) as e:
        print(f"deltaps bench compare: {e}", file=sys.stderr)
        return 2
    print()
    print(bench_report.header(report))
    print(bench_report.format_table(report))
    print("speed-up = allreduce median step / mode median step (same invocation); "
          "sent/step = bytes one worker sends per step (app level); veth tx/step = measured on the worker's link")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        bench_plot.plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if report["failed_runs"] else 0
