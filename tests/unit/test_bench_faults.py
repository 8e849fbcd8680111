"""bench compare's fault script (deltaps/tools/bench_faults.py) and --straggler (TrainConfig.straggler_of,
RunRecorder.straggle): grammar, the kill / restart sequence against real processes, goodput."""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaps.tools import bench_faults, process_tree
from deltaps.tools.bench_faults import Kill, KillScript, parse_kill
from worker.trainers.strategy import load_job


def test_kill_grammar():
    assert parse_kill("1@4.5:restart=2") == Kill(1, 4.5, 2.0)
    assert parse_kill(" 3@10 ") == Kill(3, 10.0, None)
    assert str(parse_kill("2@3:restart=2")) == "2@3:restart=2"
    assert parse_kill("1@33%:restart=2") == Kill(1, 33.0, 2.0, percent=True)
    assert str(parse_kill("1@33%")) == "1@33%"
    for bad in ("1", "x@2", "1@", "1@2:restart", "1@2:again=3", "-1@2", "1@%"):
        with pytest.raises(ValueError, match="WORKER@SECONDS"):
            parse_kill(bad)


def test_a_percent_kill_is_a_share_of_the_healthy_time_to_target():
    assert parse_kill("1@25%:restart=2").resolved(8.0) == Kill(1, 2.0, 2.0)
    assert parse_kill("1@3").resolved(None) == Kill(1, 3.0)
    with pytest.raises(ValueError, match="did not reach the target"):
        parse_kill("1@25%").resolved(None)


def test_variants_and_checks():
    args = argparse.Namespace(straggler="", kill=[], workers=4, eval_every=16)
    assert bench_faults.variants(args) == [("", {}, [])]
    args.straggler, args.kill = "3:2", [Kill(1, 2.0, 2.0)]
    assert bench_faults.variants(args) == [("healthy", {"straggler": ""}, []),
                                           ("faulty", {"straggler": "3:2"}, [Kill(1, 2.0, 2.0)])]
    for worker in (4, 0):      # rank 0 keeps the clock and judges: never killed
        args.kill = [Kill(worker, 1.0)]
        with pytest.raises(ValueError, match=f"worker {worker} is not one of workers 1 .. 3"):
            bench_faults.check(args)
    args.kill, args.eval_every = [Kill(1, 1.0)], 0
    with pytest.raises(ValueError, match="needs --eval-every"):
        bench_faults.check(args)


def test_goodput_is_healthy_over_faulty():
    assert bench_faults.goodput(9.0, 10.0) == 0.9
    assert bench_faults.goodput(None, 10.0) is None and bench_faults.goodput(9.0, None) is None
    report = {"modes": {"a": {"time_to_target_s": 4.0, "seeds": [{"time_to_target_s": 4.0}]}}}
    bench_faults.add_goodput(report, {"a": {"time_to_target_s": 3.0, "seeds": [{"time_to_target_s": 3.0}]}})
    a = report["modes"]["a"]
    assert a["goodput"] == 0.75 and a["healthy_time_to_target_s"] == 3.0 and a["seeds"][0]["goodput"] == 0.75


def _sleeper():
    return subprocess.Popen(["sleep", "60"])


def test_kill_script_follows_the_training_clock_restarts_and_never_shows_a_failure():
    workers = [_sleeper(), _sleeper(), _sleeper()]
    first = list(workers)
    relaunched = []
    trained = [None]         # rank 0's training clock, advanced by hand

    def relaunch(rank):
        relaunched.append(rank)
        return _sleeper()
    script = KillScript([Kill(1, 2.0, 0.1), Kill(2, 5.0)], workers, relaunch, lambda: trained[0])
    seen = []
    script.start()
    try:
        for t in (None, 0.5, 1.9):              # before the first kill's time: nothing happens
            trained[0] = t
            time.sleep(0.1)
            assert all(p.poll() is None for p in workers) and not script.events
        trained[0] = 2.0
        while not relaunched:
            seen.extend(p.poll() for p in workers)
            time.sleep(0.01)
        assert first[1].poll() == -9 and workers[2] is first[2] and first[2].poll() is None
        trained[0] = 5.5
        script.join(5)
        assert not script.is_alive()
        assert first[2].poll() == -9 and workers[2].poll() == 0     # worker 2 is gone for good: counted as done
        assert relaunched == [1] and workers[1].poll() is None      # worker 1 runs again
        assert all(code in (None, 0) for code in seen)              # the bench never sees a failed exit code
        assert [(e["worker"], "killed" in e) for e in script.events] == [(1, True), (1, False), (2, True)]
        assert [e["training_s"] for e in script.events if "killed" in e] == [2.0, 5.5]
    finally:
        script.stop()
        for p in workers + first:
            p.kill()
            p.wait()


def test_straggler_grammar_and_factor():
    cfg = load_job(None, {"workers": 4, "straggler": "3:2"})
    assert cfg.straggler_of(3) == 2.0 and cfg.straggler_of(0) == 1.0
    assert load_job(None, {"workers": 4}).straggler_of(3) == 1.0
    for bad in ("4:2", "3:0.5", "x:2", "3", "3:inf"):
        with pytest.raises(ValueError, match="--straggler"):
            load_job(None, {"workers": 4, "straggler": bad})


def test_a_straggling_step_takes_factor_times_its_compute():
    import logging

    from worker.trainers.base import RunRecorder
    run = RunRecorder(load_job(None, {"workers": 2, "steps": 3, "progress": False}), 0, "w0", logging.getLogger("t"))
    for _ in run.steps():
        busy = time.perf_counter() + 0.01
        while time.perf_counter() < busy:
            pass
        run.comm(0.0)
        run.straggle(3.0)
        run.record(1.0)
    extras = run.straggler_extras(3.0)
    assert extras["straggler_sleep_s"] == pytest.approx(2 * extras["straggler_compute_s"])
    assert extras["straggler_achieved_factor"] == pytest.approx(3.0)
    assert run.straggler_extras(1.0) == {}


def test_a_kill_takes_the_whole_process_tree_even_children_in_a_session_of_their_own():
    # a parent that starts a child in a new session, as torchrun's agent starts its worker
    parent = bench_faults.TreeProcess([sys.executable, str(Path(__file__).parents[1] / "session_parent.py")])
    deadline = time.monotonic() + 20
    while not process_tree.descendants(parent.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = process_tree.descendants(parent.pid)
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not process_tree.running(child):     # gone, or a zombie: dead, its parent gone before reaping it
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the child {child} outlived the kill of its parent's tree")


def test_torchrun_command_is_an_elastic_c10d_agent_per_node():
    cmd = bench_faults.torchrun_command(4, "10.0.0.5:29400", "10.0.0.7", hosts_store=False)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-1] == "-m"
    flags = dict(zip(cmd[3:-1:2], cmd[4:-1:2]))
    assert flags["--nnodes"] == "4" and flags["--nproc-per-node"] == "1" and flags["--rdzv-backend"] == "c10d"
    assert flags["--rdzv-endpoint"] == "10.0.0.5:29400" and flags["--local-addr"] == "10.0.0.7"
    assert flags["--rdzv-conf"].startswith("is_host=false,") and int(flags["--max-restarts"]) >= 2


def test_under_cpu_caps_a_straggler_is_its_nodes_cap_over_the_factor_not_a_sleep():
    overrides, slow = bench_faults.straggler_by_cap({"straggler": "3:2"}, caps=object(), workers=4)
    assert overrides == {"straggler": ""} and slow == (3, 2.0)
    assert bench_faults.straggler_by_cap({"straggler": "3:2"}, None, 4) == ({"straggler": "3:2"}, None)
    assert bench_faults.straggler_by_cap({"straggler": ""}, object(), 4) == ({"straggler": ""}, None)
    with pytest.raises(ValueError, match="bad --straggler"):      # the job's own grammar (config.parse_straggler)
        bench_faults.straggler_by_cap({"straggler": "4:2"}, object(), 4)


class _Caps:
    cores = 0.4

    def __init__(self):
        self.set = []

    def set_cores(self, node, cores):
        self.set.append((node, cores))


def test_a_capped_straggler_slows_only_once_its_rank_trains_and_is_restored(tmp_path):
    caps, log = _Caps(), tmp_path / "evals3.jsonl"
    cap = bench_faults.CapOnceTraining(caps, 7, 2.0, str(log))
    cap.start()
    time.sleep(0.1)
    assert caps.set == []                   # start-up: the others' cap
    log.write_text('{"started": true, "step": 0}\n')
    cap.join(2)
    assert caps.set == [(7, 0.2)]
    cap.stop()
    assert caps.set == [(7, 0.2), (7, 0.4)]


def test_a_capped_stragglers_achieved_factor_is_its_compute_per_step_over_the_others_median():
    fig = bench_faults.capped_straggler_figures(3, 2.0, [0.010, 0.012, 0.011, 0.022])
    assert fig["rank"] == 3 and fig["factor"] == 2.0 and fig["achieved_factor"] == pytest.approx(2.0)
