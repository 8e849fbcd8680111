"""`deltaps bench codecs|compare`: the benchmarks (their own flags follow the benchmark name)."""
from __future__ import annotations


def add_parser(sub) -> None:
    # no -h of its own: `deltaps bench compare --help` reaches the benchmark's parser (its flags), not this one's
    b = sub.add_parser("bench", help="benchmarks: codecs, compare (allreduce vs PS on a shaped network)", add_help=False)
    b.add_argument("what", nargs="?", choices=["codecs", "compare"], help="which benchmark")
    b.set_defaults(bench_parser=b)


def run(args, rest: list[str]) -> int:
    if args.what is None:
        args.bench_parser.print_help()
        return 0 if {"-h", "--help"} & set(rest) else 2
    if args.what == "codecs":
        from deltaps.tools.bench_codecs import main as bench_codecs
        return bench_codecs(rest) or 0
    if args.what == "compare":
        from deltaps.tools.bench_compare import main as bench_compare
        return bench_compare(rest) or 0
    raise SystemExit(f"unknown benchmark {args.what!r}")
