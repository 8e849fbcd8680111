"""Same seed, data, optimizer and steps: `--mode allreduce` and `--mode ps --codec none` (BSP, SGD) end with
the same parameters — the PS path computes exactly the mean-gradient update DDP does."""
from pathlib import Path

import pytest
import torch

from deltaps.cli import main as cli_main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path, mode):
    out = tmp_path / f"{mode}.pt"
    # the CLI in this process: the job's processes fork from the session's zygote (conftest)
    assert cli_main(["launch", "--config", str(ROOT / "configs" / "demo.yaml"), "--mode", mode, "--sync", "bsp",
                     "--codec", "none", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--steps", "25",
                     "--workers", "2", "--no-progress", "--save-model", str(out)]) == 0
    return torch.load(out)


def test_allreduce_and_ps_give_the_same_parameters(tmp_path):
    ar, ps = _train(tmp_path, "allreduce"), _train(tmp_path, "ps")
    assert ar.keys() == ps.keys()
    init = None
    for k in ar:
        assert torch.allclose(ar[k], ps[k], atol=1e-5, rtol=1e-4), (k, (ar[k] - ps[k]).abs().max())
    from worker.workloads.mlp import make_mlp
    init = make_mlp(64, 256, 2, 10, 0).state_dict()
    assert any(not torch.allclose(init[k], ar[k]) for k in ar)        # training really moved them
