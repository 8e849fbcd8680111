"""The command line: `deltaps advise` (calibrate, or advise from profiles) and `python -m deltaps.tools.advise
validate`."""
from __future__ import annotations

import argparse
import json
import sys

from deltaps.strategies import ps_codecs, split_mode_specs
from deltaps.tools.cost_inputs import DEFAULT_STRATEGIES, PREDICTED

# The probes, the cost model and the report are imported where they run: every `deltaps` command builds the
# advise flags (add_arguments), and the rollback switch (`deltaps ctl`) should not wait for torch's import.

# the package docstring's first line (kept here: importing the package from this module would be a cycle)
DESCRIPTION = "`deltaps advise`: a measured profile -> predicted step time and cost of each strategy at cluster scale."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="append", default=[],
                   help="profile JSON (advise --calibrate, bench compare or launch); repeat to merge")
    p.add_argument("--calibrate", action="store_true", help="run the probes on this host and write a profile (--json)")
    p.add_argument("--gpus", default="8,64,256", help="comma-separated cluster sizes (workers) to predict")
    p.add_argument("--bandwidth", default=None,
                   help="link rate per worker, tc syntax (25gbit); calibrate: comma list of rates to probe")
    p.add_argument("--shards", type=int, default=None,
                   help="PS shards at scale (default: one per GPU); calibrate: shards of the host PS-path probe (2)")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="PS key size at scale (default: the best predicted of 4 MiB, 1 MiB, 256 KiB and about "
                        "4 keys per shard)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated strategies, mode specs as bench compare's --modes (deltaps/strategies.py) "
                        f"that the cost model predicts: {PREDICTED} (local-update job: --local-steps H, F stream "
                        f"fragments, each exchange overlapping tau inner steps)")
    p.add_argument("--steps", type=int, default=100000, help="training steps to cost")
    p.add_argument("--gpu-hour-usd", type=float, default=2.5, help="price of one GPU-hour")
    p.add_argument("--egress-usd-per-gb", type=float, default=0.0, help="price of network egress per GB sent")
    p.add_argument("--engineer-usd", type=float, default=10000.0,
                   help="one-off cost of adopting compression (the brief: one engineer, $10k)")
    p.add_argument("--max-acc-drop", type=float, default=1.0, help="accuracy loss accepted, percentage points")
    p.add_argument("--hidden", type=int, default=1024, help="calibrate: MLP hidden width")
    p.add_argument("--layers", type=int, default=2, help="calibrate: MLP hidden layers")
    p.add_argument("--batch-size", type=int, default=32, help="calibrate: batch size per worker")
    p.add_argument("--concurrency", default="1,2,4", help="calibrate: concurrent processes for the compute probe")
    p.add_argument("--json", help="write the profile (--calibrate) or the advice here")
    p.add_argument("--plot", help="write a PNG of predicted step time vs GPUs per strategy")


def main_args(args) -> int:
    from deltaps.tools.advise.advice import advise
    from deltaps.tools.advise.calibration import calibrate, merge_profiles
    from deltaps.tools.advise.report import format_report, plot
    if args.calibrate:
        bws = [b.strip() for b in (args.bandwidth or "1gbit").split(",") if b.strip()]
        codecs = ps_codecs(split_mode_specs(args.strategies))
        prof = calibrate(args.hidden, args.layers, args.batch_size, bws,
                         concurrency=[int(k) for k in args.concurrency.split(",")], codecs=codecs,
                         shards=args.shards or 2)
        docs = [json.load(open(p)) for p in args.profile]
        if docs:   # accuracy deltas / measured ratios from bench reports ride along
            m = merge_profiles([prof] + docs)
            prof["accuracy_delta"], prof["measured_compression_ratio"] = m["accuracy_delta"], m["measured_compression_ratio"]
        print(json.dumps({k: v for k, v in prof.items() if k != "model"}, indent=2, default=str))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(prof, f, indent=2)
            print(f"wrote {args.json}")
        return 0
    if not args.profile:
        raise ValueError("advise needs --profile PATH (or --calibrate to make one)")
    prof = merge_profiles([json.load(open(p)) for p in args.profile])
    rep = advise(prof, [int(g) for g in args.gpus.split(",")], args.bandwidth or "10gbit",
                 split_mode_specs(args.strategies), args.steps, args.gpu_hour_usd, args.egress_usd_per_gb,
                 args.shards, args.max_acc_drop / 100, args.engineer_usd, args.chunk_bytes)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.plot:   # the curve at every power of two in range as well as at --gpus
        gs = sorted({int(g) for g in args.gpus.split(",")})
        dense = sorted(set(gs) | {1 << i for i in range(1, 20) if gs[0] <= 1 << i <= gs[-1]})
        plot(advise(prof, dense, args.bandwidth or "10gbit", split_mode_specs(args.strategies), args.steps,
                    args.gpu_hour_usd, args.egress_usd_per_gb, args.shards, args.max_acc_drop / 100,
                    args.engineer_usd, args.chunk_bytes), args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "validate":
        p = argparse.ArgumentParser(prog="python -m deltaps.tools.advise validate",
                                    description="predicted vs measured step time on the bench compare grid")
        p.add_argument("--workers", default="2,4")
        p.add_argument("--bandwidths", default="100mbit,1gbit,10gbit")
        p.add_argument("--modes", default=",".join(DEFAULT_STRATEGIES))
        p.add_argument("--servers", type=int, default=2)
        p.add_argument("--hidden", type=int, default=1024)
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--batch-size", type=int, default=32)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--dir", default="advise-validate", help="bench compare reports (reused when present)")
        p.add_argument("--profile", action="append", help="use this calibration instead of probing")
        p.add_argument("--tolerance", type=float, default=0.25)
        p.add_argument("--netns-prefix", default="dpsv")
        from deltaps.tools.advise.validation import validate
        return validate(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="deltaps advise", description=DESCRIPTION)
    add_arguments(p)
    return main_args(p.parse_args(argv))
