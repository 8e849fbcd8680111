"""`deltaps launch`: a local cluster of real processes (shards + workers), trained and summarised."""
from __future__ import annotations

import json
import shlex

from deltaps.cli.security_args import add_security_args
from deltaps.config import add_train_args, config_from_args


def add_parser(sub) -> None:
    la = sub.add_parser("launch", help="start a local cluster (shards + workers), train, summarise")
    la.add_argument("--json", help="write the summary JSON here")
    la.add_argument("--server-args", help="extra flags for every shard, one quoted string, e.g. "
                    "\"--checkpoint-dir /tmp/ck --checkpoint-every-steps 50 --worker-timeout 10\"")
    la.add_argument("--metrics", action="store_true",
                    help="start a Prometheus exporter in every server and worker (free ports; URLs printed)")
    la.add_argument("--no-zygote", action="store_true",
                    help="start every shard and worker as a fresh interpreter instead of forking it from one process "
                         "that imported torch once (deltaps/tools/zygote.py)")
    add_security_args(la, "launch")
    add_train_args(la)


def run(args) -> int:
    from deltaps.tools.launch import launch, print_summary
    from worker.trainers.strategy import check_job
    cfg = config_from_args(args)
    check_job(cfg)       # the mode's and the workload's rules, before any process starts

    from deltaps.security import LaunchSecurity
    from deltaps.tools.children import install_signal_handlers, restore_signal_handlers
    old = install_signal_handlers()     # a SIGTERM stops the shards and workers as a Ctrl-C does, not orphans them
    try:
        summary = launch(cfg, args.json, metrics=args.metrics, security=LaunchSecurity.from_args(args),
                         server_args=shlex.split(args.server_args or ""), zygote=not args.no_zygote)
    finally:
        restore_signal_handlers(old)
    print_summary(summary)
    long = ("per_worker", "server_stats", "loss_curve_rank0", "bytes_pushed_wire_steps_rank0")   # in --json
    print(json.dumps({k: v for k, v in summary.items() if k not in long}, indent=2))
    return 0
