"""--mode torchrec (worker/trainers/torchrec_peer.py): TorchRec's own DistributedModelParallel, run by real worker
processes over gloo, trains the click-through model from the same initial table as every mode and computes what
--mode allreduce computes with an Adagrad table; in bench compare it is a peer (`best_peer`)."""
import json

import pytest
import torch

from deltaps.tools import bench_compare as bc
from deltaps.tools.launch import launch
from worker.trainers.strategy import load_job

pytest.importorskip("torchrec", reason="torchrec is the optional `recsys` extra (make setup installs it)",
                    exc_type=ImportError)

JOB = dict(workers=2, servers=2, steps=16, batch_size=64, hidden=32, layers=2, workload="ctr", embedding_rows=20000,
           embedding_dim=16, embedding_optimizer="adagrad", progress=False, timeout_s=60.0)


def _run(tmp_path, **over) -> tuple[dict, dict]:
    out = tmp_path / f"{over['mode']}.pt"
    summary = launch(load_job(None, {**JOB, **over, "save_model": str(out)}), quiet=True)
    return summary, torch.load(out)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """JOB under --mode allreduce (a dense Adagrad table in DDP), what the TorchRec runs are held against."""
    return _run(tmp_path_factory.mktemp("ddp"), mode="allreduce")


def test_torchrec_trains_what_ddp_with_a_dense_adagrad_table_trains(tmp_path, ddp_run):
    tr, tr_model = _run(tmp_path, mode="torchrec")
    ar, ar_model = ddp_run
    assert tr_model.keys() == ar_model.keys() and tr_model["emb.weight"].shape == (20000, 16)
    # the same hash init, the same Adagrad
    assert max((tr_model[k] - ar_model[k]).abs().max().item() for k in tr_model) < 1e-3
    assert tr["final_train_loss"] == pytest.approx(ar["final_train_loss"], abs=1e-4)
    w = tr["per_worker"][0]
    assert w["final_test_auc"] == pytest.approx(ar["per_worker"][0]["final_test_auc"], abs=1e-3)
    plan = w["torchrec_plan"]["emb"]
    assert plan["sharding"] in ("table_wise", "column_wise", "table_column_wise") and plan["ranks"]
    assert w["table_optimizer"] == "fused adagrad" and w["a2a_bytes_model"] > 0 and w["dense_ring_bytes"] > 0
    assert sum(p["table_values_held"] for p in tr["per_worker"]) == 20000 * 16     # each value on one rank


def test_an_sgd_table_moves_as_far_as_ddp_s(tmp_path):
    # SGD is not scale-invariant: the same rows as DDP's only if TorchRec's backward averages the table's gradient
    # over the ranks as DDP does (its comm_ops' gradient division), not sums it
    sgd = dict(embedding_optimizer="sgd", embedding_lr=0.5)
    _, tr_model = _run(tmp_path, mode="torchrec", **sgd)
    _, ar_model = _run(tmp_path, mode="allreduce", **sgd)
    assert max((tr_model[k] - ar_model[k]).abs().max().item() for k in tr_model) < 1e-3


def test_column_wise_sharding_cuts_the_table_over_every_rank_and_trains_the_same(tmp_path, ddp_run):
    cw, cw_model = _run(tmp_path, mode="torchrec", torchrec_sharding="column_wise")
    _, ar_model = ddp_run
    assert [w["torchrec_plan"]["emb"] for w in cw["per_worker"]][0] == {"sharding": "column_wise", "ranks": [0, 1]}
    assert [w["table_values_held"] for w in cw["per_worker"]] == [20000 * 8, 20000 * 8]
    assert max((cw_model[k] - ar_model[k]).abs().max().item() for k in cw_model) < 1e-3


def test_torchrec_is_a_peer_in_the_ctr_race(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bc.main(["--no-shaping", "--workers", "2", "--servers", "2", "--steps", "40", "--batch-size", "64",
                  "--hidden", "32", "--embedding-rows", "20000", "--embedding-dim", "16", "--modes", "torchrec,hybrid",
                  "--eval-every", "4", "--target-auc", "0.7", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    assert r["workload"] == "ctr" and r["best_peer"] == "torchrec"
    tr, hybrid = r["modes"]["torchrec"], r["modes"]["hybrid"]
    assert tr["mode"] == "torchrec" and tr["steps_to_target"] == hybrid["steps_to_target"]
    assert [p["test_auc"] for p in tr["evals"]] == pytest.approx([p["test_auc"] for p in hybrid["evals"]], abs=1e-3)


@pytest.mark.parametrize("over, match", [
    (dict(embedding_optimizer="adam"), "fuses sgd or adagrad"),
    (dict(workload="clf"), "needs a model with embeddings"),
    (dict(sync="asp"), "synchronous"),
    (dict(ddp_hook="powersgd:rank=2"), "fp16 or bf16"),
    (dict(torchrec_sharding="row_wise"), "use auto or table_wise"),
])
def test_rules_name_the_problem(over, match):
    with pytest.raises(ValueError, match=match):
        load_job(None, {**JOB, "mode": "torchrec", **over})
