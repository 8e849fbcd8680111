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


def test_ctr_races_to_a_test_auc(tmp_path, capsys):
    """--target-auc: ddp:sparse and hybrid evaluate the test AUC every 4 steps off the clock and stop at the
    first evaluation reaching it — at the same step, since both compute the same updates (adagrad table)."""
    out = tmp_path / "r.json"
    rc = bc.main(["--workload", "ctr", "--no-shaping", "--workers", "2", "--servers", "2", "--steps", "40",
                  "--batch-size", "64", "--hidden", "32", "--embedding-rows", "20000", "--embedding-dim", "16",
                  "--modes", "ddp:sparse,hybrid", "--eval-every", "4", "--target-auc", "0.7", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    assert r["target"] == 0.7 and r["best_peer"] == "ddp:sparse"
    sparse, hybrid = r["modes"]["ddp:sparse"], r["modes"]["hybrid"]
    for m in (sparse, hybrid):
        assert m["steps_to_target"] is not None and m["steps_to_target"] % 4 == 0 and m["steps"] == m["steps_to_target"]
        assert m["time_to_target_s"] > 0 and all(p["test_auc"] > 0.4 for p in m["evals"])
        assert m["evals"][-1]["test_auc"] >= 0.7 > max((p["test_auc"] for p in m["evals"][:-1]), default=0.0)
    assert hybrid["steps_to_target"] == sparse["steps_to_target"]
    assert [p["test_auc"] for p in hybrid["evals"]] == pytest.approx([p["test_auc"] for p in sparse["evals"]], abs=1e-4)
    assert hybrid["speedup_vs_best_peer"] == pytest.approx(sparse["time_to_target_s"] / hybrid["time_to_target_s"])
    assert "time to target" in text and "until test AUC >= 0.7" in text


def test_fp16_on_the_dense_part_of_ddp_sparse_and_hybrid(tmp_path, capsys):
    """ddp:sparse:fp16 / hybrid:fp16: torch's fp16 hook on the dense buckets halves their ring bytes; the
    embedding rows still go as before; both still follow the fp32 runs' loss curve closely."""
    out = tmp_path / "r.json"
    rc = bc.main(["--workload", "ctr", "--no-shaping", "--workers", "2", "--servers", "2", "--steps", "10",
                  "--batch-size", "64", "--hidden", "32", "--embedding-rows", "20000", "--embedding-dim", "16",
                  "--modes", "ddp:sparse,ddp:sparse:fp16,hybrid,hybrid:fp16", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    m = json.loads(out.read_text())["modes"]
    assert m["hybrid:fp16"]["dense_ring_bytes_per_step"] == pytest.approx(m["hybrid"]["dense_ring_bytes_per_step"] / 2)
    assert m["hybrid:fp16"]["sparse_bytes_pushed_per_step"] == m["hybrid"]["sparse_bytes_pushed_per_step"]
    assert m["ddp:sparse:fp16"]["bytes_per_step"] < m["ddp:sparse"]["bytes_per_step"]
    for spec in ("ddp:sparse:fp16", "hybrid:fp16"):
        plain = spec.rsplit(":", 1)[0]
        assert m[spec]["ddp_hook"] == "fp16" and m[plain]["ddp_hook"] == "none"
        assert max(abs(a - b) for a, b in zip(m[spec]["losses_rank0"], m[plain]["losses_rank0"])) < 1e-3
