"""The trainer seam (worker/trainers/base.py, strategy.py, loop.py): one rule per derived figure, one result shape
for every mode, one loop, and no strategy reaching into another's internals. No sockets, no process groups."""
import ast
import logging
import re
from pathlib import Path

import pytest

from deltaps.config import TrainConfig
from worker.trainers.allreduce import allreduce_extras
from worker.trainers.base import COMMON_KEYS, FINAL_LOSS_WINDOW, RunRecorder, RunResult
from worker.trainers.hybrid import hybrid_extras
from worker.trainers.pipeline import pipeline_extras
from worker.workloads.ctr import ctr_extras

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ROOT / "worker" / "trainers"
STRATEGIES = ("ps.py", "allreduce.py", "hybrid.py", "pipeline.py", "torchft_peer.py", "torchrec_peer.py")
SHARED = ("worker.trainers.base", "worker.trainers.collective", "worker.trainers.context", "worker.trainers.devices",
          "worker.trainers.strategy")

# The result keys each mode wrote before the RunResult refactor: none may disappear.
COMMON = {"rank", "steps", "wall_s", "mean_step_s", "median_step_s", "compute_s", "comm_s", "wait_s",
          "bytes_pushed_wire", "bytes_pushed_raw", "bytes_pulled_wire", "loop_bytes_pulled_wire", "push_rpcs",
          "pull_rpcs", "push_pull_rpcs", "final_test_accuracy", "final_train_loss", "samples_per_s", "model_params",
          "losses", "codec", "final_codec", "codec_switches", "codec_fallbacks", "bytes_pushed_wire_steps"}
CTR = COMMON | {"final_test_auc", "final_test_loss", "oracle_auc", "oracle_loss", "workload"}
EXPECTED = {
    "ps": COMMON | {"server_stats"},
    "allreduce": COMMON | {"backend", "bucket_cap_mb", "grad_bytes_per_step", "ring_bytes_per_step",
                           "params_max_diff_across_ranks", "timing_method"},
    "ctr-allreduce": CTR | {"timing_method"},
    "ctr-ps": CTR | {"optimizer_note", "server_stats"},
    "hybrid": CTR | {"ps_modules", "sparse_bytes_pushed", "sparse_bytes_pulled", "dense_ring_bytes", "rows_pushed",
                     "timing_method", "server_stats"},
    "pipeline": COMMON | {"stage_params", "stage", "replica", "pipeline_stages", "replicas", "microbatches",
                          "pipeline_schedule", "stage_modules", "pipeline_s", "timing_method", "server_stats"},
}


def _result(**kw) -> RunResult:
    base = dict(rank=0, steps=30, wall_s=2.0, samples=30 * 32, final_test_accuracy=0.5, model_params=10)
    return RunResult(**{**base, **kw})


# ---- one rule per derived figure --------------------------------------------------------------------
def test_final_train_loss_is_the_mean_of_the_last_window():
    assert FINAL_LOSS_WINDOW == 20
    losses = [float(i) for i in range(30)]
    assert _result(losses=losses).final_train_loss == pytest.approx(sum(range(10, 30)) / 20)
    assert _result(losses=[4.0, 2.0, 3.0]).final_train_loss == pytest.approx(3.0)    # fewer than the window
    assert _result(losses=[]).final_train_loss == 0.0


def test_step_split_compute_comm_wait():
    r = _result(step_times=[1.0, 2.0, 3.0, 10.0], blocked_times=[0.5, 0.5, 1.0, 2.0], wait_times=[0.0, 0.25, 0.5, 1.0])
    assert r.wait_s == pytest.approx(1.75)
    assert r.comm_s == pytest.approx(4.0 - 1.75)                      # blocked - wait
    assert r.compute_s == pytest.approx(16.0 - 4.0)                   # step - blocked
    assert r.compute_s + r.comm_s + r.wait_s == pytest.approx(16.0)   # the three add up to the step time
    assert r.mean_step_s == pytest.approx(4.0)
    assert r.median_step_s == 3.0
    assert r.samples_per_s == pytest.approx(30 * 32 / 2.0)
    empty = _result(wall_s=0.0)
    assert (empty.mean_step_s, empty.median_step_s, empty.compute_s, empty.samples_per_s) == (0.0, 0.0, 0.0, 0.0)


def test_to_dict_has_the_common_keys_and_extras():
    assert set(COMMON_KEYS) == COMMON
    d = _result(extras={"backend": "gloo"}, bytes_pulled_wire=96).to_dict()
    assert set(d) == COMMON | {"backend"} and "server_stats" not in d
    assert d["loop_bytes_pulled_wire"] == 96                   # no pulls outside the loop unless a mode says so
    assert _result(bytes_pulled_wire=96, loop_bytes_pulled_wire=32).to_dict()["loop_bytes_pulled_wire"] == 32
    d = _result(losses=[1.0] * 30, server_stats=[{"version": 3}]).to_dict()
    assert d["server_stats"] == [{"version": 3}] and d["final_train_loss"] == 1.0
    with pytest.raises(ValueError, match="final_train_loss"):
        _result(extras={"final_train_loss": 0.0}).to_dict()


def test_recorder_feeds_the_result():
    cfg = TrainConfig(steps=30, batch_size=8, progress=False, log_every=0)
    run = RunRecorder(cfg, 1, "test", logging.getLogger("test"))
    for step in run.steps():
        run.comm(0.1, 0.03)
        run.comm(0.1)                                           # several blocked spans in one step add up
        run.record(float(step), wire_bytes=step, end=run.step_start + 0.5)
    res = run.result(final_test_accuracy=0.9, model_params=7)
    assert run.wall_s > 0 and res.wall_s == run.wall_s
    assert res.step_times == pytest.approx([0.5] * 30)
    assert res.compute_s == pytest.approx(30 * 0.3)
    assert res.comm_s == pytest.approx(30 * 0.17)
    assert res.wait_s == pytest.approx(30 * 0.03)
    assert res.final_train_loss == pytest.approx(19.5)          # mean of losses 10..29
    d = res.to_dict()
    assert d["rank"] == 1 and d["steps"] == 30 and d["bytes_pushed_wire_steps"] == list(range(30))
    assert d["samples_per_s"] == pytest.approx(30 * 8 / res.wall_s)


def test_recorder_skips_unknown_losses_and_broken_steps():
    cfg = TrainConfig(steps=5, progress=False)
    run = RunRecorder(cfg, 0, "test", logging.getLogger("test"))
    for step in run.steps(first=1):                             # a rejoining worker starts at its clock
        if step == 4:
            break                                               # e.g. SIGTERM: the step is not counted
        run.record(None if step == 2 else 1.0)
    assert len(run.step_times) == 3 and run.losses == [1.0, 1.0]


# ---- every mode reports through RunResult, with today's keys ----------------------------------------
def test_mode_results_keep_their_keys():
    ev = {"test_accuracy": 0.7, "test_auc": 0.8, "test_loss": 0.5, "oracle_auc": 0.9, "oracle_loss": 0.4}
    cfg = TrainConfig()
    stats = [{"version": 1}]
    built = {
        "ps": _result(codec="int8", final_codec="none", codec_fallbacks=[{"step": 3, "reason": "x"}],
                      server_stats=stats),
        "allreduce": _result(extras=allreduce_extras("gloo", 25.0, [400, 400], 2, 0.0)),
        "ctr-allreduce": _result(extras={**ctr_extras(ev), **allreduce_extras("gloo", 25.0, [400], 2, 0.0)}),
        "ctr-ps": _result(extras={**ctr_extras(ev), "optimizer_note": "n"}, server_stats=stats),
        "hybrid": _result(extras={**ctr_extras(ev), **hybrid_extras(["emb"], {"bytes_pushed_wire": 5}, 7)},
                          server_stats=stats),
        "pipeline": _result(extras=pipeline_extras(cfg, 1, 0, 1, 99, ["2"], 0.3), server_stats=stats),
    }
    for mode, res in built.items():
        keys = set(res.to_dict())
        assert keys >= COMMON, mode
        assert keys >= EXPECTED[mode], (mode, EXPECTED[mode] - keys)
    a = built["allreduce"].to_dict()
    assert a["grad_bytes_per_step"] == 400 and a["ring_bytes_per_step"] == 400
    h = built["hybrid"].to_dict()
    assert h["sparse_bytes_pushed"] == 5 and h["dense_ring_bytes"] == 7 and h["workload"] == "ctr"


def _tree(name: str) -> ast.Module:
    return ast.parse((TRAINERS / name).read_text())


def test_the_loop_builds_every_result_through_the_recorder():
    src = (TRAINERS / "loop.py").read_text()
    assert "RunRecorder(" in src and "run.result(" in src
    for name in STRATEGIES + ("loop.py", "strategy.py"):
        src = (TRAINERS / name).read_text()
        assert '"final_train_loss"' not in src and not re.search(r"losses\[-\d+:\]", src)   # the rule lives in base.py
        assert '"mean_step_s"' not in src and '"compute_s"' not in src
        assert "tqdm(" not in src                                               # the progress bar too
        if name in STRATEGIES:
            assert "RunRecorder(" not in src and "run.steps(" not in src, name      # one loop: loop.py


def test_trainers_import_no_private_names_and_no_tools():
    for path in sorted(TRAINERS.glob("*.py")) + sorted((ROOT / "worker" / "workloads").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("deltaps.tools", "deltaps.cli")), (path.name, node.module)
                if node.module.startswith("worker."):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, (path.name, node.module, private)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith(("deltaps.tools", "deltaps.cli")) for a in node.names), path.name


def test_strategies_import_no_other_strategy():
    """Strategies share base.py / collective.py / context.py / devices.py / strategy.py, never each other."""
    for name in STRATEGIES:
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("worker.trainers."):
                assert node.module in SHARED, (name, node.module)


def test_the_loop_imports_no_strategy_module():
    """Strategies register themselves (strategy.BUILTIN, loaded by name, as compression's codecs): the loop and the
    registry import none of them, and every built-in one is registered under the mode it names."""
    from worker.trainers.strategy import BUILTIN, available_strategies
    strategy_modules = {f"worker.trainers.{n.removesuffix('.py')}" for n in STRATEGIES}
    assert set(BUILTIN) == strategy_modules
    for name in ("loop.py", "strategy.py", "context.py", "base.py", "collective.py"):
        for node in ast.walk(_tree(name)):
            imported = ([node.module] if isinstance(node, ast.ImportFrom) else
                        [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not set(imported) & strategy_modules, (name, imported)
    assert available_strategies() == ["allreduce", "hybrid", "pipeline", "ps", "torchft", "torchrec"]


def test_cli_worker_run_is_short_and_mode_blind():
    tree = ast.parse((ROOT / "deltaps" / "cli" / "worker.py").read_text())
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert run.end_lineno - run.lineno + 1 <= 20
    assert "mode" not in ast.unparse(run)


def test_strategy_and_workload_methods_stay_short():
    for path in [*(TRAINERS / n for n in STRATEGIES + ("loop.py", "strategy.py")), *(ROOT / "worker" / "workloads").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for fn in (n for n in node.body if isinstance(n, ast.FunctionDef)):
                    assert fn.end_lineno - fn.lineno + 1 <= 50, (path.name, node.name, fn.name)


def test_trainer_modules_stay_small():
    for path in TRAINERS.glob("*.py"):
        assert len(path.read_text().splitlines()) < 400, path.name


def test_the_config_rules_name_no_workload():
    """TrainConfig.validate keeps the config's own rules; a workload's live with it (Workload.validate)."""
    import inspect
    rules = [TrainConfig.validate, TrainConfig._validate_local_updates, TrainConfig._validate_eval]
    for fn in rules:
        assert "workload" not in inspect.getsource(fn), fn.__name__


@pytest.mark.parametrize("workload", ["lm", "clf", "mlp"])
def test_torchft_fragments_hold_every_parameter_once(workload):
    # the lm's `position` is the root module's own parameter: a fragment that missed it left it unsynced,
    # each torchft replica training its own (the lm races before this test measured that handicapped peer)
    from worker.trainers.torchft_peer import fragments
    from worker.workloads.base import get_workload
    model = get_workload(TrainConfig(workload=workload, hidden=64, layers=2)).build_model()
    every = {id(p) for p in model.parameters()}
    blocks = len(fragments(model, 1)[0])         # one fragment: every top-level part with parameters
    assert blocks >= 2
    for count in range(1, blocks + 1):
        parts = fragments(model, count)
        held = [id(p) for part in parts for p in part.parameters()]
        assert len(parts) == count and len(held) == len(set(held)) and set(held) == every, count
    with pytest.raises(ValueError, match="top-level parts"):
        fragments(model, blocks + 1)


def test_a_process_group_teardown_that_hangs_is_left_behind_after_its_wait(caplog):
    """gloo's teardown can hang once the other ranks have gone (pytorch/pytorch#75097): the worker waits a bounded
    time, says so, and goes on to write its result; one that fails is said and does not discard the result."""
    import threading
    import time

    from worker.trainers.collective import destroy_process_group_within
    release = threading.Event()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="deltaps.worker"):
        assert destroy_process_group_within(0.2, destroy=release.wait) is False
    assert time.monotonic() - t0 < 5 and "did not finish in 0.2 s" in caplog.text
    release.set()
    assert destroy_process_group_within(5, destroy=lambda: None) is True

    def broken():
        raise RuntimeError("Connection closed by peer")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deltaps.worker"):     # the result stands: said, not raised
        assert destroy_process_group_within(5, destroy=broken) is False
    assert "teardown failed (RuntimeError: Connection closed by peer)" in caplog.text


@pytest.mark.parametrize("bad", [0.0, -5.0, float("inf"), float("nan")])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused_up_front(bad):
    # it bounds every wait and delays the end-of-job stack dump (faulthandler refuses <= 0 and inf after training)
    with pytest.raises(ValueError, match=r"--timeout-s must be a positive, finite number of seconds"):
        TrainConfig(timeout_s=bad).validate()
