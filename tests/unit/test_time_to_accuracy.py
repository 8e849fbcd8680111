"""Time to accuracy (issue 17): the clf workload, evaluation during training in RunRecorder (never on the clock),
the config rules, and bench compare's report math on hand-made results. No sockets, no processes."""
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deltaps.config import TrainConfig
from deltaps.tools import bench_plot
from deltaps.tools import bench_report as br
from worker.trainers import base
from worker.trainers.strategy import load_job as load_config
from worker.workloads import workload_class
from worker.workloads.clf import CLASSES, FEATURES, TEST, TRAIN
from worker.workloads.mlp import worker_batches

ROOT = Path(__file__).resolve().parents[2]


# ---- the workload -------------------------------------------------------------------------------------
def test_clf_is_deterministic_and_shaped():
    load_split = workload_class("clf").load_split
    a, b, c = load_split(0), load_split(0), load_split(1)
    x_tr, y_tr, x_te, y_te = a
    assert x_tr.shape == (TRAIN, FEATURES) and x_te.shape == (TEST, FEATURES) and FEATURES == 64
    assert x_tr.dtype == x_te.dtype == torch.float32 and y_tr.dtype == torch.int64
    assert set(y_tr.unique().tolist()) == set(range(CLASSES)) and CLASSES == 10
    assert all(torch.equal(u, v) for u, v in zip(a, b))                 # the seed alone decides
    assert not torch.equal(x_tr, c[0])
    assert abs(x_tr.mean().item()) < 1e-3                                # standardised on the training split
    assert workload_class("mlp").load_split(0)[0].shape[1] == 64   # digits stays the default
    with pytest.raises(ValueError, match="unknown workload 'nope'; use one of .*clf.*ctr"):
        workload_class("nope")


def test_clf_is_sharded_like_digits():
    x, y, _, _ = workload_class("clf").load_split(0)
    seen = []
    for rank in range(4):                                # the first 20 batches of each rank: disjoint rows
        it = worker_batches(x, y, rank, 4, 32, 0)
        rows = torch.cat([next(it)[0] for _ in range(20)])
        assert rows.shape == (640, 64)
        seen.append({tuple(r[:4].tolist()) for r in rows})
    assert sum(len(s) for s in seen) == len(set().union(*seen)) == 4 * 640
    for path in (ROOT / "worker" / "trainers").glob("*.py"):   # strategies ask the workload, never name one
        src = path.read_text()
        assert not any(w in src for w in ('"mlp"', '"clf"', '"ctr"', "load_digits_split", "load_clf_split")), path.name


# ---- config -------------------------------------------------------------------------------------------
def test_eval_and_target_flags_are_validated():
    load_config(None, {"workload": "clf", "eval_every": 10, "target_accuracy": 0.9})
    load_config(None, {"mode": "allreduce", "ddp_hook": "localsgd:period=8", "eval_every": 5, "target_accuracy": 0.5})
    load_config(None, {"sync": "asp", "eval_every": 10})                  # asp: evals recorded, no stop
    with pytest.raises(ValueError, match="different model"):
        load_config(None, {"sync": "ssp:2", "eval_every": 10, "target_accuracy": 0.9})
    with pytest.raises(ValueError, match="needs --eval-every"):
        load_config(None, {"target_accuracy": 0.9})
    with pytest.raises(ValueError, match="--mode ps / allreduce"):
        load_config(None, {"mode": "pipeline", "eval_every": 10})
    with pytest.raises(ValueError, match="targets in"):
        load_config(None, {"eval_every": 10, "target_accuracy": 90})


def test_the_ctr_workload_races_to_a_test_auc():
    for mode in ("allreduce", "hybrid"):
        load_config(None, {"workload": "ctr", "mode": mode, "eval_every": 10, "target_auc": 0.8})
    with pytest.raises(ValueError, match="use --target-auc"):
        load_config(None, {"workload": "ctr", "mode": "hybrid", "eval_every": 10, "target_accuracy": 0.8})
    with pytest.raises(ValueError, match="use --target-accuracy"):
        load_config(None, {"workload": "clf", "eval_every": 10, "target_auc": 0.8})
    load_config(None, {"workload": "ctr", "mode": "ps", "eval_every": 10})   # the one loop evaluates every mode
    with pytest.raises(ValueError, match="not pipeline"):
        load_config(None, {"workload": "clf", "mode": "pipeline", "eval_every": 10})
    with pytest.raises(ValueError, match="--sync bsp in --mode hybrid"):
        load_config(None, {"workload": "ctr", "mode": "hybrid", "sync": "asp", "eval_every": 10, "target_auc": 0.8})
    with pytest.raises(ValueError, match="--target-auc needs --eval-every"):
        load_config(None, {"workload": "ctr", "mode": "hybrid", "target_auc": 0.8})


def test_local_update_flags_are_validated():
    load_config(None, {"local_steps": 32, "stream_fragments": 4, "overlap_steps": 4})
    for bad, match in [({"local_steps": 8, "overlap_steps": 8}, "--overlap-steps"),
                       ({"local_steps": 8, "stream_fragments": 2, "overlap_steps": 4}, "--overlap-steps"),
                       ({"overlap_steps": 1}, "--overlap-steps"),
                       ({"stream_fragments": 2}, "--stream-fragments needs"),
                       ({"mode": "allreduce", "local_steps": 8}, "--mode ps only")]:
        with pytest.raises(ValueError, match=match):
            load_config(None, bad)


# ---- RunRecorder: evaluations are timed apart ------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _recorder(monkeypatch, **cfg):
    clock = FakeClock()
    monkeypatch.setattr(base, "time", SimpleNamespace(perf_counter=clock, time=clock))
    c = TrainConfig(progress=False, batch_size=8, **cfg)
    return base.RunRecorder(c, 0, "test", logging.getLogger("test")), clock


def test_evaluation_is_off_the_clock_and_stops_at_the_target(monkeypatch):
    run, clock = _recorder(monkeypatch, steps=10, eval_every=3, target_accuracy=0.8)
    accs = iter([0.5, 0.85, 0.99])

    def evaluate():
        clock.t += 5.0                                   # a slow evaluation: must not count
        return {"test_accuracy": next(accs)}
    body = []
    for step in run.steps():
        body.append(step)
        clock.t += 1.0
        run.record(1.0)
        run.evaluate(evaluate)
    assert body == list(range(6))                        # stopped after the step whose evaluation hit 0.8
    assert run.step_times == [1.0] * 6 and run.wall_s == pytest.approx(6.0) and run.eval_s == pytest.approx(10.0)
    assert run.evals == [{"step": 3, "time_s": 3.0, "test_accuracy": 0.5},
                         {"step": 6, "time_s": 6.0, "test_accuracy": 0.85}]
    d = run.result(final_test_accuracy=0.85, model_params=1, extras={"backend": "gloo"}).to_dict()
    assert d["steps"] == 6 and d["samples_per_s"] == pytest.approx(6 * 8 / 6.0)    # steps actually run
    assert (d["steps_to_target"], d["time_to_target_s"], d["target_accuracy"]) == (6, 6.0, 0.8)
    assert d["backend"] == "gloo" and d["evals"] == run.evals


def test_never_reaching_the_target_runs_every_step(monkeypatch):
    run, clock = _recorder(monkeypatch, steps=4, eval_every=2, target_accuracy=0.9)
    for _ in run.steps():
        clock.t += 1.0
        run.record(1.0)
        run.evaluate(lambda: {"test_accuracy": 0.1})
    d = run.result(final_test_accuracy=0.1, model_params=1).to_dict()
    assert d["steps"] == 4 and d["steps_to_target"] is None and d["time_to_target_s"] is None
    assert [e["step"] for e in d["evals"]] == [2, 4]
    off, _ = _recorder(monkeypatch, steps=2)
    for _ in off.steps():
        off.record(1.0)
        assert off.evaluate(lambda: 1 / 0) is False      # --eval-every 0: never called, no extra keys
    assert "evals" not in off.result(final_test_accuracy=0.0, model_params=1).to_dict()


def test_targets_are_counts_and_follow_the_metric_direction():
    from worker.workloads import get_workload
    from worker.workloads.base import Workload
    clf = get_workload(load_config(None, {"workload": "clf"}))        # 1,000 test samples
    assert float(torch.tensor(900 / 1000, dtype=torch.float32)) < 0.9    # why not a float fraction
    assert clf.reaches({"test_correct": 900}, 0.9) and not clf.reaches({"test_correct": 899}, 0.9)
    assert clf.reaches({"test_correct": 901}, 0.9005) is True and not clf.reaches({"test_correct": 900}, 0.9005)

    class Loss(Workload):
        metric, higher_is_better = "test_loss", False
    loss = Loss(TrainConfig())
    assert loss.reaches({"test_loss": 1.5}, 1.5) and not loss.reaches({"test_loss": 1.6}, 1.5)


def test_a_due_evaluation_waits_for_a_synced_model(monkeypatch):
    run, clock = _recorder(monkeypatch, steps=10, eval_every=2)
    for step in run.steps():                             # local SGD with period 3: replicas agree every 3rd step
        clock.t += 1.0
        run.record(1.0)
        run.evaluate(lambda: {"test_accuracy": 0.5}, synced=(step + 1) % 3 == 0)
    assert [e["step"] for e in run.evals] == [3, 6, 9]


def test_a_rank_that_does_not_judge_evaluates_off_its_clock_and_stops_nothing(monkeypatch):
    run, clock = _recorder(monkeypatch, steps=6, eval_every=2, target_accuracy=0.5)

    def evaluate():
        clock.t += 3.0                                   # as long as the judge's: the rank pauses as a peer's would
        return {"test_accuracy": 0.99}
    for _ in run.steps():
        clock.t += 1.0
        run.record(1.0)
        assert run.evaluate(evaluate, judges=False) is False
    d = run.result(final_test_accuracy=0.99, model_params=1).to_dict()
    assert d["steps"] == 6 and d["steps_to_target"] is None and d["evals"] == []   # trained on; the judge stops it
    assert d["unjudged_evals"] == 3 and d["eval_s"] == pytest.approx(9.0) and run.wall_s == pytest.approx(6.0)


# ---- bench compare's report ---------------------------------------------------------------------------
def _mode(t, acc, steps=None, delta=0.0):
    return {"time_to_target_s": t, "steps_to_target": steps, "final_test_accuracy": acc, "median_step_s": 0.1,
            "bytes_per_step": 1e6, "accuracy_delta_vs_allreduce": delta, "samples_per_s": 100.0,
            "compute_share": 0.5, "comm_share": 0.3, "wait_share": 0.2, "speedup_vs_allreduce": 1.0,
            "compute_s_per_step": 0.05, "comm_s_per_step": 0.03, "wait_s_per_step": 0.02,
            "evals": [{"step": 10, "time_s": 1.0, "test_accuracy": 0.5}, {"step": 20, "time_s": 2.0, "test_accuracy": acc}]}


def _report():
    return {"modes": {"ddp": _mode(10.0, 0.90, 300), "ddp:fp16": _mode(8.0, 0.901, 300, 0.001),
                      "ddp:localsgd:period=8": _mode(None, 0.85, None, -0.05),
                      "ps:int8": _mode(4.0, 0.894, 280, -0.006), "ps:topk:ratio=0.01": _mode(None, 0.80, None, -0.1),
                      "ps:none": {"error": "worker 1 failed"}},
            "workload": "clf", "workers": 4, "bandwidth": "1gbit", "shaped": False, "model_params": 648202}


def test_best_peer_and_speedups():
    r = _report()
    br.add_time_to_accuracy(r, 0.9)
    m = r["modes"]
    assert r["target"] == 0.9 and r["best_peer"] == "ddp:fp16"          # fastest ddp*/allreduce* to the target
    assert m["ps:int8"]["speedup_vs_best_peer"] == pytest.approx(2.0)
    assert m["ps:int8"]["speedup_vs_ddp"] == pytest.approx(2.5)
    assert m["ddp:fp16"]["speedup_vs_best_peer"] == pytest.approx(1.0)
    for spec in ("ddp:localsgd:period=8", "ps:topk:ratio=0.01"):         # never reached: null, not zero
        assert m[spec]["speedup_vs_best_peer"] is None and m[spec]["speedup_vs_ddp"] is None
    assert [k for k, v in m.items() if v.get("accuracy_flag")] == ["ddp:localsgd:period=8", "ps:int8",
                                                                   "ps:topk:ratio=0.01"]
    assert not m["ddp:fp16"]["accuracy_flag"]                            # 0.1 point: inside the 0.5 budget
    assert "speedup_vs_ddp" not in m["ps:none"]
    table = br.format_table_mlp(r)
    assert "time to target" in table and "x vs best peer" in table and "-0.60 pp !" in table
    assert "not reached" in table and "FAILED" in table and "x2.50" in table
    # the best peer spent 30 % on transfers and 20 % waiting: free communication at its steps halves its time at most
    assert r["comm_bound"] == {"peer": "ddp:fp16", "blocked_share": pytest.approx(0.5), "max_speedup": pytest.approx(2.0)}
    assert "spent 50% of its steps communicating" in table and "at most x2.00 sooner" in table


def test_a_peer_that_never_communicates_bounds_the_race_at_one():
    r = _report()
    r["modes"]["ddp:fp16"].update(compute_share=1.0, comm_share=0.0, wait_share=0.0)
    br.add_time_to_accuracy(r, 0.9)
    assert r["comm_bound"]["max_speedup"] == pytest.approx(1.0)
    r["modes"]["ddp:fp16"].update(compute_share=0.0, comm_share=0.7, wait_share=0.3)     # all communication: no bound
    br.add_time_to_accuracy(r, 0.9)
    assert r["comm_bound"]["max_speedup"] is None and "unbounded" in br.format_table_mlp(r)


def test_exactly_half_a_point_is_not_flagged():
    r = _report()
    r["modes"]["ps:int8"]["accuracy_delta_vs_allreduce"] = 0.005000054836273193   # float32 0.910 - 0.905
    r["modes"]["ddp:fp16"]["accuracy_delta_vs_allreduce"] = 0.894 - 0.9
    r["modes"]["ddp:localsgd:period=8"]["accuracy_delta_vs_allreduce"] = 0.92 - 0.9      # better: no loss to flag
    br.add_time_to_accuracy(r, 0.9)
    assert not r["modes"]["ps:int8"]["accuracy_flag"] and r["modes"]["ddp:fp16"]["accuracy_flag"]
    assert not r["modes"]["ddp:localsgd:period=8"]["accuracy_flag"]


def test_no_peer_reached_the_target():
    r = _report()
    for spec in ("ddp", "ddp:fp16"):
        r["modes"][spec]["time_to_target_s"] = None
    br.add_time_to_accuracy(r, 0.9)
    assert r["best_peer"] is None and r["comm_bound"] is None
    assert r["modes"]["ps:int8"]["speedup_vs_best_peer"] is None and r["modes"]["ps:int8"]["speedup_vs_ddp"] is None


def test_eval_fields_take_the_slowest_rank():
    def res(t, times):
        return {"time_to_target_s": t, "steps_to_target": 20 if t else None, "eval_s": 0.3,
                "evals": [{"step": 10 * (i + 1), "time_s": s, "test_accuracy": 0.5 + i / 10} for i, s in enumerate(times)]}
    f = br.eval_fields([res(2.0, [1.0, 2.0]), res(2.5, [1.2, 2.5])])
    assert f["time_to_target_s"] == 2.5 and f["steps_to_target"] == 20
    assert [p["time_s"] for p in f["evals"]] == [1.2, 2.5]
    assert br.eval_fields([res(2.0, [1.0]), res(None, [1.0])])["time_to_target_s"] is None
    assert br.eval_fields([{"steps": 3}]) == {}


def test_eval_fields_match_a_restarted_rank_by_step():
    """A rank restarted mid-run evaluated fewer steps, from a later one on: the curve keeps every step rank 0
    evaluated, each at the slowest clock of the ranks that evaluated that step (not paired by list position)."""
    rank0 = {"time_to_target_s": 4.16, "steps_to_target": 416, "eval_s": 0.1,
             "evals": [{"step": s, "time_s": s / 100, "test_accuracy": s / 500} for s in range(16, 417, 16)]}
    rank1 = {"time_to_target_s": 4.3, "steps_to_target": 416, "eval_s": 0.1,
             "evals": [{"step": s, "time_s": s / 100 + 0.14, "test_accuracy": s / 500} for s in range(224, 417, 16)]}
    f = br.eval_fields([rank0, rank1])
    assert [p["step"] for p in f["evals"]] == list(range(16, 417, 16))
    assert f["evals"][0]["time_s"] == 0.16 and f["evals"][-1]["time_s"] == 4.16 + 0.14


def test_plot_draws_the_curves(tmp_path):
    r = _report()
    br.add_time_to_accuracy(r, 0.9)
    bench_plot.plot(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000



def test_rows_live_ride_along_the_curve_and_get_their_own_axis(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def res(rows):
        return {"time_to_target_s": None, "eval_s": 0.1, "evals": [
            {"step": 10 * (i + 1), "time_s": 1.0 + i, "test_accuracy": 0.7, "table_rows_live": n}
            for i, n in enumerate(rows)]}
    f = br.eval_fields([res([100, 150]), res([0, 0])])
    assert [p["table_rows_live"] for p in f["evals"]] == [100, 150]           # rank 0's count, the one that reads it
    fig, ax = plt.subplots()
    bench_plot._rows_live(ax, ["a"], [{"evals": [{"step": 1, "time_s": 1.0}]}])
    assert len(fig.axes) == 1                                                 # nothing to draw: no second axis
    bench_plot._rows_live(ax, ["a"], [f])
    assert len(fig.axes) == 2 and fig.axes[1].lines[0].get_ydata().tolist() == [0.1, 0.15]
    plt.close(fig)
    r = _report()
    next(iter(r["modes"].values()))["evals"] = f["evals"]
    br.add_time_to_accuracy(r, 0.9)
    bench_plot.plot(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_skip_to_moves_the_loop_to_the_jobs_step_never_back_and_never_past_the_end(monkeypatch):
    run, _ = _recorder(monkeypatch, steps=20)
    seen = []
    for step in run.steps():
        seen.append(step)
        if step == 2:
            run.skip_to(12)          # a healed torchft replica: the job is at step 12
        if step == 13:
            run.skip_to(5)           # behind the loop: ignored
        if step == 14:
            run.skip_to(99)          # past the end: the loop ends
    assert seen == [0, 1, 2, 12, 13, 14]


def test_round_cell_says_how_much_of_the_deltas_a_lossy_round_payload_carried():
    assert br.round_cell(None, {"payload_energy_share": 0.08}) == "—"
    assert br.round_cell(0.0144, {"payload_energy_share": 0.081}) == "0.014 (8 % carried)"
    assert br.round_cell(0.5, {"payload_energy_share": 0.99999}) == "0.500"       # int8: all but rounding
    assert br.round_cell(2.0, {}) == "2.000"                                       # fp32 rounds measure nothing
