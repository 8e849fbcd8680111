"""`deltaps server`: run one parameter-server shard."""
from __future__ import annotations

from deltaps.cli.env import resolve_server_env
from deltaps.cli.security_args import add_security_args
from deltaps.exporter import add_metrics_args
from deltaps.units import parse_bytes


def add_parser(sub) -> None:
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
    s.add_argument("--max-message-bytes", type=parse_bytes, default=64 << 20,
                   help="gRPC max message size (bytes, or 64MiB / 128M ...; default 64 MiB)")
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


def run(args) -> int:
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
    if args.embedding_memory_cap:   # row-sparse embedding tables (ps/embedding/)
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
