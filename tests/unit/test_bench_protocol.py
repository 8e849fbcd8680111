"""bench compare's race protocol (deltaps/tools/bench_protocol.py): the metric at a common step, the bytes of a
steady-state local-update round, the training-time cap; and the worker side of them (RunRecorder's --common-step
and --eval-log). No processes."""
import json
import logging
from types import SimpleNamespace

import pytest

from deltaps.config import TrainConfig
from deltaps.tools import bench_protocol as bp
from deltaps.tools import bench_report as br
from deltaps.tools.bench_seeds import merge
from worker.trainers import base


def _curve(*points):
    return [{"step": s, "time_s": t, "test_accuracy": a} for s, t, a in points]


# ---- the worker: train on past the target to the common step -------------------------------------------
def test_the_recorder_trains_on_to_the_common_step_and_logs_each_evaluation(monkeypatch, tmp_path):
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(base, "time", SimpleNamespace(perf_counter=lambda: clock.t, time=lambda: 1000.0 + clock.t))
    log = tmp_path / "evals{rank}.jsonl"
    cfg = TrainConfig(progress=False, steps=20, eval_every=3, target_accuracy=0.8, common_step=10, eval_log=str(log))
    run = base.RunRecorder(cfg, 1, "test", logging.getLogger("test"))
    accs = iter([0.5, 0.85, 0.9, 0.95])
    for _ in run.steps():
        clock.t += 1.0
        run.record(1.0)
        run.evaluate(lambda: {"test_accuracy": next(accs)})
    assert [e["step"] for e in run.evals] == [3, 6, 9, 10]           # one due at the common step itself
    assert (run.steps_to_target, run.time_to_target_s, run.stopped_at) == (6, 6.0, 10)   # the target: unchanged
    assert run.result(final_test_accuracy=0.95, model_params=1).steps == 10                 # steps run
    rows = [json.loads(line) for line in (tmp_path / "evals1.jsonl").read_text().splitlines()]
    assert rows[0] == {"started": True, "step": 0, "wall": 1000.0}     # first: the cue that start-up is over
    assert [(r["step"], r["reached"]) for r in rows[1:]] == [(3, False), (6, True), (9, True), (10, True)]
    path = str(log).replace("{rank}", "1")
    assert bp.started(path) and not bp.started(str(tmp_path / "none.jsonl"))
    assert [r["step"] for r in bp.read_eval_logs([path])[0]] == [3, 6, 9, 10]     # evaluations only


def test_the_start_skew_is_the_spread_of_the_ranks_first_starts(tmp_path):
    def log(rank, *rows):
        path = tmp_path / f"evals{rank}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)
    paths = [log(0, {"started": True, "step": 0, "wall": 100.0}, {"step": 16, "time_s": 1.0}),
             log(1, {"started": True, "step": 0, "wall": 100.25},
                 {"started": True, "step": 40, "wall": 130.0})]      # a restart: not a start-up skew
    assert bp.start_skew_s(paths) == 0.25
    assert bp.start_skew_s(paths + [str(tmp_path / "not-yet.jsonl")]) is None     # a rank that has not started
    assert bp.start_skew_s([log(2, {"started": True, "step": 0})]) is None           # a log without wall times


def test_round_figures_count_rounds_per_key_from_the_shards_counters():
    from deltaps.tools.bench_figures import round_figures
    shards = [{"num_keys": 3, "min_version": 12, "late_contributions": 3, "step_contributors": [0, 0, 0, 6, 30]},
              {"num_keys": 1, "min_version": 13, "late_contributions": 1, "step_contributors": [0, 0, 1, 2, 10, 1]}]
    assert round_figures(shards) == {"applied": 12, "late_contributions_per_key": 1.0,
                                     "contributors_share": [0.0, 0.0, 0.02, 0.16, 0.8, 0.02]}


def test_the_common_step_needs_evaluations_and_fits_the_run():
    for bad in ({"common_step": 10}, {"common_step": 400, "eval_every": 10}, {"common_step": -1, "eval_every": 10}):
        with pytest.raises(ValueError, match="--common-step"):
            TrainConfig(**bad).validate()


# ---- the metric at the common step -----------------------------------------------------------------------
def _race():
    return {"ddp": {"steps_to_target": 30, "evals": _curve((10, 1, .5), (20, 2, .8), (30, 3, .9))},
            "ps-local8:int8": {"steps_to_target": 20, "evals": _curve((10, 1, .6), (20, 2, .9))},
            "torchft:diloco:sync=16": {"steps_to_target": None, "evals": _curve((16, 1, .5), (32, 2, .85), (48, 3, .88))},
            "ps:none": {"error": "worker 1 failed"}}


def test_default_common_step_is_the_largest_steps_to_target_and_early_stoppers_get_null():
    race = _race()
    assert bp.add_metric_at_common_step(race, "test_accuracy") == 30
    assert race["ddp"]["metric_at_common_step"] == .9 and race["ddp"]["common_step_evaluated_at"] == 30
    local = race["ps-local8:int8"]
    assert local["metric_at_common_step"] is None and "stopped at its target at step 20" in local["common_step_note"]
    ft = race["torchft:diloco:sync=16"]          # evaluated only after a sync: the first evaluation from 30 on
    assert (ft["metric_at_common_step"], ft["common_step_evaluated_at"]) == (.85, 32)
    assert "common_step" not in race["ps:none"]


def test_an_explicit_common_step_and_a_race_nobody_won():
    race = _race()
    assert bp.add_metric_at_common_step(race, "test_accuracy", 10) == 10
    assert race["ps-local8:int8"]["metric_at_common_step"] == .6 and race["torchft:diloco:sync=16"][
        "common_step_evaluated_at"] == 16
    lost = {k: {**m, "steps_to_target": None} for k, m in _race().items() if "error" not in m}
    assert bp.default_common_step(lost) == 20                  # the last step every mode evaluated


def test_deltas_at_the_common_step_are_flagged_by_the_metric_direction():
    report = {"workload": "clf", "modes": {"ddp": {"common_step": 30, "metric_at_common_step": .900},
                                           "a": {"common_step": 30, "metric_at_common_step": .905},
                                           "b": {"common_step": 30, "metric_at_common_step": .894},
                                           "c": {"common_step": 30, "metric_at_common_step": None},
                                           "d": {"common_step": 30, "metric_at_common_step": .895},
                                           "e": {"common_step": 30, "metric_at_common_step": .950}}}
    br.add_common_step_deltas(report)
    m = report["modes"]
    assert m["a"]["metric_at_common_step_delta_vs_ddp"] == pytest.approx(.005) and not m["a"]["common_step_flag"]
    assert m["b"]["common_step_flag"] and m["c"]["metric_at_common_step_delta_vs_ddp"] is None
    assert not m["d"]["common_step_flag"]                  # half a point below: inside the loss budget
    assert not m["e"]["common_step_flag"]                  # five points better than DDP: no loss to flag
    lm = {"workload": "lm", "modes": {"ddp": {"common_step": 9, "metric_at_common_step": 2.00},
                                      "a": {"common_step": 9, "metric_at_common_step": 2.019},
                                      "b": {"common_step": 9, "metric_at_common_step": 2.03},
                                      "c": {"common_step": 9, "metric_at_common_step": 1.90}}}
    br.add_common_step_deltas(lm)
    assert not lm["modes"]["a"]["common_step_flag"] and lm["modes"]["b"]["common_step_flag"]   # 1 % of a loss
    assert not lm["modes"]["c"]["common_step_flag"]        # a loss 5 % below DDP's
    assert br.common_step_cell(lm, lm["modes"]["b"]) == "2.0300 (+1.5 %) !"


# ---- bytes per round -------------------------------------------------------------------------------------
def test_bytes_per_round_is_steady_state_over_the_fp32_model():
    params = 1000                                      # 4,000 bytes of fp32
    fp32 = {"steady_bytes_moved": 3 * (4000 + 4000), "steady_rounds": 3}      # the delta up, the model down
    int8 = {"steady_bytes_moved": 2 * (1000 + 4000), "steady_rounds": 2.0}
    assert bp.bytes_per_round_fraction([fp32, fp32], params) == pytest.approx(2.0)
    assert bp.bytes_per_round_fraction([fp32, int8], params) == pytest.approx((2.0 + 1.25) / 2)
    assert bp.bytes_per_round_fraction([{"bytes_pushed_wire": 9}], params) is None        # not a local-update mode
    assert bp.bytes_per_round_fraction([fp32, {"steady_bytes_moved": 0, "steady_rounds": 0}], params) is None


# ---- the time cap ----------------------------------------------------------------------------------------
def test_the_cap_is_a_multiple_of_the_best_peer_and_stops_only_a_mode_past_it():
    assert bp.cap_seconds([{"time_to_target_s": 8.0}, {"time_to_target_s": 5.0}, {"time_to_target_s": None}], 3) == 15
    assert bp.cap_seconds([{"time_to_target_s": None}], 3) is None and bp.cap_seconds([{"time_to_target_s": 1}], None) is None
    slow = [[{"step": 10, "time_s": 9.0, "reached": False}], [{"step": 10, "time_s": 15.5, "reached": False}]]
    assert bp.past_cap(slow, 15.0)                       # the slowest rank decides, as for time to target
    assert not bp.past_cap(slow, 16.0)
    assert not bp.past_cap([[{"step": 10, "time_s": 20.0, "reached": True}]], 15.0)    # reached: let it finish
    run = bp.capped_run(slow, 15.0, 3)
    assert run["time_to_target_s"] is None and run["steps"] == 10 and "not reached within the cap" in run["capped"]
    assert run["evals"] == [{"step": 10, "time_s": 15.5}]


def test_a_finished_mode_beyond_the_cap_is_not_reached_within_it():
    late, early = {"time_to_target_s": 20.0, "steps_to_target": 300}, {"time_to_target_s": 10.0, "steps_to_target": 200}
    for m in (late, early):
        bp.apply_time_cap(m, 15.0, 3)
    assert late["time_to_target_s"] is None and late["steps_to_target"] is None and "20.00 s" in late["capped"]
    assert early["time_to_target_s"] == 10.0 and "capped" not in early


def test_eval_logs_survive_a_half_written_line(tmp_path):
    (tmp_path / "e0.jsonl").write_text('{"step": 10, "time_s": 1.0}\n{"step": 2')
    assert bp.read_eval_logs([str(tmp_path / "e0.jsonl"), str(tmp_path / "missing")]) == [[{"step": 10, "time_s": 1.0}], []]


def test_seeds_and_table_with_a_capped_seed():
    done = {"seed": 0, "time_to_target_s": 4.0, "steps_to_target": 300, "median_step_s": 0.01, "steps": 300,
            "final_test_accuracy": 0.9, "metric_at_common_step": 0.9, "common_step": 300}
    capped = {"seed": 1, **bp.capped_run([[{"step": 100, "time_s": 16.0, "reached": False}]], 15.0, 3)}
    m = merge([done, capped])
    assert m["median_step_s"] == 0.01 and m["time_to_target_s"] is None and m["metric_at_common_step"] is None
    assert m["seeds"][1]["capped"].startswith("not reached within the cap")
    only = merge([capped, {**capped, "seed": 2}])
    assert not br.measured(only)
    assert br.failed_row("ps:int8", only, 5) == ["ps:int8", "not reached within the cap (15.00 s)", "stopped at 100", "", ""]


def test_seeds_with_a_target_need_one_common_step():
    from argparse import Namespace
    args = Namespace(seeds=3, time_cap=3.0, eval_every=16, target_accuracy=0.9, target_auc=None, target_loss=None,
                     common_step=None)
    with pytest.raises(ValueError, match="--common-step"):
        bp.check_args(args)
    bp.check_args(Namespace(**{**vars(args), "common_step": 512}))
    bp.check_args(Namespace(**{**vars(args), "seeds": 1}))          # one seed: its own default step is the race's


def test_a_metric_read_after_the_common_step_says_where():
    from deltaps.tools import bench_report as br
    report = {"modes": {}, "workload": "clf"}
    m = {"metric_at_common_step": 0.923, "metric_at_common_step_delta_vs_ddp": None, "common_step": 512,
         "common_step_evaluated_at": 576}
    assert br.common_step_cell(report, m) == "92.30 % @576"
    assert br.common_step_cell(report, {**m, "common_step_evaluated_at": 512}) == "92.30 %"
