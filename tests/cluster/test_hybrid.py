"""--mode hybrid end to end (real processes): embeddings row-sparse on the PS, the MLP allreduced (gloo)."""
import pytest

from deltaps.tools.bench_compare import parse_mode
from deltaps.tools.launch import launch
from worker.trainers.strategy import load_job as load_config

SMALL = dict(workload="ctr", workers=2, servers=2, steps=8, batch_size=128, embedding_rows=20_000,
             embedding_dim=16, hidden=64, progress=False, timeout_s=60.0)


def test_hybrid_matches_allreduce_loss_curve():
    """Same data, seed and optimizers: hybrid (table on 2 shards, sparse rows) and allreduce (dense table
    through DDP) follow the same loss curve and end at the same test AUC (adagrad table, adam MLP)."""
    hy = launch(load_config(None, {**SMALL, "mode": "hybrid"}), quiet=True)
    ar = launch(load_config(None, {**SMALL, "mode": "allreduce"}), quiet=True)
    assert hy["mode"] == "hybrid" and len(hy["loss_curve_rank0"]) == 8
    diff = max(abs(a - b) for a, b in zip(hy["loss_curve_rank0"], ar["loss_curve_rank0"]))
    assert diff < 1e-4, (hy["loss_curve_rank0"], ar["loss_curve_rank0"])
    h0, a0 = hy["per_worker"][0], ar["per_worker"][0]
    assert abs(h0["final_test_auc"] - a0["final_test_auc"]) < 1e-3
    assert 0.5 < h0["oracle_auc"] <= 1.0
    # hybrid moves rows, not the table: far fewer bytes per step than the dense allreduce
    assert hy["bytes_pushed_wire"] < ar["bytes_pushed_wire"] / 5
    emb = hy["server_stats"]
    assert [s["version"] for s in emb] == [8, 8]
    assert sum(s["tables"]["emb"]["rows_held"] for s in emb) < 20_000


def test_config_and_mode_specs():
    assert parse_mode("hybrid") == {"mode": "hybrid", "sync": "bsp", "codec": "none", "workload": "ctr"}
    with pytest.raises(ValueError, match="hybrid takes fp16 or bf16"):     # no codec: a hook for its dense part
        parse_mode("hybrid:int8")
    with pytest.raises(ValueError, match="workload ctr"):
        load_config(None, {"mode": "hybrid"})
    with pytest.raises(ValueError, match="embedding optimizer"):
        load_config(None, {"mode": "hybrid", "workload": "ctr", "embedding_optimizer": "lion"})
