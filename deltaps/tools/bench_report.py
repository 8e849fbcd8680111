"""`deltaps bench compare`'s report: time to accuracy (the headline), the text table, the header and the PNG.

Time to accuracy (--eval-every, --target-accuracy; --workload ctr: --target-auc, on the test AUC): every worker
evaluates the test accuracy every N steps, timed apart from training (worker/trainers/base.py RunRecorder), and the
run stops at the first evaluation that reaches the target. A mode's `time_to_target_s` is the largest over its
ranks of the training seconds before that evaluation (the job has reached the target when its slowest rank has; the
ranks stop at the same step by construction, so their figures differ only by clock skew between processes);
`steps_to_target` is that step. `best_peer` is the fastest-to-target mode whose spec is a peer's, ddp or torchft (what
a user already runs); `speedup_vs_best_peer` / `speedup_vs_ddp` = that peer's (fp32 DDP's) time to target / the
mode's, null when either never reached the target.
"""
from __future__ import annotations

import math

from deltaps.strategies import PEER_FAMILIES, parse_mode_spec
from deltaps.tools.bench_seeds import range_text
from worker.workloads import workload_class

# the accuracy budget is a loss budget: a mode worse than fp32 DDP by more than this is flagged ("!", red in the PNG);
# one better than DDP is not (its signed difference is shown beside it)
ACCURACY_FLAG = 0.005      # accuracy / AUC more than 0.5 points below DDP's
LOSS_FLAG = 0.01           # a lower-is-better metric (lm's bits per byte) more than 1 % above DDP's


def loses_accuracy(delta: float | None) -> bool:
    """An accuracy / AUC difference from fp32 DDP's past the budget: more than ACCURACY_FLAG below it. Accuracies are
    float32 test-set fractions (0.910 - 0.905 = 0.00500005): compared at 0.01-point resolution."""
    return delta is not None and round(-delta, 4) > ACCURACY_FLAG


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


def is_peer(spec: str) -> bool:
    """A mode users run instead of deltaps (DDP plain or with a comm hook, torchft): what deltaps is raced against."""
    return parse_mode_spec(spec).family in PEER_FAMILIES


def measured(m: dict) -> bool:
    """A mode run that has step-time figures: neither failed nor stopped by the time cap before it finished."""
    return "error" not in m and "median_step_s" in m


def metric_of(report_or_result: dict) -> str:
    """The quality metric a run races on: its workload's (test AUC for ctr, bits per byte for lm); test accuracy
    for a result that names no workload (the tabular ones)."""
    name = report_or_result.get("workload")
    return workload_class(name).metric if name else "test_accuracy"


def lower_is_better(report: dict) -> bool:
    return bool(report.get("workload")) and not workload_class(report["workload"]).higher_is_better


def metric_label(report: dict) -> str:
    """metric_of in words: 'test AUC', 'test accuracy', 'test bits per byte'."""
    return metric_of(report).replace("_", " ").replace(" auc", " AUC")


CURVE_EXTRAS = ("table_rows_live",)      # what a mode's evaluations also record (hybrid: rows on the shards)


def eval_fields(results: list[dict]) -> dict:
    """A mode's time-to-accuracy fields from its workers' result dicts ({} when they did not evaluate).
    The curve: rank 0's accuracies (the same on every rank in the sync modes) at the largest rank's clock, over
    the ranks that recorded evaluations (under --sync quorum rank 0 alone judges; the others take its stop:
    worker/trainers/ps.py)."""
    if not any("evals" in r for r in results):
        return {}
    reached = [r["time_to_target_s"] for r in results if r.get("time_to_target_s") is not None]
    all_reached = len(reached) == len(results)
    metric = metric_of(results[0])
    judges = [r for r in results if r.get("evals")] or results    # quorum rounds: rank 0 alone judges
    clocks: dict[int, list[float]] = {}     # step -> the clocks of the ranks that evaluated it (matched by step: a
    for r in judges:                         # restarted rank evaluated fewer steps, from a later one on)
        for p in r["evals"]:
            clocks.setdefault(p["step"], []).append(p["time_s"])
    curve = [{"step": p["step"], "time_s": max(clocks[p["step"]]), metric: p[metric],
              **{k: p[k] for k in CURVE_EXTRAS if k in p}} for p in judges[0]["evals"]]
    return {"time_to_target_s": max(reached) if all_reached else None,
            "steps_to_target": results[0].get("steps_to_target") if all_reached else None,
            "evals": curve, "eval_s": max(r.get("eval_s", 0.0) for r in results)}


def _ratio(reference: dict | None, m: dict) -> float | None:
    """reference's time to target / m's; a reference past the time cap counts with what it measured (it ran to its
    end: bench_protocol.apply_time_cap)."""
    reference = reference or {}
    a = reference.get("time_to_target_s") or reference.get("time_to_target_uncapped_s")
    b = m.get("time_to_target_s")
    return a / b if a is not None and b else None


def add_speedups(report: dict) -> None:
    """Per mode, step-time speed-ups and accuracy deltas against the invocation's fp32 DDP run (`allreduce` or
    `ddp`); ctr: the speed-up against ddp:sparse, the DDP a user would run on an embedding model."""
    ar = fp32_ddp_run(report["modes"])    # the fp32 DDP run is the reference
    if ar and measured(ar):
        for m in filter(measured, report["modes"].values()):
            m["speedup_vs_allreduce"] = ar["median_step_s"] / m["median_step_s"] if m["median_step_s"] else math.nan
            m["speedup_wall_vs_allreduce"] = ar["wall_s"] / m["wall_s"] if m["wall_s"] else math.nan
            m["accuracy_delta_vs_allreduce"] = m["final_test_accuracy"] - ar["final_test_accuracy"]
            if "losses_rank0" in m and "losses_rank0" in ar:   # same data, same seed: the curves should coincide
                m["loss_curve_max_abs_diff_vs_allreduce"] = max(
                    (abs(a - b) for a, b in zip(m["losses_rank0"], ar["losses_rank0"])), default=0.0)
                m["auc_delta_vs_allreduce"] = m["final_test_auc"] - ar["final_test_auc"]
    else:
        report["network"]["notes"].append("no successful allreduce run in this invocation: no speed-ups computed")
    sparse = ddp_sparse_run(report)
    for m in filter(measured, report["modes"].values()):   # ctr: against the DDP a user would run (sparse gradients)
        if sparse:
            m["speedup_vs_ddp_sparse"] = sparse["median_step_s"] / m["median_step_s"]


def add_common_step_deltas(report: dict) -> None:
    """Per mode, its metric at the common step minus fp32 DDP's (`metric_at_common_step_delta_vs_ddp`) and minus the
    best peer's (`..._vs_best_peer`, after add_time_to_accuracy), and the flag `common_step_flag`: worse than DDP's by
    more than ACCURACY_FLAG points (accuracy, AUC) or LOSS_FLAG relative (a loss). A ctr report names it
    `auc_at_common_step` too."""
    ddp = fp32_ddp_run(report["modes"]) or {}
    ref = ddp.get("metric_at_common_step")
    peer = report["modes"].get(report.get("best_peer") or "", {}).get("metric_at_common_step")
    for m in report["modes"].values():
        v = m.get("metric_at_common_step")
        if "error" in m or "common_step" not in m:
            continue
        if report.get("workload") == "ctr":
            m["auc_at_common_step"] = v
        m["metric_at_common_step_delta_vs_best_peer"] = None if v is None or peer is None else v - peer
        delta = None if v is None or ref is None else v - ref
        m["metric_at_common_step_delta_vs_ddp"] = delta
        m["common_step_flag"] = (delta is not None and delta > LOSS_FLAG * abs(ref) if lower_is_better(report)
                                 else loses_accuracy(delta))


def add_time_to_accuracy(report: dict, target: float | None) -> None:
    """report['target'], report['best_peer'] and, per mode, the time-to-target speed-ups and the accuracy flag."""
    modes = {k: m for k, m in report["modes"].items() if "error" not in m}
    report["target"] = target or None
    peers = [k for k, m in modes.items() if is_peer(k) and m.get("time_to_target_s") is not None]
    best = min(peers, key=lambda k: modes[k]["time_to_target_s"], default=None)
    report["best_peer"] = best
    ddp = fp32_ddp_run(modes)
    for m in modes.values():
        m.setdefault("time_to_target_s", None)
        m.setdefault("steps_to_target", None)
        m["speedup_vs_best_peer"] = _ratio(modes.get(best), m)
        m["speedup_vs_ddp"] = _ratio(ddp, m)
        m["accuracy_flag"] = loses_accuracy(m.get("accuracy_delta_vs_allreduce"))
    report["comm_bound"] = comm_bound(best, modes.get(best))


def comm_bound(spec: str | None, peer: dict | None) -> dict | None:
    """Amdahl's bound on the race: the best peer's share of its step time blocked on communication (transfers and
    waiting for the others: 1 - its compute share, each worker's over its whole run, to the common step where there is
    one; over seeds the median, which commutes with 1 - x) and 1 / (1 - that share), the most a mode could gain on it
    with the peer's steps and compute per step and communication for free. A speed-up target above it takes fewer or
    cheaper steps, not fewer bytes (the decision rule: compression pays where communication takes more than 30 % of
    the step)."""
    if not peer or peer.get("compute_share") is None:
        return None
    blocked = 1.0 - peer["compute_share"]
    return {"peer": spec, "blocked_share": blocked, "max_speedup": 1 / (1 - blocked) if blocked < 1 else None}


def comm_bound_note(report: dict) -> str | None:
    b = report.get("comm_bound")
    if not b:
        return None
    bound = "unbounded" if b["max_speedup"] is None else f"at most x{b['max_speedup']:.2f}"
    return (f"comm bound: the best peer ({b['peer']}) spent {b['blocked_share']:.0%} of its steps communicating; with "
            f"its steps and compute per step and communication for free a mode is {bound} sooner")


def table(cols: list[str], rows: list[list]) -> str:
    """A markdown table of rows under cols, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [cols] + rows) for i in range(len(cols))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def _x(v: float | None) -> str:
    return "—" if v is None else f"x{v:.2f}"


STEP_COLS = ["median step", "samples/s", "compute/comm/wait", "sent/step", "veth tx/step"]
TIME_COLS = ["time to target", "steps to target", "x vs best peer", "x vs ddp"]


def step_cells(m: dict) -> list[str]:
    """A mode's STEP_COLS cells (every workload's table has them)."""
    return [f"{m['median_step_s'] * 1e3:.1f} ms", f"{m['samples_per_s']:.0f}",
            f"{m['compute_share']:.0%}/{m['comm_share']:.0%}/{m['wait_share']:.0%}",
            fmt_bytes(m["bytes_per_step"]),
            fmt_bytes(m["veth_tx_bytes_per_step"]) if "veth_tx_bytes_per_step" in m else "n/a"]


def failed_row(spec: str, m: dict, ncols: int) -> list[str]:
    """The row of a mode without step figures: failed, or stopped by the time cap (then: the cap and its steps)."""
    if "error" not in m:
        return [spec, f"not reached within the cap ({m['cap_s']:.2f} s)", f"stopped at {m['steps']:.0f}"] + [""] * (ncols - 3)
    return [spec, "FAILED: " + m["error"].splitlines()[0][:60]] + [""] * (ncols - 2)


def time_cells(m: dict) -> list[str]:
    """The time-to-target columns of a mode (TIME_COLS)."""
    t, measured = m.get("time_to_target_s"), m.get("time_to_target_uncapped_s")
    missed = "not reached within the cap" if m.get("capped") else "not reached"
    if t is None and measured is not None:
        missed += f" (reached after {measured:.2f} s)"
    return [(f"{t:.2f} s" if t is not None else missed) + range_text(m), m.get("steps_to_target") or "—",
            _x(m.get("speedup_vs_best_peer")), _x(m.get("speedup_vs_ddp"))]


def time_note(report: dict) -> str:
    metric = metric_label(report)
    reach = "<=" if lower_is_better(report) else ">="
    return (f"time to target = training seconds (evaluations excluded) until {metric} {reach} {report['target']:.4g}, "
            f"largest over ranks; x vs best peer = best peer's ({report.get('best_peer') or 'none reached it'}) "
            f"time to target / mode's; x vs ddp = fp32 DDP's / mode's")


def common_step_cell(report: dict, m: dict) -> str:
    """A mode's metric at the common step and its difference from fp32 DDP's there ('!' past the flag)."""
    v, d, loss = m.get("metric_at_common_step"), m.get("metric_at_common_step_delta_vs_ddp"), lower_is_better(report)
    if v is None:
        return "—"
    text = f"{v:.4f}" if loss else f"{v * 100:.2f} %"
    ref = v - d if d is not None else None
    if d is not None:
        text += f" ({d / ref * 100:+.1f} %)" if loss and ref else f" ({d * 100:+.2f} pp)"
    at = m.get("common_step_evaluated_at")
    if at is not None and at != m.get("common_step"):    # it evaluates at its sync points only: after more steps
        text += f" @{at:.0f}"
    return text + (" !" if m.get("common_step_flag") else "")


def round_cell(fraction: float | None, m: dict) -> str:
    """round/model, and the share of the deltas the pushes carried where they left part of them behind."""
    share = m.get("payload_energy_share")
    carried = f" ({share * 100:.0f} % carried)" if share is not None and share < 0.995 else ""
    return "—" if fraction is None else f"{fraction:.3f}{carried}"


def format_table_mlp(report: dict) -> str:
    """The MLP workloads' table (digits, clf, lm); with a target, the time-to-accuracy columns lead; with
    evaluations, the metric at the race's common step (bench_protocol) and its difference from ddp's."""
    timed = bool(report.get("target"))
    common = any("common_step" in m for m in report["modes"].values())
    cols = ["mode"] + (TIME_COLS if timed else []) + [
        *STEP_COLS, "test acc", "Δacc vs AR", "speed-up vs AR"] + ["@ common step", "round/model"] * common
    rows = []
    for spec, m in report["modes"].items():
        if not measured(m):
            rows.append(failed_row(spec, m, len(cols)))
            continue
        da, frac = m.get("accuracy_delta_vs_allreduce"), m.get("bytes_per_round_fraction")
        rows.append([spec] + (time_cells(m) if timed else []) + step_cells(m) + [
            f"{m['final_test_accuracy'] * 100:.2f} %",
            "—" if da is None else f"{da * 100:+.2f} pp" + (" !" if m.get("accuracy_flag") and not common else ""),
            _x(m.get("speedup_vs_allreduce"))] + [common_step_cell(report, m), round_cell(frac, m)] * common)
    notes = []
    if timed:
        notes.append(time_note(report))
    if common:
        steps = sorted({m["common_step"] for m in report["modes"].values() if "common_step" in m})
        notes.append(f"@ common step = {metric_label(report)} at step {'/'.join(map(str, steps))} (the first evaluation "
                     f"from there on, @N where that is step N; vs ddp's; ! = more than {ACCURACY_FLAG * 100:.1f} points "
                     f"below, or a loss {LOSS_FLAG * 100:g} % above); "
                     f"round/model = bytes one worker pushes + pulls per outer round / the fp32 model's bytes "
                     f"(carried: the share of the rounds' deltas + residuals, squared L2, the pushes carried)")
    bound = comm_bound_note(report) if timed else None
    if bound:
        notes.append(bound)
    if not common and any(m.get("accuracy_flag") for m in report["modes"].values()):
        notes.append(f"! = final accuracy more than {ACCURACY_FLAG * 100:.1f} points below fp32 DDP's")
    return "\n".join([table(cols, rows)] + notes)


def model_line(report: dict) -> str:
    if report.get("workload") == "ctr":
        e = report["embedding"]
        return (f"model: click-through, embedding {e['rows']:,} x {e['dim']} ({fmt_bytes(e['rows'] * e['dim'] * 4)}, "
                f"{e['optimizer']} lr {e['lr']}), {e['fields']} Zipf({e['zipf_a']}) fields + 13 dense -> "
                f"MLP {report['hidden']}x{report['layers']}; {report['model_params']:,} params")
    name = report.get("workload") or "mlp"
    workload = workload_class(name)
    shape = (f"MLP {report['hidden']}x{report['layers']}" if workload.sequential else
             f"{report['hidden']} wide x {report['layers']} layers")
    return (f"model: {shape} on {workload.description} ({name}), {report['model_params']:,} params "
            f"({fmt_bytes(report['model_params'] * 4)} of fp32 gradient per step)")


def seed_text(report: dict) -> str:
    seeds = report.get("seeds") or [report["seed"]]
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]} (figures: medians over them)"


def header(report: dict) -> str:
    net = report["network"]
    steps = f"{'up to ' if report.get('target') else ''}{report['steps']} steps"
    lines = [f"deltaps bench compare: {report['workers']} workers, {report['servers']} PS shards, "
             f"{steps} x batch {report['batch_size']}/worker, optimizer {report['optimizer']} "
             f"lr {report['lr']}, {seed_text(report)}", model_line(report),
             f"network: {net['description']}"]
    if report.get("eval_every"):
        metric = metric_label(report)
        target = f"stop at {metric} {report['target']:.4g}, " if report.get("target") else ""
        lines.append(f"evaluation: {target}{metric} every {report['eval_every']} steps (evaluation time is "
                     f"not on the clock)")
        common = report.get("common_step")
        lines.append(f"race protocol: {metric} compared at step {common} (every mode trains on to it)" if common else
                     f"race protocol: {metric} compared at the largest steps to target")
    if report.get("select_on") == "validation":
        lines.append("NOTE: every evaluation (target, curves, 'test' figures) is on the VALIDATION split, held out of the "
                     "training data: for choosing settings; the test set is untouched")
    if report.get("time_cap"):
        lines.append(f"time cap: a mode stops past {report['time_cap']:g} x the best peer's time to target (same seed)")
    if net.get("measured_link_gbit_s") is not None:
        lines.append(f"         measured one TCP stream worker->worker: {net['measured_link_gbit_s']:.3f} Gbit/s")
    lines.append(f"host: {report['host_cpus']} CPU cores shared by all processes "
                 f"({report['workers']} workers + {report['servers']} shards in ps modes"
                 f"{'; --colocate: shards and Lighthouse on the worker nodes, W links' if net.get('colocated') else ''})")
    lines += [f"NOTE: {n}" for n in net.get("notes", [])]
    return "\n".join(lines)


def flagged(m: dict) -> bool:
    """Red in the table and the PNG: the metric at the race's common step off ddp's (bench_protocol), or without a
    common step the final accuracy (each mode's own stopping step)."""
    return bool(m.get("common_step_flag")) if "common_step_flag" in m else bool(m.get("accuracy_flag"))


def format_table(report: dict) -> str:
    return format_table_ctr(report) if report.get("workload") == "ctr" else format_table_mlp(report)


def fp32_ddp_run(modes: dict) -> dict | None:
    """The invocation's fp32 DDP run (spelled `ddp` or `allreduce`), the reference of the speed-ups and deltas."""
    return modes.get("ddp", modes.get("allreduce"))


def ddp_sparse_run(report: dict) -> dict | None:
    """The successful ddp:sparse run of a ctr report (the embedding model's fair DDP peer; the one without a hook
    when both ran), if any."""
    runs = [(parse_mode_spec(s), m) for s, m in report["modes"].items() if m.get("median_step_s")]
    runs = [(s, m) for s, m in runs if s.sparse_embeddings]
    return min(runs, key=lambda sm: sm[0].ddp_hook is not None, default=(None, None))[1]


def format_table_ctr(report: dict) -> str:
    # + speed-ups against the embedding model's fair DDP peer, ddp:sparse (nn.Embedding(sparse=True)), if it ran;
    # with a --target-auc the time-to-target columns lead (the best peer is then the fastest ddp* mode to it)
    ref, timed = ddp_sparse_run(report), bool(report.get("target"))
    cols = ["mode", *(TIME_COLS if timed else []), *STEP_COLS, "test AUC", "test logloss", "table on shards",
            "worker RSS", "max |Δloss| vs AR", "speed-up vs AR"] + ["speed-up vs ddp:sparse"] * bool(ref)
    rows = []
    for spec, m in report["modes"].items():
        if not measured(m):
            rows.append(failed_row(spec, m, len(cols)))
            continue
        sp, dl = m.get("speedup_vs_allreduce"), m.get("loss_curve_max_abs_diff_vs_allreduce")
        rows.append([spec, *(time_cells(m) if timed else []), *step_cells(m),
                     f"{m['final_test_auc']:.4f}", f"{m['final_test_loss']:.4f}",
                     fmt_bytes(m["shard_table_bytes"]) if m.get("shard_table_bytes") else "—",
                     fmt_bytes(m.get("worker_peak_rss_bytes", 0)),
                     "—" if dl is None else f"{dl:.2e}", "—" if sp is None else f"x{sp:.2f}"]
                    + ([f"x{ref['median_step_s'] / m['median_step_s']:.2f}"] if ref else []))
    return "\n".join([table(cols, rows)] + ([time_note(report)] if timed else []))
