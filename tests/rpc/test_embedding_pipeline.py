"""RowPipeline (worker/embedding/pipeline.py): the row push leaves from inside backward, the next step's
pull is in flight before backward returns, and the result is exactly the sequential exchange's."""
import torch
from conftest import run_threads

from deltaps.embedding import TableSpec
from worker.embedding import EmbeddingClient, PSEmbedding
from worker.embedding.pipeline import RowPipeline

ROWS, DIM, WORLD, STEPS = 300, 8, 2, 5


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, ROWS, (24,), generator=g), torch.randn(24, DIM, generator=g)


def _train(addrs, rank, pipelined, seen, tables=("a",), used=("a",)):
    specs = [TableSpec(t, ROWS, DIM, "adagrad", lr=0.1, eps=1e-10, seed=5) for t in tables]
    client = EmbeddingClient(addrs, rank, WORLD, specs, timeout_s=30)
    client.register()
    embs = {t: PSEmbedding(t, client) for t in tables}
    pipe = RowPipeline(client, embs) if pipelined else None
    try:
        for step in range(STEPS):
            ids, up = _batch(step, rank)
            if pipe:
                pipe.begin(step, ids)
            else:
                for e in embs.values():
                    e.prefetch(ids, step)
            outs = {t: e(ids) for t, e in embs.items()}
            loss = sum((outs[t] * up).sum() for t in used)
            if pipe:
                pipe.arm(step, _batch(step + 1, rank)[0] if step + 1 < STEPS else None)
            loss.backward()
            if pipe:
                seen.append((step, pipe._pushed, pipe._pull is not None))   # before flush: what backward did
                pipe.flush()
            else:
                grads = {}
                for e in embs.values():
                    grads.update(e.row_grads())
                client.push_rows(step, grads)
        if pipe:
            pipe.close()
        vals, _ = client.pull_rows({t: torch.arange(ROWS) for t in tables}, STEPS)
        return vals
    finally:
        client.close()


def _run(cluster, pipelined, **kw):
    out, seen = {}, []
    run_threads([lambda r=r: out.__setitem__(r, _train(cluster.addrs, r, pipelined, seen, **kw))
                 for r in range(WORLD)])
    return out, seen


def test_pipelined_rows_equal_the_sequential_exchange_and_leave_during_backward(cluster_factory):
    seq, _ = _run(cluster_factory(2), False)
    pip, seen = _run(cluster_factory(2), True)
    assert torch.equal(pip[0]["a"], seq[0]["a"]) and torch.equal(pip[1]["a"], seq[0]["a"])
    for step, pushed, pulling in seen:
        assert pushed, f"step {step}: the push waited for flush() instead of leaving from inside backward"
        assert pulling == (step + 1 < STEPS), f"step {step}: the next step's pull was not in flight"


def test_a_table_without_gradient_is_pushed_by_flush_and_the_job_advances(cluster_factory):
    seq, _ = _run(cluster_factory(2), False, tables=("a", "b"), used=("a",))
    pip, seen = _run(cluster_factory(2), True, tables=("a", "b"), used=("a",))
    assert all(not pushed for _, pushed, _ in seen)          # b's hook never fires: flush() pushes
    for t in ("a", "b"):
        assert torch.equal(pip[0][t], seq[0][t])
