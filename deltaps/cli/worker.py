"""`deltaps worker`: run one training worker of any mode (worker/trainers/loop.py: the one loop)."""
from __future__ import annotations

import faulthandler
import json
import os
import sys

from deltaps.cli.env import resolve_worker_env, server_list
from deltaps.cli.security_args import add_security_args
from deltaps.config import WORKER_EXCLUDED, add_train_args, config_from_args
from deltaps.exporter import add_metrics_args


def add_parser(sub) -> None:
    w = sub.add_parser("worker", help="run one training worker against running shards")
    w.add_argument("--servers", type=server_list, help="comma-separated host:port of every shard, in shard order "
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
    w.add_argument("--lighthouse", default="", help="--mode torchft: the torchft Lighthouse's URL, e.g. "
                   "http://10.0.0.1:29510 (default $TORCHFT_LIGHTHOUSE)")
    w.add_argument("--result-json", help="write this worker's measurements here")
    add_metrics_args(w)
    add_security_args(w, "client")
    add_train_args(w, exclude=WORKER_EXCLUDED)


def worker_context(args, cfg):
    """The RunContext of this worker: flags and environment resolved, security and metrics built."""
    from deltaps.security import Security
    from worker.trainers.context import RunContext
    resolve_worker_env(args)
    metrics = None
    if args.metrics_port is not None:
        from deltaps.exporter import maybe_start_exporter
        from worker.metrics import WorkerMetrics
        metrics = WorkerMetrics(args.rank, codec=cfg.codec)
        maybe_start_exporter(args, metrics.registry, f"deltaps worker rank={args.rank}")
    return RunContext(rank=args.rank, world_size=args.world_size, servers=args.servers or [],
                      master_addr=args.master_addr, master_port=args.master_port, backend=args.backend,
                      bucket_cap_mb=args.bucket_cap_mb, lighthouse=args.lighthouse,
                      security=Security.from_args(args, "client"), metrics=metrics)


def run(args) -> int:
    from deltaps.errors import PSError
    from deltaps.tools.process_tree import STACKS_SIGNAL
    from worker.trainers.loop import train
    from worker.trainers.strategy import WorkerStopped

    # a launcher asks a worker past its deadline where it waits (the process's own stderr: its log)
    faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)
    cfg = config_from_args(args, exclude=WORKER_EXCLUDED)
    ctx = worker_context(args, cfg)
    try:
        result = train(cfg, ctx)
    except WorkerStopped as e:
        print(f"deltaps worker: {e}", file=sys.stderr)
        return 128 + 15
    except (PSError, MemoryError, RuntimeError) as e:   # a shard unreachable, out of memory: one clear line
        print(f"deltaps worker {ctx.rank}: error: {failure_text(e, cfg)}", file=sys.stderr)
        return 1
    _write_result(args.result_json, ctx.rank, result)
    _exit_now()


def failure_text(e: BaseException, cfg) -> str:
    """A worker's clean failure in one line: a PSError (e.g. a shard unreachable past --reconnect-deadline-s) or
    running out of memory (a MemoryError, or torch's allocator: "can't allocate memory"); anything else re-raised."""
    from deltaps.errors import PSError
    if isinstance(e, PSError):
        return str(e)
    if not (isinstance(e, MemoryError) or "can't allocate memory" in str(e)):
        raise e
    limit = f" (--worker-memory-limit {cfg.worker_memory_limit})" if cfg.worker_memory_limit else ""
    first = str(e).splitlines()[0] if str(e) else "MemoryError"
    return f"out of memory{limit}: {first}; a table this large belongs on the shards (--mode hybrid)"


def _write_result(path: str | None, rank: int, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)
    print(f"worker {rank}: final test accuracy {result['final_test_accuracy']:.4f}", file=sys.stderr)


def _exit_now() -> None:
    """The channels are closed, the process group's teardown done or given up on, and the result written. Skip
    interpreter finalisation: gloo's C++ threads can still hold tensors then and abort the process ("terminate called
    without an active exception", seen intermittently at exit in tests/cluster/test_bench_compare.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
