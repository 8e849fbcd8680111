"""The `lm` workload (worker/workloads/lm.py): held-out text never trained on, a causal model, a loss that
falls with training, a target on the loss (lower is better)."""
import sysconfig
from pathlib import Path

import pytest
import torch

from worker.trainers.strategy import load_job
from worker.workloads import get_workload
from worker.workloads.lm import CONTEXT, stdlib_text

SMALL = {"workload": "lm", "hidden": 32, "layers": 1, "batch_size": 16, "seed": 0}


def test_splits_are_whole_files_and_disjoint():
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    total = sum(len(f.read_bytes()) for f in files)
    parts = [stdlib_text(s) for s in ("train", "validation", "test")]
    assert sum(len(p) for p in parts) == total and all(len(p) > 10_000 for p in parts)
    assert bytes(parts[2][:2000]) not in bytes(parts[0])        # a test file's text is not in the training text


def test_the_model_is_causal_and_learns():
    torch.manual_seed(0)
    w = get_workload(load_job(None, SMALL))
    model = w.build_model()
    x = w.eval_windows[:2, :-1].clone()
    y = x.clone()
    y[:, CONTEXT // 2:] = (y[:, CONTEXT // 2:] + 1) % 256                  # change the second half only
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :CONTEXT // 2], b[:, :CONTEXT // 2], atol=1e-5)   # no peeking ahead
    assert not torch.allclose(a[:, -1], b[:, -1])
    before = w.evaluate(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = w.batches(0, 1)
    for _ in range(40):
        opt.zero_grad()
        w.loss(model, next(batches)).backward()
        opt.step()
    after = w.evaluate(model)
    assert after["test_bits_per_byte"] < before["test_bits_per_byte"] - 2.0, (before, after)
    assert w.reaches(after, after["test_bits_per_byte"]) and not w.reaches(after, after["test_bits_per_byte"] - 0.1)


def test_rules():
    with pytest.raises(ValueError, match="multiple of 4"):
        load_job(None, {**SMALL, "hidden": 30})
    with pytest.raises(ValueError, match="use --target-loss, not --target-accuracy"):
        load_job(None, {**SMALL, "eval_every": 10, "target_accuracy": 0.5})
    with pytest.raises(ValueError, match="stack of layers"):
        load_job(None, {**SMALL, "mode": "pipeline", "workers": 2})
    assert load_job(None, {**SMALL, "eval_every": 10, "target_loss": 2.5}).target_loss == 2.5
