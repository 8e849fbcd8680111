"""The `cancer` workload (worker/workloads/cancer.py): registered by its module alone, its data split and
sharded like every tabular workload, and its MLP learns it — trained here through the workload's own
batches, loss and evaluation, as every strategy does."""
import torch

from worker.trainers.strategy import load_job
from worker.workloads import available_workloads, get_workload


def test_cancer_is_registered_and_split():
    assert "cancer" in available_workloads()
    w = get_workload(load_job(None, {"workload": "cancer", "hidden": 32, "seed": 3}))
    assert w.x_tr.shape == (426, 30) and w.x_te.shape == (143, 30) and w.classes == 2
    assert abs(w.x_tr.mean().item()) < 1e-3                          # standardised on the training split
    again = get_workload(load_job(None, {"workload": "cancer", "seed": 3}))
    assert torch.equal(w.x_te, again.x_te)                           # the seed alone decides the split
    rows = [torch.cat([next(w.batches(r, 2))[0][0] for _ in range(3)]) for r in range(2)]
    assert not {tuple(x.tolist()) for x in rows[0]} & {tuple(x.tolist()) for x in rows[1]}   # disjoint shards


def test_cancer_trains_to_high_test_accuracy():
    cfg = load_job(None, {"workload": "cancer", "hidden": 32, "batch_size": 32, "seed": 0})
    w = get_workload(cfg)
    model = w.build_model()
    assert model(w.x_te).shape == (143, 2)
    before = w.evaluate(model)["test_accuracy"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = w.batches(0, 1)
    for _ in range(60):
        opt.zero_grad()
        w.loss(model, next(batches)).backward()
        opt.step()
    after = w.evaluate(model)["test_accuracy"]
    assert after >= 0.93 and after > before, (before, after)
