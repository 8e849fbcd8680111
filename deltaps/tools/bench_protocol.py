"""The race protocol of `deltaps bench compare` beyond time to target: the metric every mode has at one common
step, the bytes a local-update round moves, and the training-time cap.

* Common step (`--common-step S`; default: the largest steps to target of the seed's race, or, when no mode
  reached the target, the last step every mode evaluated). A mode's `metric_at_common_step` is its first
  evaluation at or after S (`common_step_evaluated_at`: S itself with `--common-step`, which makes every worker
  evaluate at S and train on past its target until then; later where evaluations wait for a synced model: torchft
  at its next sync, overlapped ps-local rounds). A mode whose evaluations end before S (it stopped at its own
  target, or the cap stopped it) gets null and `common_step_note` says why — never an extrapolation.
* `bytes_per_round_fraction` (local-update modes): the bytes one worker pushes + pulls per outer round (every
  fragment once), steady state — the initial full pull and the end-of-job flush and full pull left out — over the
  fp32 model's bytes (params x 4). ps-local fp32: about 2 (the delta up, the new model down); torchft: the ring
  allreduce's 2(W-1)/W sent + as much received.
* Time cap (`--time-cap X`): within a seed the peers run first; the cap is X x the best peer's time to target in
  that seed. A mode is stopped once one of its ranks has evaluated, without reaching the target, after more
  training seconds than the cap (the workers' --eval-log); any mode whose time to target exceeds the cap is
  reported "not reached within the cap". No peer reached the target: no cap in that seed.
"""
from __future__ import annotations

import json
import os
import time


def bytes_per_round_fraction(results: list[dict], model_params: int) -> float | None:
    """Mean over the workers of (steady_bytes_moved / steady_rounds) / (model_params x 4); None where the workers
    report no complete round (not a local-update mode, or no round before the loop ended)."""
    per_worker = [r["steady_bytes_moved"] / r["steady_rounds"] for r in results if r.get("steady_rounds")]
    if not per_worker or len(per_worker) != len(results) or not model_params:
        return None
    return sum(per_worker) / len(per_worker) / (model_params * 4)


def check_args(args) -> None:
    """The race protocol's own flags, refused before anything starts."""
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.time_cap is not None and args.time_cap < 1:     # below 1 the best peer would miss its own cap
        raise ValueError(f"--time-cap must be >= 1, got {args.time_cap}")
    targeted = args.target_accuracy or args.target_auc or args.target_loss
    if args.seeds > 1 and args.eval_every and targeted and not args.common_step:
        # without it each seed would judge at its own default step: a median over different steps
        raise ValueError("--seeds above 1 with a target needs --common-step: the one step every seed's modes "
                         "train to and are compared at")


def default_common_step(modes: dict) -> int | None:
    """The largest steps to target among the modes that reached it; none did: the last step every mode evaluated."""
    curves = [m for m in modes.values() if m.get("evals")]
    reached = [m["steps_to_target"] for m in curves if m.get("steps_to_target") is not None]
    if reached:
        return max(reached)
    return min((m["evals"][-1]["step"] for m in curves), default=None)


def add_metric_at_common_step(modes: dict, metric: str, common_step: int | None = None) -> int | None:
    """Set `common_step`, `metric_at_common_step`, `common_step_evaluated_at` (and `common_step_note` where null) on
    every mode of one seed's race that has figures; returns the common step (None: no mode evaluated)."""
    step = common_step or default_common_step(modes)
    if step is None:
        return None
    for m in modes.values():
        if "error" in m:
            continue
        evals = m.get("evals") or []
        at = next((e for e in evals if e["step"] >= step), None)
        m["common_step"] = step
        m["metric_at_common_step"] = at[metric] if at else None
        m["common_step_evaluated_at"] = at["step"] if at else None
        if at is None:
            last = evals[-1]["step"] if evals else 0
            m["common_step_note"] = (m.get("capped") or (
                f"stopped at its target at step {last}, before the common step {step} (--common-step {step} runs "
                f"every mode to it)" if m.get("steps_to_target") else f"evaluated up to step {last} only"))
    return step


# ---- the time cap ----------------------------------------------------------------------------------------
LIVE_CAP_MARGIN = 1.25     # a seed's modes that run before its peers stop at this x the previous seed's cap


def cap_seconds(peer_runs: list[dict], factor: float | None) -> float | None:
    """factor x the best (smallest) time to target among one seed's peer runs; None: no cap, or no peer reached."""
    times = [m["time_to_target_s"] for m in peer_runs if m.get("time_to_target_s") is not None]
    return factor * min(times) if factor and times else None


def _eval_log_rows(path: str) -> list[dict]:
    """A rank's --eval-log lines so far (a missing file or a half-written last line is what a running job leaves:
    skipped)."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return rows


def read_eval_logs(paths: list[str]) -> list[list[dict]]:
    """Each rank's evaluations so far (its --eval-log without the line that marks the start of training)."""
    return [[r for r in _eval_log_rows(path) if not r.get("started")] for path in paths]


def started(path: str) -> bool:
    """Has the rank writing this --eval-log begun training (its start-up is over)?"""
    return any(r.get("started") for r in _eval_log_rows(path))


def start_skew_s(paths: list[str]) -> float | None:
    """How far apart the ranks' clocks started: the spread of their first `started` rows' wall times (a restarted
    rank's later starts left out); None when a rank has not started or its log predates the wall field. A rank that
    starts late holds up every round (bsp, a torchft quorum) and that wait counts in the others' training time."""
    walls = [next((r.get("wall") for r in _eval_log_rows(path) if r.get("started")), None) for path in paths]
    return round(max(walls) - min(walls), 3) if walls and all(w is not None for w in walls) else None


def past_cap(eval_logs: list[list[dict]], cap_s: float) -> bool:
    """True when the mode can no longer reach the target within cap_s: no rank's evaluation has reached it and some
    rank evaluated after more than cap_s training seconds (time to target is the largest over the ranks)."""
    if any(e.get("reached") for rows in eval_logs for e in rows):
        return False
    return any(e["time_s"] > cap_s for rows in eval_logs for e in rows)


def capped_run(eval_logs: list[list[dict]], cap_s: float, factor: float) -> dict:
    """The figures of a mode stopped by the cap: its evaluations (rank 0's values, the slowest rank's clock, as
    bench_report.eval_fields) and the reason; no step-time or byte figures (the workers never finished)."""
    steps = sorted({e["step"] for rows in eval_logs for e in rows})
    curve = []
    for step in steps:
        at = [e for rows in eval_logs for e in rows if e["step"] == step]
        curve.append({**{k: v for k, v in at[0].items() if k != "reached"}, "time_s": max(e["time_s"] for e in at)})
    return {"capped": f"not reached within the cap ({factor:g} x the best peer's time to target = {cap_s:.2f} s of "
                      f"training)", "cap_s": cap_s, "time_to_target_s": None, "steps_to_target": None,
            "evals": curve, "steps": steps[-1] if steps else 0}


def apply_time_cap(m: dict, cap_s: float | None, factor: float | None) -> None:
    """A finished mode whose time to target passed the cap: not reached within it (its other figures stay). What it
    measured stays too, in time_to_target_uncapped_s / steps_to_target_uncapped: a peer runs to its end (the cap
    stops deltaps modes only), and fp32 DDP's time is still the reference of `x vs ddp`."""
    if m.get("capped") and m.get("cap_s") not in (None, cap_s):
        judge_live_stop(m, cap_s, factor)
    if cap_s is None or "error" in m or m.get("capped"):
        return
    m["cap_s"] = cap_s
    t = m.get("time_to_target_s")
    if t is not None and t > cap_s:
        m["capped"] = (f"reached after {t:.2f} s, beyond the cap ({factor:g} x the best peer's time to target = "
                       f"{cap_s:.2f} s)")
        m["time_to_target_uncapped_s"], m["steps_to_target_uncapped"] = t, m["steps_to_target"]
        m["time_to_target_s"] = m["steps_to_target"] = None


def judge_live_stop(m: dict, cap_s: float | None, factor: float | None) -> None:
    """A mode stopped at a live cap (it ran before its seed's peers: bench_seeds.live_cap) judged by the seed's own
    cap: within it, it is past that too; past it (or no peer reached the target: no cap), what it would have done
    is not known, and the report says so (a stop the seed's cap might not have made; never counted as reached)."""
    stopped_at = m["cap_s"]
    if cap_s is not None and cap_s <= stopped_at:
        m["capped"] = (f"not reached within the cap ({factor:g} x the best peer's time to target = {cap_s:.2f} s of "
                       f"training; stopped at {stopped_at:.2f} s)")
    else:
        m["capped"] = (f"stopped at {stopped_at:.2f} s of training before the target (it ran before this seed's peers, "
                       f"at {LIVE_CAP_MARGIN:g} x the previous seed's cap); this seed's cap is "
                       f"{'none' if cap_s is None else f'{cap_s:.2f} s'}: whether it reaches the target within that "
                       f"is not known")
        m["live_cap_s"] = stopped_at
    m["cap_s"] = cap_s


def wait_within_cap(workers, timeout_s: float, eval_logs: list[str], cap_s: float | None) -> list | None:
    """launch.wait_workers, watching the ranks' eval logs: None as soon as the mode is past the cap (the caller
    stops the workers), else what wait_workers returns (the failed ranks; [] when all succeeded)."""
    from deltaps.tools.launch import wait_workers
    from deltaps.tools.process_tree import ask_for_stacks
    deadline = time.monotonic() + timeout_s
    while True:
        failed = wait_workers(workers, max(0.0, min(1.0, deadline - time.monotonic())))
        if any(code != "timeout" for _, code in failed) or not failed:
            return failed
        if time.monotonic() >= deadline:
            ask_for_stacks(workers)         # past the deadline: each hung worker's log gets its stacks
            return failed
        if cap_s is not None and past_cap(read_eval_logs(eval_logs), cap_s):
            return None
