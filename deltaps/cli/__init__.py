"""`deltaps` command line: one module per sub-command (server, worker, launch, ctl, bench; top and advise
live with their tools)."""
from __future__ import annotations

import argparse
import logging
import sys

from deltaps.cli import bench, ctl, launch, lighthouse, server, worker
from deltaps.errors import JobFailed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaps", description="Sharded parameter server with gradient compression")
    p.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = p.add_subparsers(dest="cmd", required=True)
    server.add_parser(sub)
    worker.add_parser(sub)
    launch.add_parser(sub)
    ctl.add_parser(sub)
    lighthouse.add_parser(sub)
    from deltaps.tools.top import add_top_parser
    add_top_parser(sub)

    from deltaps.tools.advise import add_arguments as add_advise_args
    add_advise_args(sub.add_parser("advise", help="predict step time and cost of each strategy at cluster scale "
                                                  "from a measured profile (--calibrate makes one)"))

    bench.add_parser(sub)
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
        commands = {"server": server.run, "worker": worker.run, "launch": launch.run, "ctl": ctl.run,
                    "lighthouse": lighthouse.run}
        if args.cmd in commands:
            return commands[args.cmd](args)
        if args.cmd == "advise":
            from deltaps.tools.advise import main_args
            return main_args(args)
        if args.cmd == "top":
            from deltaps.tools.top import cmd_top
            return cmd_top(args)
        return bench.run(args, rest)
    except ValueError as e:
        print(f"deltaps: error: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:     # the workers' own errors are in the message; the launcher's stack says nothing
        print(f"deltaps {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the command's own cleanup ran on the way out; its stack is noise
        print(f"deltaps {args.cmd}: interrupted", file=sys.stderr)
        return 130
