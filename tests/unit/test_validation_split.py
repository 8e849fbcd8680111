"""--eval-split validation (bench compare --select-on validation): evaluations on data held out of the training set,
never the test set, which stays exactly as a test-set run has it. No processes."""
import pytest
import torch

from worker.trainers.strategy import load_job
from worker.workloads import get_workload


def _clf(split):
    return get_workload(load_job(None, {"workload": "clf", "eval_split": split}))


def test_the_validation_set_comes_out_of_training_and_the_test_set_is_untouched():
    from worker.workloads.clf import load_clf_split
    test, val = _clf("test"), _clf("validation")
    x_tr, y_tr, x_te, y_te = load_clf_split(0)
    assert torch.equal(test.x_te, x_te) and torch.equal(test.x_tr, x_tr)         # a test run: as before
    assert len(val.y_te) == len(y_te) and len(val.y_tr) == len(y_tr) - len(y_te)    # held out of training
    rows = {tuple(r) for r in x_tr.tolist()}
    assert all(tuple(r) in rows for r in val.x_te.tolist())                       # validation rows are training rows
    assert not {tuple(r) for r in val.x_te.tolist()} & {tuple(r) for r in val.x_tr.tolist()}   # and trained on no more
    assert torch.bincount(val.y_te).min() >= 90                                   # stratified: ~100 per class


def test_lm_evaluates_its_validation_files_and_tables_have_no_validation():
    from worker.workloads.lm import stdlib_text
    lm = get_workload(load_job(None, {"workload": "lm", "eval_split": "validation", "hidden": 32, "layers": 1}))
    held = stdlib_text("validation").tobytes()
    assert bytes(lm.eval_windows[0].tolist()) in held
    with pytest.raises(ValueError, match="no validation split"):
        load_job(None, {"workload": "ctr", "eval_split": "validation"})
    with pytest.raises(ValueError, match="--eval-split must be"):
        load_job(None, {"eval_split": "train"})
