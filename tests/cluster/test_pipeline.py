"""--mode pipeline (worker/trainers/pipeline.py): pipeline stages x data-parallel replicas, stage gradients through the PS.

The multi-process tests start real clusters (`deltaps launch`): shards, S x D gloo workers."""
import json

import pytest
import torch
import torch.nn.functional as F

from deltaps.cli import main as cli_main
from deltaps.tools.launch import launch
from worker.trainers.pipeline import grid, split_stages
from worker.trainers.strategy import load_job as load_config
from worker.workloads.digits import load_digits_split
from worker.workloads.mlp import make_mlp, worker_batches

SGD = dict(mode="pipeline", servers=2, steps=6, batch_size=32, microbatches=4, optimizer="sgd", momentum=0.0,
           lr=0.1, hidden=64, layers=2, progress=False, timeout_s=30.0)


def reference_sgd(cfg, replicas: int) -> dict[str, torch.Tensor]:
    """The oracle: plain SGD in one process on the same micro-batch sequence: per step, the gradient is the mean
    over the `replicas` x M micro-batches of each micro-batch's mean loss. Returns make_mlp's state_dict."""
    x_tr, y_tr, _, _ = load_digits_split(cfg.seed)
    model = make_mlp(x_tr.shape[1], cfg.hidden, cfg.layers, 10, cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    its = [worker_batches(x_tr, y_tr, d, replicas, cfg.batch_size, cfg.seed) for d in range(replicas)]
    for _ in range(cfg.steps):
        opt.zero_grad()
        for it in its:
            xb, yb = next(it)
            for xm, ym in zip(xb.tensor_split(cfg.microbatches), yb.tensor_split(cfg.microbatches)):
                (F.cross_entropy(model(xm), ym) / (replicas * cfg.microbatches)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("stages,replicas,schedule", [(2, 1, "gpipe"), (2, 2, "1f1b")])
def test_pipeline_matches_single_process_sgd(tmp_path, stages, replicas, schedule):
    """S stages x D replicas with server-side SGD end at the parameters of one process running SGD on the
    same micro-batch sequence (gradient = mean over the D x M micro-batches of a step)."""
    out = tmp_path / "model.pt"
    cfg = load_config(None, {**SGD, "workers": stages * replicas, "pipeline_stages": stages,
                             "pipeline_schedule": schedule, "save_model": str(out)})
    summary = launch(cfg, quiet=True)
    got, ref = torch.load(out), reference_sgd(cfg, replicas)
    init = make_mlp(64, cfg.hidden, cfg.layers, 10, cfg.seed).state_dict()
    assert set(got) == set(ref)
    assert max((ref[k] - init[k]).abs().max().item() for k in ref) > 1e-3       # training moved them
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert diff < 1e-5, diff
    w = summary["per_worker"]
    assert [(r["stage"], r["replica"]) for r in w] == [(r % stages, r // stages) for r in range(stages * replicas)]
    assert all(r["pipeline_schedule"] == schedule and r["microbatches"] == 4 for r in w)
    assert len(summary["loss_curve_rank0"]) == cfg.steps and all(loss > 0 for loss in summary["loss_curve_rank0"])
    # each stage's keys advanced once per step on the shards (BSP over the D replicas of that stage)
    stats = summary["server_stats"]
    assert all(s["min_version"] == s["max_version"] == cfg.steps for s in stats)
    assert all(s["live_workers"] == list(range(replicas)) for s in stats)    # PS job: worker id = replica
    assert sum(s["grads_applied"] for s in stats) == cfg.steps * sum(s["num_keys"] for s in stats)


@pytest.mark.slow
def test_pipeline_digits_accuracy_through_launch(tmp_path):
    """`deltaps launch --mode pipeline` (2 stages x 2 replicas, GPipe, 4 micro-batches) trains digits to >= 95 %."""
    js = tmp_path / "out.json"
    # the CLI in this process: the job's processes fork from the session's zygote (conftest)
    assert cli_main(["launch", "--mode", "pipeline", "--workers", "4", "--pipeline-stages", "2", "--microbatches", "4",
                     "--pipeline-schedule", "gpipe", "--servers", "2", "--steps", "300", "--batch-size", "32", "--lr",
                     "0.002", "--no-progress", "--json", str(js)]) == 0
    s = json.loads(js.read_text())
    assert s["mode"] == "pipeline" and s["workers"] == 4
    assert s["final_test_accuracy"] >= 0.95, s["final_test_accuracy"]


def test_split_stages_and_grid():
    m = make_mlp(64, 32, 3)         # Linear, ReLU x 3, Linear: 4 parametrised blocks
    parts = split_stages(m, 2)
    assert [list(p._modules) for p in parts] == [["0", "1", "2", "3"], ["4", "5", "6"]]
    assert [n for p in parts for n, _ in p.named_parameters()] == [n for n, _ in m.named_parameters()]
    assert len(split_stages(m, 4)) == 4
    with pytest.raises(ValueError, match="pipeline stages"):
        split_stages(m, 5)
    x = torch.randn(5, 64)
    y = x
    for p in parts:
        y = p(y)
    assert torch.equal(y, m(x))
    assert grid(5, 6, 2) == (1, 2, 3) and grid(0, 4, 2) == (0, 0, 2)


def test_pipeline_config_validation():
    ok = load_config(None, {"mode": "pipeline", "workers": 4, "pipeline_stages": 2, "microbatches": 8})
    assert ok.pipeline_schedule == "gpipe"
    for bad, msg in [({"workers": 3}, "multiple of --pipeline-stages"), ({"microbatches": 5}, "divide --batch-size"),
                     ({"pipeline_schedule": "zb"}, "unknown pipeline schedule"), ({"pipeline_stages": 4}, "layers"),
                     ({"sync": "asp"}, "bsp only"), ({"workload": "ctr"}, "a workload with an MLP")]:
        with pytest.raises(ValueError, match=msg):
            load_config(None, {"mode": "pipeline", "workers": 4, "pipeline_stages": 2, **bad})
