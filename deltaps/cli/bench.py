"""`deltaps bench codecs|compare`: the benchmarks (their own flags follow the benchmark name)."""
from __future__ import annotations


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: codecs, compare (allreduce vs PS on a shaped network)")
    b.add_argument("what", choices=["codecs", "compare"], help="which benchmark")


def run(args, rest: list[str]) -> int:
    if args.what == "codecs":
        from deltaps.tools.bench_codecs import main as bench_codecs
        return bench_codecs(rest) or 0
    if args.what == "compare":
        from deltaps.tools.bench_compare import main as bench_compare
        return bench_compare(rest) or 0
    raise SystemExit(f"unknown benchmark {args.what!r}")
