"""`deltaps bench compare --workload ctr` with the embedding model's fair DDP peer, `ddp:sparse`
(nn.Embedding(sparse=True), sparse gradients reduced by DDP over gloo), beside dense-gradient DDP: real
worker processes on loopback, a tiny table."""
import json

import pytest

from deltaps.tools import bench_compare as bc


def test_ddp_sparse_runs_in_bench_compare(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bc.main(["--workload", "ctr", "--no-shaping", "--workers", "2", "--steps", "10", "--batch-size", "64",
                  "--hidden", "32", "--embedding-rows", "20000", "--embedding-dim", "16", "--modes", "ddp,ddp:sparse",
                  "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    assert list(r["modes"]) == ["ddp", "ddp:sparse"]
    dense, sparse = r["modes"]["ddp"], r["modes"]["ddp:sparse"]
    assert sparse["mode"] == "allreduce" and 0.4 < sparse["final_test_auc"] <= 1.0
    assert len(sparse["losses_rank0"]) == 10
    # adagrad table: a dense step leaves zero-gradient rows alone, so both runs follow the same loss curve
    assert sparse["loss_curve_max_abs_diff_vs_allreduce"] < 1e-4
    assert sparse["final_test_auc"] == pytest.approx(dense["final_test_auc"], abs=1e-3)
    # rows, not the 20000 x 16 table, cross the wire
    assert sparse["bytes_per_step"] < dense["bytes_per_step"] / 5
    assert "speed-up vs ddp:sparse" in text
