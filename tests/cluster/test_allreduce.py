"""Ring-allreduce (DDP/gloo) baseline: same trainer, same result keys as the PS path."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from deltaps.cli.env import resolve_worker_env
from deltaps.tools.launch import free_port, launch
from worker.trainers.allreduce import Allreduce
from worker.trainers.collective import ring_bytes
from worker.trainers.context import RunContext
from worker.trainers.strategy import load_job as load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ring_bytes():
    assert ring_bytes(1000, 1) == 0
    assert ring_bytes(1000, 2) == 1000
    assert ring_bytes(1000, 4) == 1500      # 2(p-1)/p * G


def test_env_rendezvous_reads_torchrun_vars(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert _rendezvous(None, None, None, None) == (3, 4, "10.0.0.1", 1234)
    assert _rendezvous(0, 2, "127.0.0.1", 99) == (0, 2, "127.0.0.1", 99)    # flags win
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="needs --rank"):      # no rank anywhere: a clear error
        Allreduce.check_context(RunContext(*_rendezvous(None, None, None, None)[:2]))


def _rendezvous(rank, world_size, addr, port):
    """What `deltaps worker` resolves from flags, else torchrun's variables."""
    args = SimpleNamespace(servers=None, servers_pattern=None, num_shards=None, rank=rank, world_size=world_size,
                           master_addr=addr, master_port=port)
    resolve_worker_env(args)
    return args.rank, args.world_size, args.master_addr, args.master_port


def test_config_accepts_allreduce_mode():
    assert load_config(None, {"mode": "allreduce"}).mode == "allreduce"
    with pytest.raises(ValueError):
        load_config(None, {"mode": "ring"})


@pytest.mark.slow
def test_launch_allreduce_trains_digits_and_matches_ps_keys():
    cfg = load_config(None, {"mode": "allreduce", "workers": 2, "steps": 300, "progress": False})
    s = launch(cfg, quiet=True)
    assert s["mode"] == "allreduce"
    assert s["final_test_accuracy"] >= 0.95, s["final_test_accuracy"]
    for w in s["per_worker"]:
        assert w["params_max_diff_across_ranks"] == 0.0       # DDP keeps every rank identical
        total = w["mean_step_s"] * w["steps"]
        assert w["compute_s"] + w["comm_s"] + w["wait_s"] == pytest.approx(total, rel=1e-6)
        assert min(w["compute_s"], w["comm_s"], w["wait_s"]) >= 0
        assert w["bytes_pushed_wire"] == ring_bytes(s["model_params"] * 4, 2) * 300
    ps = launch(load_config(None, {"mode": "ps", "workers": 2, "servers": 1, "steps": 5, "progress": False}),
                quiet=True)
    assert set(ps["per_worker"][0]) <= set(s["per_worker"][0])          # every train_ps key is there
    assert set(ps) == set(s)


@pytest.mark.slow
def test_worker_under_torchrun_env_vars(tmp_path):
    port = free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, "-m", "worker", "--mode", "allreduce", "--steps", "20",
                                       "--no-progress", "--result-json", str(tmp_path / f"w{r}.json")],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-2000:]
    res = [json.load(open(tmp_path / f"w{r}.json")) for r in range(2)]
    assert [r["rank"] for r in res] == [0, 1]
    assert res[0]["backend"] == "gloo" and res[0]["steps"] == 20
