"""`deltaps` command line: server, worker, launch, ctl, bench."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from deltaps.config import WORKER_EXCLUDED, add_train_args, config_from_args
from deltaps.exporter import add_metrics_args
from deltaps.security import add_security_args
from deltaps.units import parse_bytes


def _servers(value: str) -> list[str]:
    addrs = [a.strip() for a in value.split(",") if a.strip()]
    if not addrs:
        raise argparse.ArgumentTypeError("need at least one host:port")
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"bad server address {a!r} (want host:port)")
    return addrs


# ---- discovery from the environment (Kubernetes StatefulSet / Indexed Job, torchrun); flags always win ----
def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"${name}={value!r} is not an integer") from None
    return None


def _ordinal(name: str) -> int | None:
    """Trailing ordinal of a StatefulSet pod name: 'deltaps-ps-3' -> 3; a plain integer is itself."""
    m = re.fullmatch(r"(?:.*-)?(\d+)", name.strip())
    return int(m.group(1)) if m else None


def resolve_server_env(args) -> None:
    """--shard-id / --num-shards when absent: $DELTAPS_SHARD_ID (an integer or a pod name ending in
    -<ordinal>), else the ordinal of $HOSTNAME when $DELTAPS_NUM_SHARDS is set; $DELTAPS_NUM_SHARDS."""
    if args.num_shards is None:
        args.num_shards = _env_int("DELTAPS_NUM_SHARDS")
    if args.shard_id is None:
        raw = os.environ.get("DELTAPS_SHARD_ID", "").strip()
        if raw:
            args.shard_id = _ordinal(raw)
            if args.shard_id is None:
                raise ValueError(f"$DELTAPS_SHARD_ID={raw!r}: want an integer or a name ending in -<ordinal>")
        elif os.environ.get("DELTAPS_NUM_SHARDS", "").strip():
            args.shard_id = _ordinal(os.environ.get("HOSTNAME", ""))
    if args.shard_id is None or args.num_shards is None:
        raise ValueError("server needs --shard-id and --num-shards (or $DELTAPS_SHARD_ID, a HOSTNAME ending in "
                         "-<ordinal>, and $DELTAPS_NUM_SHARDS)")


def resolve_worker_env(args) -> None:
    """--servers: $DELTAPS_SERVERS, else --servers-pattern / $DELTAPS_SERVERS_PATTERN expanded for i in
    0..num_shards-1 (--num-shards / $DELTAPS_NUM_SHARDS); --rank: $RANK, else $JOB_COMPLETION_INDEX;
    --world-size: $WORLD_SIZE."""
    if not args.servers and os.environ.get("DELTAPS_SERVERS", "").strip():
        try:
            args.servers = _servers(os.environ["DELTAPS_SERVERS"])
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"$DELTAPS_SERVERS: {e}") from None
    pattern = args.servers_pattern or os.environ.get("DELTAPS_SERVERS_PATTERN", "").strip()
    if not args.servers and pattern:
        n = args.num_shards if args.num_shards is not None else _env_int("DELTAPS_NUM_SHARDS")
        if not n or n < 1:
            raise ValueError("--servers-pattern needs --num-shards or $DELTAPS_NUM_SHARDS")
        if "{i}" not in pattern:
            raise ValueError(f"--servers-pattern {pattern!r} must contain {{i}}")
        try:
            args.servers = _servers(",".join(pattern.replace("{i}", str(i)) for i in range(n)))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--servers-pattern: {e}") from None
    if args.rank is None:
        args.rank = _env_int("RANK", "JOB_COMPLETION_INDEX")
    if args.world_size is None:
        args.world_size = _env_int("WORLD_SIZE")


def cmd_server(args) -> int:
    from ps.server import serve_forever
    from ps.shard import Shard

    resolve_server_env(args)
    import torch
    torch.set_num_threads(max(1, args.threads))
    if not 0 <= args.shard_id < args.num_shards:
        raise SystemExit(f"--shard-id {args.shard_id} must be in [0, {args.num_shards})")
    shard = Shard(args.shard_id, args.num_shards, wait_timeout_s=args.wait_timeout,
                  worker_timeout_s=args.worker_timeout, nonfinite=args.nonfinite)
    checkpointer = _durability(args, shard)
    if args.embedding_memory_cap:   # row-sparse embedding tables (ps/embedding.py)
        from ps.embedding import attach
        attach(shard, parse_bytes(args.embedding_memory_cap))
    metrics = None
    if args.metrics_port is not None:
        from deltaps.exporter import maybe_start_exporter
        from ps.metrics import ServerMetrics
        metrics = ServerMetrics(shard)
        maybe_start_exporter(args, metrics.registry, f"deltaps server shard={args.shard_id}")
    from deltaps.security import Security
    serve_forever(shard, args.host, args.port, args.port_file, max_message_bytes=args.max_message_bytes,
                  metrics=metrics, security=Security.from_args(args, "server"), checkpointer=checkpointer)
    return 0


def _durability(args, shard):
    """--restore / --checkpoint-*: restore the shard, return its Checkpointer (None without a directory)."""
    from ps.durability import Checkpointer, restore_latest

    if args.restore:
        restore_latest(shard, args.restore)
    directory = args.checkpoint_dir or args.restore
    if not directory:
        if args.checkpoint_every_steps or args.checkpoint_every_s:
            raise SystemExit("--checkpoint-every-steps/--checkpoint-every-s need --checkpoint-dir")
        return None
    return Checkpointer(shard, directory, every_steps=args.checkpoint_every_steps, every_s=args.checkpoint_every_s,
                        keep=args.checkpoint_keep)


def cmd_worker(args) -> int:
    from worker.trainers.ps import train_ps

    cfg = config_from_args(args, exclude=WORKER_EXCLUDED)
    resolve_worker_env(args)
    if cfg.mode == "pipeline":   # pipeline stages x data-parallel replicas through the PS (worker/pipeline.py)
        from deltaps.security import Security
        from worker.trainers.pipeline import run_worker as run_pipeline_worker
        result = run_pipeline_worker(cfg, args, security=Security.from_args(args, "client"))
    elif cfg.mode == "hybrid" or cfg.workload == "ctr":   # embedding workload / hybrid (worker/hybrid.py)
        from deltaps.security import Security
        from worker.trainers.hybrid import run_worker
        result = run_worker(cfg, args, security=Security.from_args(args, "client"))
    elif cfg.mode == "allreduce":   # DDP baseline; flags absent -> torchrun's RANK/WORLD_SIZE/MASTER_*
        from worker.trainers.allreduce import env_rendezvous, train_allreduce
        rank, world, addr, port = env_rendezvous(args.rank, args.world_size, args.master_addr, args.master_port)
        args.rank = rank
        result = train_allreduce(cfg, rank, world, addr, port, backend=args.backend,
                                 bucket_cap_mb=args.bucket_cap_mb)
    elif not args.servers or args.rank is None or args.world_size is None:
        raise ValueError("mode ps needs --servers (or $DELTAPS_SERVERS, --servers-pattern), --rank (or $RANK, "
                         "$JOB_COMPLETION_INDEX) and --world-size (or $WORLD_SIZE)")
    else:
        metrics = None
        if args.metrics_port is not None:
            from deltaps.exporter import maybe_start_exporter
            from worker.metrics import WorkerMetrics
            metrics = WorkerMetrics(args.rank, codec=cfg.codec)
            maybe_start_exporter(args, metrics.registry, f"deltaps worker rank={args.rank}")
        from deltaps.errors import PSError
        from deltaps.security import Security
        from worker.trainers.ps import WorkerStopped
        try:
            result = train_ps(cfg, args.servers, args.rank, args.world_size, metrics=metrics,
                              security=Security.from_args(args, "client"))
        except WorkerStopped as e:
            print(f"deltaps worker: {e}", file=sys.stderr)
            return 128 + 15
        except PSError as e:     # e.g. a shard unreachable past --reconnect-deadline-s: a clean error, no hang
            print(f"deltaps worker {args.rank}: error: {e}", file=sys.stderr)
            return 1
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f)
    print(f"worker {args.rank}: final test accuracy {result['final_test_accuracy']:.4f}", file=sys.stderr)
    if cfg.mode in ("allreduce", "hybrid", "pipeline"):
        # The process group is destroyed and the result written. Skip interpreter finalisation: gloo's
        # C++ threads can still hold tensors then and abort the process ("terminate called without an
        # active exception", seen intermittently at exit in tests/test_bench_compare.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_launch(args) -> int:
    from deltaps.tools.launch import launch, print_summary

    cfg = config_from_args(args)
    import shlex

    from deltaps.security import LaunchSecurity
    summary = launch(cfg, args.json, metrics=args.metrics, security=LaunchSecurity.from_args(args),
                     server_args=shlex.split(args.server_args or ""))
    print_summary(summary)
    long = ("per_worker", "server_stats", "loss_curve_rank0", "bytes_pushed_wire_steps_rank0")   # in --json
    print(json.dumps({k: v for k, v in summary.items() if k not in long}, indent=2))
    return 0


def cmd_ctl(args) -> int:
    from deltaps.errors import PSError, call
    from deltaps.security import Security
    from deltaps.transport import grpc_options
    from protos import pb, rpc

    security = Security.from_args(args, "client")
    out = []
    for addr in args.servers:
        stub = rpc.ParameterServerStub(security.channel(addr, grpc_options()))
        try:
            if args.action == "set-codec":
                rep = call(stub.SetCodec, pb.SetCodecRequest(codec=args.spec), 10.0)
                out.append({"server": addr, "codec": rep.codec, "codec_epoch": rep.codec_epoch})
            else:
                rep = call(stub.Stats, pb.StatsRequest(), 10.0)
                out.append({"server": addr, **{f.name: (list(getattr(rep, f.name)) if f.is_repeated
                                                        else getattr(rep, f.name)) for f in rep.DESCRIPTOR.fields}})
        except PSError as e:
            print(f"{addr}: {e}", file=sys.stderr)
            return 1
    print(json.dumps(out, indent=2))
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    if args.what == "codecs":
        from deltaps.tools.bench_codecs import main as bench_codecs
        return bench_codecs(rest) or 0
    if args.what == "compare":
        from deltaps.tools.bench_compare import main as bench_compare
        return bench_compare(rest) or 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaps", description="Sharded parameter server with gradient compression")
    p.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("server", help="run one parameter-server shard")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=7000, help="port to bind; 0 picks a free one (default 7000)")
    s.add_argument("--shard-id", type=int, help="this shard's id, 0-based (default $DELTAPS_SHARD_ID: an integer or a "
                   "pod name ending in -<ordinal>; else the ordinal of $HOSTNAME when $DELTAPS_NUM_SHARDS is set)")
    s.add_argument("--num-shards", type=int, help="total number of shards (default $DELTAPS_NUM_SHARDS)")
    s.add_argument("--port-file", help="write the bound port to this file once listening")
    s.add_argument("--threads", type=int, default=1,
                   help="torch threads for optimizer/codec math (default 1: RPCs of different keys already run "
                        "in parallel, and idle OpenMP threads spin on cores the workers need)")
    s.add_argument("--wait-timeout", type=float, default=300.0,
                   help="longest a pull/barrier may block waiting for other workers, seconds")
    s.add_argument("--max-message-bytes", type=int, default=64 << 20, help="gRPC max message size")
    s.add_argument("--checkpoint-dir", help="write checkpoints of this shard here (atomic, checksummed; also on SIGTERM)")
    s.add_argument("--checkpoint-every-steps", type=int, default=0,
                   help="checkpoint whenever the shard's min key version advanced this many steps (0 = off)")
    s.add_argument("--checkpoint-every-s", type=float, default=0.0,
                   help="checkpoint every this many seconds when state changed (0 = off)")
    s.add_argument("--checkpoint-keep", type=int, default=3, help="checkpoints to keep (>= 2; default 3)")
    s.add_argument("--restore", metavar="DIR",
                   help="resume from the newest intact checkpoint in DIR (corrupt ones are skipped); "
                        "keeps checkpointing into DIR unless --checkpoint-dir is given")
    s.add_argument("--worker-timeout", type=float, default=60.0,
                   help="evict a worker silent (no RPC) for longer than this, seconds (0 = never; default 60)")
    s.add_argument("--embedding-memory-cap", default=None, metavar="BYTES",
                   help="cap on this shard's embedding rows + optimizer state, e.g. 64MiB (default unlimited); "
                        "a pull that would exceed it fails with RESOURCE_EXHAUSTED")
    s.add_argument("--nonfinite", choices=["reject", "skip"], default="reject",
                   help="NaN/Inf gradients: reject (INVALID_ARGUMENT) or skip (acknowledged, not applied, counted)")
    add_metrics_args(s)
    add_security_args(s, "server")

    w = sub.add_parser("worker", help="run one training worker against running shards")
    w.add_argument("--servers", type=_servers, help="comma-separated host:port of every shard, in shard order "
                   "(mode ps; default $DELTAPS_SERVERS)")
    w.add_argument("--servers-pattern", help="shard address pattern with {i}, e.g. deltaps-ps-{i}.deltaps-ps:7000, "
                   "expanded for i < --num-shards (default $DELTAPS_SERVERS_PATTERN; used when --servers is absent)")
    w.add_argument("--num-shards", type=int, help="number of shards for --servers-pattern (default $DELTAPS_NUM_SHARDS)")
    w.add_argument("--rank", type=int, help="this worker's rank, 0-based (default $RANK, else $JOB_COMPLETION_INDEX)")
    w.add_argument("--world-size", type=int, help="number of workers (default $WORLD_SIZE)")
    w.add_argument("--master-addr", help="allreduce rendezvous host (default $MASTER_ADDR or 127.0.0.1)")
    w.add_argument("--master-port", type=int, help="allreduce rendezvous port (default $MASTER_PORT or 29500)")
    w.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="allreduce backend: auto = nccl with CUDA, else gloo")
    w.add_argument("--bucket-cap-mb", type=float, default=25.0, help="allreduce: DDP gradient bucket size, MiB")
    w.add_argument("--result-json", help="write this worker's measurements here")
    add_metrics_args(w)
    add_security_args(w, "client")
    add_train_args(w, exclude=WORKER_EXCLUDED)

    la = sub.add_parser("launch", help="start a local cluster (shards + workers), train, summarise")
    la.add_argument("--json", help="write the summary JSON here")
    la.add_argument("--server-args", help="extra flags for every shard, one quoted string, e.g. "
                    "\"--checkpoint-dir /tmp/ck --checkpoint-every-steps 50 --worker-timeout 10\"")
    la.add_argument("--metrics", action="store_true",
                    help="start a Prometheus exporter in every server and worker (free ports; URLs printed)")
    add_security_args(la, "launch")
    add_train_args(la)

    c = sub.add_parser("ctl", help="control a running job")
    c.add_argument("--servers", type=_servers, required=True, help="comma-separated host:port of every shard")
    add_security_args(c, "client")
    csub = c.add_subparsers(dest="action", required=True)
    sc = csub.add_parser("set-codec", help="switch the gradient codec of the running job (rollback switch)")
    sc.add_argument("spec", help="codec spec, e.g. none")
    csub.add_parser("stats", help="print each shard's counters")

    from deltaps.tools.top import add_top_parser
    add_top_parser(sub)

    from deltaps.tools.advise import add_arguments as add_advise_args
    add_advise_args(sub.add_parser("advise", help="predict step time and cost of each strategy at cluster scale "
                                                  "from a measured profile (--calibrate makes one)"))

    b = sub.add_parser("bench", help="benchmarks: codecs, compare (allreduce vs PS on a shaped network)")
    b.add_argument("what", choices=["codecs", "compare"], help="which benchmark")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from deltaps.malloc import tune_malloc
    tune_malloc()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.cmd == "server":
            return cmd_server(args)
        if args.cmd == "worker":
            return cmd_worker(args)
        if args.cmd == "launch":
            return cmd_launch(args)
        if args.cmd == "ctl":
            return cmd_ctl(args)
        if args.cmd == "advise":
            from deltaps.tools.advise import main_args
            return main_args(args)
        if args.cmd == "top":
            from deltaps.tools.top import cmd_top
            return cmd_top(args)
        return cmd_bench(args, rest)
    except ValueError as e:
        print(f"deltaps: error: {e}", file=sys.stderr)
        return 2
