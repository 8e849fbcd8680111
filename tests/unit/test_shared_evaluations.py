"""--eval-cache: ranks of one host evaluate a model state once (worker/shared_evaluations.py). Ranks here are threads,
each with its own open lock file (flock locks an open file, so they exclude each other as processes do); real worker
processes: tests/cluster/test_launch.py."""
import json
import threading
import time

import torch
from torch import nn

from worker.shared_evaluations import SharedEvaluations, model_digest


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))


def _slow_evaluation(calls_path: str):
    def evaluate(model: nn.Module) -> dict:
        with open(calls_path, "a") as f:      # one line per evaluation actually run, whichever process ran it
            f.write("x\n")
        time.sleep(0.3)                       # long enough for the other ranks to arrive meanwhile
        w = model[0].weight
        return {"test_accuracy": float(w.detach().sum()) + 0.1 + 0.2, "test_correct": int(w.numel()), "reached": False}
    return evaluate


def _run_ranks(tmp_path, seeds):
    calls = tmp_path / "calls.txt"
    start, results = threading.Barrier(len(seeds)), [None] * len(seeds)
    models = [_model(s) for s in seeds]

    def rank(i: int) -> None:
        start.wait()
        results[i] = SharedEvaluations(str(tmp_path / "evals"), _slow_evaluation(str(calls)))(models[i])
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, len(calls.read_text().splitlines())


def test_four_ranks_holding_one_model_evaluate_it_once(tmp_path):
    results, evaluations = _run_ranks(tmp_path, [0, 0, 0, 0])
    assert evaluations == 1
    assert all(r == results[0] for r in results)
    assert results[0] == _slow_evaluation(str(tmp_path / "again.txt"))(_model(0))   # exactly, floats included


def test_ranks_holding_different_models_each_evaluate_their_own(tmp_path):
    results, evaluations = _run_ranks(tmp_path, [0, 1, 0])
    assert evaluations == 2
    mine = {s: _slow_evaluation(str(tmp_path / "again.txt"))(_model(s)) for s in (0, 1)}
    assert sorted(json.dumps(r, sort_keys=True) for r in results) == \
        sorted(json.dumps(mine[s], sort_keys=True) for s in (0, 1, 0))


def test_the_same_rank_reads_a_model_it_already_scored(tmp_path):
    calls = tmp_path / "calls.txt"
    shared = SharedEvaluations(str(tmp_path / "evals"), _slow_evaluation(str(calls)))
    model = _model(0)
    first = shared(model)
    assert shared(model) == first and len(calls.read_text().splitlines()) == 1    # read back, not run again
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-7         # one ulp-sized change is another model
    assert shared(model) != first
    assert len(calls.read_text().splitlines()) == 2


def test_the_digest_covers_values_buffers_names_and_dtypes():
    a, b = _model(0), _model(0)
    assert model_digest(a) == model_digest(b)
    b[1].running_mean += 1.0                   # a buffer
    assert model_digest(a) != model_digest(b)
    assert model_digest(_model(0).double()) != model_digest(_model(0))
    renamed = nn.Sequential()
    renamed.add_module("first", _model(0)[0])
    renamed.add_module("second", _model(0)[1])
    assert model_digest(renamed) != model_digest(_model(0))


def test_only_strategies_that_evaluate_alone_share():
    """A TorchRec rank's forward is an all-to-all (a rank waiting on the lock would hang the evaluating one); a hybrid
    model's tables live on the shards, outside the digest: neither takes the cache."""
    from worker.trainers.strategy import strategy_class
    assert not strategy_class("torchrec").evaluates_alone
    assert not strategy_class("hybrid").evaluates_alone
    assert all(strategy_class(m).evaluates_alone for m in ("ps", "allreduce", "torchft"))
