"""bench compare's `ddp:sparse` (--mode allreduce --workload ctr --sparse-embeddings): DDP with
nn.Embedding(sparse=True), the table's sparse gradient reduced by DDP over gloo, computes the same model as
the dense-gradient DDP run. With SGD and with Adagrad a zero-gradient row is left unchanged by the dense step,
so sparse and dense gradients give the same parameters (up to float summation order).

Two gloo ranks (spawned processes) run the allreduce strategy four times: {sgd, adagrad} x {dense, sparse}."""
import multiprocessing
import os

import pytest
import torch

from deltaps.tools.bench_compare import parse_mode
from deltaps.tools.bench_report import format_table_ctr
from deltaps.tools.launch import free_port
from worker.trainers.strategy import load_job as load_config
from worker.workloads.ctr import CTRModel, table_spec

WORLD, STEPS = 2, 4
SMALL = dict(mode="allreduce", workload="ctr", workers=WORLD, steps=STEPS, batch_size=32, embedding_rows=2000,
             embedding_dim=8, embedding_fields=4, hidden=16, optimizer="sgd", lr=0.1, progress=False, timeout_s=30.0)
RUNS = [(opt, sparse) for opt in ("sgd", "adagrad") for sparse in (False, True)]



def _rank(rank: int, ports: list[int], tmp: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from worker.trainers.context import RunContext
    from worker.trainers.loop import train
    for (opt, sparse), port in zip(RUNS, ports):
        cfg = load_config(None, {**SMALL, "embedding_optimizer": opt, "embedding_lr": 0.5, "sparse_embeddings": sparse,
                                 "save_model": os.path.join(tmp, f"{opt}-{sparse}.pt")})
        res = train(cfg, RunContext(rank, WORLD, master_port=port))   # barrier before destroy inside
        torch.save(res, os.path.join(tmp, f"{opt}-{sparse}-rank{rank}.res"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_sparse")
    ports = [free_port() for _ in RUNS]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, ports, str(tmp))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return {(opt, sparse): (torch.load(tmp / f"{opt}-{sparse}.pt"),
                            [torch.load(tmp / f"{opt}-{sparse}-rank{r}.res", weights_only=False) for r in range(WORLD)])
            for opt, sparse in RUNS}


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_sparse_gradients_give_the_dense_run_parameters(runs, opt):
    (dense, dres), (sparse, sres) = runs[(opt, False)], runs[(opt, True)]
    assert dense.keys() == sparse.keys()
    diff = max((dense[k] - sparse[k]).abs().max().item() for k in dense)
    cfg = load_config(None, {**SMALL, "embedding_optimizer": opt})
    init = CTRModel(cfg.embedding_rows, cfg.embedding_dim, cfg.embedding_fields, table_spec=table_spec(cfg)).emb.weight
    moved = (sparse["emb.weight"] - init).abs().amax(1)
    print(f"\n{opt}: ddp:sparse vs dense DDP after {STEPS} steps, max |Δparam| {diff:.2e}")
    assert diff < 1e-5
    assert 0 < int((moved > 0).sum()) < cfg.embedding_rows      # the batches' rows trained, the others did not
    assert dres[0]["losses"] == pytest.approx(sres[0]["losses"], abs=1e-5)
    assert sres[0]["sparse_embeddings"] and not dres[0].get("sparse_embeddings")
    assert sres[0]["table_optimizer"] == {"sgd": "SGD", "adagrad": "Adagrad"}[opt]
    # the sparse run sends rows (indices + values, allgathered), not the 2000 x 8 table's ring allreduce
    table_ring = 2 * (WORLD - 1) / WORLD * 2000 * 8 * 4
    assert 0 < sres[0]["sparse_allgather_bytes"] / STEPS < table_ring
    assert sres[0]["bytes_pushed_wire"] < dres[0]["bytes_pushed_wire"]


def test_mode_spec_and_config():
    assert parse_mode("ddp:sparse") == {"mode": "allreduce", "sparse_embeddings": True}
    assert parse_mode("allreduce:sparse") == parse_mode("ddp:sparse")
    # fp16 / bf16 on the dense buckets, for the peer and for hybrid's dense part alike
    assert parse_mode("ddp:sparse:fp16") == {"mode": "allreduce", "sparse_embeddings": True, "ddp_hook": "fp16"}
    assert parse_mode("hybrid:bf16")["ddp_hook"] == "bf16" and "ddp_hook" not in parse_mode("hybrid")
    assert load_config(None, {"workload": "ctr", **parse_mode("hybrid:fp16")}).ddp_hook == "fp16"
    with pytest.raises(ValueError, match="takes fp16 or bf16"):
        parse_mode("ddp:sparse:powersgd:rank=2")
    with pytest.raises(ValueError, match="hybrid takes fp16 or bf16"):
        parse_mode("hybrid:int8")
    with pytest.raises(ValueError, match="dense buckets take fp16 or bf16"):
        load_config(None, {"mode": "hybrid", "workload": "ctr", "ddp_hook": "powersgd:rank=2"})
    with pytest.raises(ValueError, match="--mode allreduce / hybrid"):
        load_config(None, {"mode": "ps", "ddp_hook": "fp16"})
    with pytest.raises(ValueError, match="workload ctr"):        # the digits MLP has no embedding table
        load_config(None, {"workload": "mlp", **parse_mode("ddp:sparse")})
    with pytest.raises(ValueError, match="mode allreduce"):
        load_config(None, {"mode": "hybrid", "workload": "ctr", "sparse_embeddings": True})
    assert load_config(None, {"workload": "ctr", **parse_mode("ddp:sparse")}).sparse_embeddings


def test_ctr_table_has_a_speedup_column_against_ddp_sparse():
    m = dict(median_step_s=1.0, samples_per_s=1.0, compute_share=1.0, comm_share=0.0, wait_share=0.0,
             bytes_per_step=0.0, final_test_auc=0.7, final_test_loss=0.6)
    report = {"modes": {"ddp": {**m, "median_step_s": 4.0, "speedup_vs_allreduce": 1.0},
                        "ddp:sparse": {**m, "median_step_s": 0.2, "speedup_vs_allreduce": 20.0},
                        "hybrid": {**m, "median_step_s": 0.05, "speedup_vs_allreduce": 80.0}}}
    table = format_table_ctr(report)
    assert "speed-up vs ddp:sparse" in table.splitlines()[0]
    assert [ln.rstrip(" |").rsplit("| ", 1)[1].strip() for ln in table.splitlines()[2:5]] == ["x0.05", "x1.00", "x4.00"]
    assert "speed-up vs ddp:sparse" not in format_table_ctr({"modes": {"ddp": report["modes"]["ddp"]}})
