"""bench compare --seeds (deltaps/tools/bench_seeds.py): medians over seeds, time to target only when every seed
reached it, its range, the per-seed figures kept; the report's table shows the range. No processes."""
from deltaps.tools import bench_report as br
from deltaps.tools.bench_seeds import merge


def _run(seed, t, steps, step_ms, acc=0.9):
    return {"seed": seed, "time_to_target_s": t, "steps_to_target": steps, "median_step_s": step_ms / 1e3,
            "final_test_accuracy": acc, "steps": steps or 600, "samples_per_s": 100.0 * seed + 1, "mode": "ps",
            "evals": [{"step": 10, "time_s": 0.1, "test_accuracy": acc}]}


def test_medians_and_range_when_every_seed_reached():
    m = merge([_run(0, 4.0, 300, 9.0), _run(1, 6.0, 340, 10.0), _run(2, 5.0, 320, 12.0)])
    assert m["time_to_target_s"] == 5.0 and m["time_to_target_range_s"] == [4.0, 6.0]
    assert m["steps_to_target"] == 320 and m["steps_to_target_range"] == [300, 340]
    assert m["median_step_s"] == 0.010 and m["samples_per_s"] == 101.0       # every number: its median
    assert m["mode"] == "ps" and m["evals"] == _run(0, 4.0, 300, 9.0)["evals"]   # the rest: the first seed's
    assert [s["seed"] for s in m["seeds"]] == [0, 1, 2] and m["seeds"][1]["time_to_target_s"] == 6.0


def test_nested_figures_are_medians_too():
    """cpu_cores_in_training is a dict per seed: the mode's figures are their medians, each seed's stay in seeds."""
    cores = [{"worker_main": w, "servers": s, "host_cores": 2} for w, s in ((1.6, 0.1), (1.9, 0.3), (1.7, 0.2))]
    runs = [{**_run(i, 4.0 + i, 300, 9.0), "cpu_cores_in_training": c} for i, c in enumerate(cores)]
    m = merge(runs)
    assert m["cpu_cores_in_training"] == {"worker_main": 1.7, "servers": 0.2, "host_cores": 2}
    assert [s["cpu_cores_in_training"] for s in m["seeds"]] == cores


def test_a_seed_that_missed_makes_the_mode_not_reached():
    m = merge([_run(0, 4.0, 300, 9.0), _run(1, None, None, 10.0), _run(2, 5.0, 320, 12.0)])
    assert m["time_to_target_s"] is None and m["steps_to_target"] is None     # never a median of the lucky ones
    assert m["time_to_target_range_s"] == [4.0, 5.0]
    assert br.time_cells(m)[0] == "not reached (4.00-5.00, 1 missed)"


def test_a_failed_seed_fails_the_mode_and_says_which():
    m = merge([_run(0, 4.0, 300, 9.0), {"seed": 1, "error": "worker 2 failed"}])
    assert m["error"].startswith("1 of 2 seeds failed; seed 1: worker 2 failed")


def test_the_table_and_header_show_seeds_and_ranges():
    m = merge([_run(0, 4.0, 300, 9.0), _run(1, 6.0, 340, 10.0), _run(2, 5.0, 320, 12.0)])
    assert br.time_cells(m)[0] == "5.00 s (4.00-6.00)"
    assert br.seed_text({"seed": 0, "seeds": [0, 1, 2]}) == "seeds 0-2 (figures: medians over them)"
    assert br.seed_text({"seed": 3, "seeds": [3]}) == "seed 3"


def test_a_capped_seed_marks_the_mode_and_what_it_measured_stays():
    """A peer past the cap (it ran to its end) is 'not reached within the cap' with what it measured; merged, the
    mode says how many seeds the cap took and keeps the median of what every seed measured."""
    from deltaps.tools import bench_protocol as bp
    runs = [_run(0, 4.0, 300, 9.0), _run(1, 20.0, 340, 10.0), _run(2, 5.0, 320, 12.0)]
    bp.apply_time_cap(runs[1], 15.0, 3)
    assert runs[1]["time_to_target_s"] is None and runs[1]["time_to_target_uncapped_s"] == 20.0
    m = merge(runs)
    assert m["capped"].startswith("1 of 3 seeds: seed 1 reached after 20.00 s")
    assert m["time_to_target_s"] is None and m["time_to_target_uncapped_s"] == 5.0
    assert m["steps_to_target_uncapped"] == 320
    assert br.time_cells(m)[0].startswith("not reached within the cap (reached after 5.00 s)")
    assert "seed" not in m                                      # a median of seed numbers means nothing
    other = {"time_to_target_s": 2.5}
    assert br._ratio(m, other) == 2.0                           # x vs ddp: the reference's measured time


def test_even_seed_counts_give_evaluated_steps_and_missing_numbers_are_null():
    a, b = _run(0, 4.0, 336, 9.0), _run(1, 6.0, 352, 10.0)
    a["start_skew_s"] = 0.9                                     # only seed 0 has it: not seed 0's figure, null
    m = merge([a, b])
    assert m["steps_to_target"] == 336 and m["time_to_target_s"] == 5.0   # a step some seed evaluated
    assert m["start_skew_s"] is None


def test_the_run_order_turns_round_every_other_seed_with_the_peers_first_when_they_set_the_cap():
    from deltaps.tools.bench_report import is_peer
    from deltaps.tools.bench_seeds import run_order
    specs = ["torchft:diloco:sync=32", "ps-local32:int8", "ddp", "ps-local32:lowbit:bits=2"]
    assert run_order(specs, 0, False, is_peer) == specs
    assert run_order(specs, 1, False, is_peer) == specs[::-1]
    assert run_order(specs, 0, True, is_peer) == ["torchft:diloco:sync=32", "ddp", "ps-local32:int8",
                                                  "ps-local32:lowbit:bits=2"]
    assert run_order(specs, 1, True, is_peer) == ["ps-local32:lowbit:bits=2", "ps-local32:int8", "ddp",
                                                  "torchft:diloco:sync=32"]
    assert run_order(specs, 2, True, is_peer) == run_order(specs, 0, True, is_peer)
    for i in range(4):     # every mode once per seed
        assert sorted(run_order(specs, i, i % 3 == 0, is_peer)) == sorted(specs)


def test_a_mode_that_runs_before_its_seeds_peers_stops_at_a_wider_cap_from_the_previous_seed():
    from deltaps.tools.bench_protocol import LIVE_CAP_MARGIN
    from deltaps.tools.bench_report import is_peer
    from deltaps.tools.bench_seeds import live_cap
    peer = "torchft:diloco:sync=32"
    store = {peer: [{"seed": 10, "time_to_target_s": 4.0}, {"seed": 11, "time_to_target_s": 5.0}],
             "ddp": [{"seed": 10, "time_to_target_s": 3.0}, {"seed": 11, "time_to_target_s": None}],
             "ps-local32:int8": [{"seed": 10, "time_to_target_s": 1.0}]}      # not a peer: sets no cap
    seeds = [10, 11, 12]
    assert live_cap(store, seeds, 1, 3.0, is_peer) == 3.0 * 5.0           # the peers ran first: the seed's own cap
    assert live_cap(store, seeds, 2, 3.0, is_peer) == LIVE_CAP_MARGIN * 3.0 * 5.0   # not yet: the previous, widened
    assert live_cap(store, seeds, 0, None, is_peer) is None              # no --time-cap
    assert live_cap({peer: [{"seed": 11, "time_to_target_s": 5.0}]}, seeds, 0, 3.0, is_peer) is None   # seed 10
    # the seed's peers ran and none reached the target (or every one failed): no cap, never the previous seed's
    missed = {peer: [{"seed": 10, "time_to_target_s": 4.0}, {"seed": 11, "error": "boom"}]}
    assert live_cap(missed, seeds, 1, 3.0, is_peer) is None
    assert live_cap({peer: [{"seed": 10, "time_to_target_s": 4.0}]}, seeds, 1, 3.0, is_peer) == LIVE_CAP_MARGIN * 12.0


def test_a_stop_at_the_live_cap_is_judged_again_by_the_seeds_own_cap():
    from deltaps.tools.bench_protocol import apply_time_cap
    def stopped(at):
        return {"capped": "not reached within the cap", "cap_s": at, "time_to_target_s": None, "steps": 96}
    within = stopped(15.0)
    apply_time_cap(within, 12.0, 3.0)            # the seed's cap is tighter: past it as well
    assert within["cap_s"] == 12.0 and "= 12.00 s" in within["capped"] and "live_cap_s" not in within
    unknown = stopped(15.0)
    apply_time_cap(unknown, 20.0, 3.0)           # looser: whether it would have made it is not known
    assert unknown["live_cap_s"] == 15.0 and unknown["cap_s"] == 20.0 and "not known" in unknown["capped"]
    assert unknown["time_to_target_s"] is None    # never counted as reached
    none = stopped(15.0)
    apply_time_cap(none, None, 3.0)              # no peer reached the target in this seed
    assert "this seed's cap is none" in none["capped"] and none["cap_s"] is None
    same = stopped(12.0)
    apply_time_cap(same, 12.0, 3.0)              # the peers ran first: the seed's own cap stopped it
    assert same == stopped(12.0)
