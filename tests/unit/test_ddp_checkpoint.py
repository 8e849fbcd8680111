"""A DDP job restartable by torchrun (worker/elastic.py, --ddp-checkpoint-dir): the checkpoint round trip
and the training clock of a restarted job, which counts the time the failure cost and carries the evaluations."""
import logging
from types import SimpleNamespace

import pytest
import torch

from deltaps.config import TrainConfig
from worker.elastic import ElasticCheckpoint, restore
from worker.trainers import base
from worker.trainers.strategy import load_job


class Clocks:
    def __init__(self):
        self.perf, self.wall = 100.0, 1_000.0

    def advance(self, s):
        self.perf += s
        self.wall += s


def _recorder(monkeypatch, clocks, **cfg):
    monkeypatch.setattr(base, "time", SimpleNamespace(perf_counter=lambda: clocks.perf, time=lambda: clocks.wall))
    return base.RunRecorder(TrainConfig(progress=False, **cfg), 0, "t", logging.getLogger("t"))


def test_a_restarted_job_clock_counts_what_the_failure_cost_and_keeps_its_evaluations(monkeypatch):
    clocks = Clocks()
    first = _recorder(monkeypatch, clocks, steps=100, eval_every=4)
    first.resume(clocks.wall)                       # a fresh job: its origin is now
    for step in first.steps():
        clocks.advance(1.0)
        first.record(1.0)
        first.evaluate(lambda: (clocks.advance(0.5), {"test_accuracy": 0.1})[1])
        if step + 1 == 8:
            saved = first.clock_state()              # the checkpoint after step 8 (and its evaluation)
        if step + 1 == 10:
            break                                    # killed after 10 steps: 2 steps lost
    assert saved["eval_s"] == pytest.approx(1.0) and [e["step"] for e in saved["evals"]] == [4, 8]
    clocks.advance(7.0)                              # restart, rendezvous, start-up
    again = _recorder(monkeypatch, clocks, steps=100, eval_every=4)
    again.resume(saved["origin_wall"], saved["eval_s"], saved["evals"])
    for _ in again.steps(first=8):
        clocks.advance(1.0)
        again.record(1.0)
        again.evaluate(lambda: {"test_accuracy": 0.9})
        break
    # wall since the first start: 10 steps + 1 s of evaluation + 7 s down + 1 step = 19 s; evaluations carried: 1 s
    assert again.training_s() == pytest.approx(18.0)
    assert [e["step"] for e in again.evals] == [4, 8]


def test_checkpoint_round_trip_restores_model_optimizer_and_step(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    run = SimpleNamespace(clock_state=lambda: {"origin_wall": 5.0, "eval_s": 1.5, "evals": [{"step": 16, "time_s": 2.0}]})
    ElasticCheckpoint(str(tmp_path), 16, rank=1).save(32, model, [opt], run)     # not rank 0: writes nothing
    assert ElasticCheckpoint(str(tmp_path), 16, rank=1).load() is None
    ck = ElasticCheckpoint(str(tmp_path), 16, rank=0)
    ck.save(32, model, [opt], run)
    assert ck.due(32) and not ck.due(33)
    other = torch.nn.Linear(4, 2)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    state = ck.load()
    assert restore(state, other, [other_opt]) == 32 and state["origin_wall"] == 5.0 and state["evals"][0]["step"] == 16
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert other_opt.state_dict()["state"][0]["step"] == 1
    with pytest.raises(ValueError, match="--ddp-checkpoint-every"):
        ElasticCheckpoint(str(tmp_path), 0, rank=0)


def test_a_checkpointed_ddp_job_takes_only_hooks_without_state():
    assert load_job(None, {"mode": "allreduce", "ddp_checkpoint_dir": "/tmp/x", "ddp_hook": "fp16"})
    with pytest.raises(ValueError, match="hooks without state"):
        load_job(None, {"mode": "allreduce", "ddp_checkpoint_dir": "/tmp/x", "ddp_hook": "powersgd:rank=4"})
