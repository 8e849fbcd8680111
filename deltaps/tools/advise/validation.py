"""Validation against `deltaps bench compare`: predicted vs measured step time on a grid of links and
worker counts."""
from __future__ import annotations

import json
import os

from deltaps.strategies import ps_codecs, split_mode_specs
from deltaps.tools import costmodel as cm
from deltaps.tools.advise.calibration import calibrate, calibration_for, job_for, merge_profiles
from deltaps.tools.advise.report import markdown_table


def predict_cell(prof: dict, bandwidth: str, workers: int, shards: int, strategy: str) -> dict:
    cores = prof.get("host_cores") or os.cpu_count()
    cal = calibration_for(prof, bandwidth, cores)
    return cm.predict(cal, job_for(prof, workers, shards, host_cores=cores), strategy)


def validate(args) -> int:
    """For every (link, workers) cell: calibrate (probes, right before, so both see the same host load),
    then run `bench compare`; print predicted vs measured median step for every mode. Reports and
    profiles already in --dir are reused (delete them to re-measure)."""
    from deltaps.tools import bench_compare as bc
    workers = [int(w) for w in args.workers.split(",")]
    bws = [b.strip() for b in args.bandwidths.split(",")]
    modes = split_mode_specs(args.modes)
    codecs = ps_codecs(modes)
    os.makedirs(args.dir, exist_ok=True)
    fixed = [json.load(open(p)) for p in (args.profile or [])]
    rows, worst = [], 0.0
    for bw in bws:
        for w in workers:
            path = os.path.join(args.dir, f"w{w}_{bw}.json")
            ppath = os.path.join(args.dir, f"w{w}_{bw}.profile.json")
            if not fixed and not os.path.exists(ppath):
                print(f"-- calibrating for {w} workers on {bw} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                prof = calibrate(args.hidden, args.layers, args.batch_size, [bw], concurrency=sorted({1, w}),
                                 codecs=codecs, prefix=args.netns_prefix + "c", log=lambda *_: None,
                                 shards=args.servers)
                prof["loadavg"] = os.getloadavg()[0]
                with open(ppath, "w") as f:
                    json.dump(prof, f, indent=2)
            if not os.path.exists(path):
                print(f"-- measuring: bench compare --workers {w} --bandwidth {bw} --steps {args.steps} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
                bc.main(["--workers", str(w), "--servers", str(args.servers), "--bandwidth", bw, "--hidden",
                         str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps),
                         "--batch-size", str(args.batch_size), "--modes", ",".join(modes), "--json", path,
                         "--netns-prefix", args.netns_prefix])
            prof = merge_profiles(fixed or [json.load(open(ppath))])
            rep = json.load(open(path))
            for spec in modes:
                m = rep["modes"].get(spec, {})
                if "error" in m or not m:
                    rows.append([str(w), bw, spec, "", "FAILED", "", ""])
                    continue
                p = predict_cell(prof, bw, w, rep["servers"], spec)
                meas = m["median_step_s"]
                err = p["step_s"] / meas - 1
                worst = max(worst, abs(err))
                rows.append([str(w), bw, spec, f"{p['step_s'] * 1e3:.1f}", f"{meas * 1e3:.1f}", f"{err:+.0%}",
                             f"{p['comm_s'] / p['step_s']:.0%}", f"{m['comm_share'] + m['wait_share']:.0%}"])
    print()
    print("\n".join(markdown_table(["workers", "link", "mode", "predicted ms", "measured ms", "error", "pred. comm",
                            "meas. comm+wait"], rows)))
    print(f"worst |error| = {worst:.0%} (limit {args.tolerance:.0%}); {len(rows)} cells, "
          f"{args.steps} steps x batch {args.batch_size}, MLP 64-{args.hidden}x{args.layers}-10, "
          f"{args.servers} shards, {os.cpu_count()} cores shared by all processes")
    return 0 if worst <= args.tolerance else 1
