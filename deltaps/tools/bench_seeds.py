"""`deltaps bench compare --seeds N`: every mode runs once per seed (model init and data order) in the same
invocation, seed-major (all modes for the first seed, then the next: a drift of the host hits every mode alike),
in an order that turns round every other seed (`run_order`: no mode always runs first or last in a seed), and a
mode's figures are the medians over its seeds. Time to target: the median when every seed reached the
target, else null ("not reached" — never a median of the seeds that happened to reach it), with the range
(min, max) of the seeds that did; the speed-ups are then ratios of medians. The metric at the common step
(bench_protocol) likewise: the median when every seed has one, else null. A seed the time cap stopped before it
finished has no step figures: those are the medians of the other seeds (none finished: the mode is capped).
Per-seed figures stay in `seeds`."""
from __future__ import annotations

import statistics

from deltaps.tools.bench_protocol import LIVE_CAP_MARGIN, cap_seconds

PER_SEED = ("seed", "time_to_target_s", "steps_to_target", "median_step_s", "final_test_accuracy", "steps",
            "common_step", "metric_at_common_step", "bytes_per_round_fraction", "capped")
PER_SEED_WHERE_RUN = ("final_test_auc", "shard_rows_held", "worker_peak_rss_bytes",     # ctr runs have these
                      "steps_per_worker", "inner_steps_per_round_per_worker",              # and every / local-update run
                      "cpu_s_per_worker", "throttled_s_per_worker",                        # --cpus-per-worker
                      "cpu_cores_in_training", "start_skew_s", "rounds",                   # every finished run
                      "payload_energy_share")                                              # local-update runs
EVERY_SEED_OR_NULL = ("metric_at_common_step", "common_step_evaluated_at", "bytes_per_round_fraction")


def run_order(specs: list[str], index: int, capped: bool, is_peer) -> list[str]:
    """The order the modes run in for the index-th seed: as given on even seeds, reversed on odd ones. With a time cap
    the peers, whose best time sets it, come first on even seeds and last on odd ones."""
    if capped:
        peers, ours = [s for s in specs if is_peer(s)], [s for s in specs if not is_peer(s)]
        return peers + ours if index % 2 == 0 else ours[::-1] + peers[::-1]
    return list(specs) if index % 2 == 0 else list(specs)[::-1]


def live_cap(store: dict[str, list[dict]], seeds: list, index: int, factor: float | None, is_peer) -> float | None:
    """The cap the index-th seed's next deltaps run stops at: its seed's, once its peers have run (None when none
    reached the target: no cap); before they have (odd seeds), LIVE_CAP_MARGIN x the previous seed's, a stop that
    bench_protocol.judge_live_stop judges again by the seed's own cap once the peers have run."""
    def peer_runs(seed) -> list[dict]:
        return [m for k, r in store.items() if is_peer(k) for m in r if m["seed"] == seed]
    own = peer_runs(seeds[index])
    if own or index == 0:
        return cap_seconds(own, factor)
    previous = cap_seconds(peer_runs(seeds[index - 1]), factor)
    return None if previous is None else LIVE_CAP_MARGIN * previous


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


STEP_VALUED = ("steps_to_target", "steps_to_target_uncapped", "common_step_evaluated_at", "steps", "common_step")


def _median(key: str, values: list):
    """A step's median is a step some seed evaluated (the lower middle of an even count), a time's the plain median."""
    return statistics.median_low(values) if key in STEP_VALUED else statistics.median(values)


def _medians(finished: list[dict]) -> dict:
    """The first seed's dict with every number that all seeds have replaced by its median, in nested dicts too
    (cpu_cores_in_training, straggler); a number some seed lacks is null (not the first seed's alone); curves and
    other non-numbers stay the first seed's."""
    out = dict(finished[0])
    for key, value in finished[0].items():
        values = [r.get(key) for r in finished]
        if _number(value) or any(_number(v) for v in values):
            out[key] = _median(key, values) if all(_number(v) for v in values) else None
        elif isinstance(value, dict) and all(isinstance(v, dict) for v in values):
            out[key] = _medians(values)
    return out


def merge(runs: list[dict]) -> dict:
    """One mode's per-seed results (each with its `seed`) -> the mode's figures (see the module docstring)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {"error": f"{len(failed)} of {len(runs)} seeds failed; seed {failed[0]['seed']}: {failed[0]['error']}",
                "seeds": [{k: r.get(k) for k in ("seed", "error")} for r in runs]}
    finished = [r for r in runs if "median_step_s" in r] or runs     # the cap may stop a seed before it finished
    out = _medians(finished)
    out.pop("seed", None)                                             # each seed's is in `seeds`
    for key in EVERY_SEED_OR_NULL:
        values = [r.get(key) for r in runs]
        if key in out:
            out[key] = _median(key, values) if all(_number(v) for v in values) else None
    for key in ("time_to_target_s", "steps_to_target"):
        reached = [r.get(key) for r in runs if r.get(key) is not None]
        out[key] = _median(key, reached) if len(reached) == len(runs) else None
        out[_named(key, "range")] = [min(reached), max(reached)] if reached else None
        # what every seed measured, the cap's verdict aside (bench_protocol.apply_time_cap)
        measured = [r.get(key) if r.get(key) is not None else r.get(_named(key, "uncapped")) for r in runs]
        if any(_named(key, "uncapped") in r for r in runs):
            out[_named(key, "uncapped")] = _median(key, measured) if all(_number(v) for v in measured) else None
    capped = [r for r in runs if r.get("capped")]
    out.pop("capped", None)
    if capped:
        out["capped"] = f"{len(capped)} of {len(runs)} seeds: seed {capped[0]['seed']} {capped[0]['capped']}"
    out["seeds"] = [{**{k: r.get(k) for k in PER_SEED}, **{k: r[k] for k in PER_SEED_WHERE_RUN if k in r}} for r in runs]
    return out


def _named(key: str, part: str) -> str:
    """time_to_target_s -> time_to_target_<part>_s, steps_to_target -> steps_to_target_<part>."""
    return key.removesuffix("_s") + f"_{part}" + ("_s" if key.endswith("_s") else "")


def range_text(m: dict) -> str:
    """' (min-max s)' of a merged mode's time to target; '' for a single seed."""
    lo_hi = m.get("time_to_target_range_s")
    if not lo_hi or len(m.get("seeds", ())) < 2:
        return ""
    reached = sum(s["time_to_target_s"] is not None for s in m["seeds"])
    missed = f", {len(m['seeds']) - reached} missed" if reached < len(m["seeds"]) else ""
    return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f}{missed})"
