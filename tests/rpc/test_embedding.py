"""Row-sparse embedding tables on the PS (ps/embedding/, worker/embedding/) over real gRPC shards."""
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_threads
from torch import nn

from deltaps.embedding import TableSpec, dense_init, hash_uniform, ids_to_bytes, init_rows
from deltaps.errors import PSError
from ps.embedding import EmbeddingStore, attach
from worker.embedding import EmbeddingClient, PSEmbedding, replace_embeddings, select_ps_modules


def _clients(cluster, spec, world, **kw):
    cs = [EmbeddingClient(cluster.addrs, r, world, [spec], timeout_s=30, **kw) for r in range(world)]
    for c in cs:
        c.register()
    return cs


def _torch_opt(spec, params):
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr)
    if spec.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=spec.lr, eps=spec.eps)
    return torch.optim.SparseAdam(params, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)


def _batch(step, rank, rows, n=40):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, rows, (n,), generator=g)           # duplicates on purpose
    up = torch.randn(n, 16, generator=g)                        # upstream gradient d loss / d embedding
    return ids, up


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_sparse_push_pull_equals_dense_torch(cluster_factory, opt):
    """2 workers x 2 shards, BSP, 4 steps: the PS table equals nn.Embedding(sparse=True) + the same torch
    optimizer fed the mean of both workers' gradients; untouched rows keep their initial value."""
    rows, world, steps = 500, 2, 4
    spec = TableSpec("t", rows, 16, opt, lr=0.05, eps=1e-8 if opt == "adam" else 1e-10, seed=3)
    cluster = cluster_factory(2)
    clients = _clients(cluster, spec, world)
    ref = nn.Embedding(rows, 16, sparse=True, _weight=dense_init(spec).clone())
    ropt = _torch_opt(spec, ref.parameters())
    dense_ref = nn.Embedding(rows, 16, _weight=dense_init(spec).clone())    # allreduce-mode equivalent
    dopt = torch.optim.Adagrad(dense_ref.parameters(), lr=spec.lr, eps=spec.eps) if opt == "adagrad" else (
        torch.optim.SGD(dense_ref.parameters(), lr=spec.lr) if opt == "sgd" else None)

    for step in range(steps):
        ropt.zero_grad()
        loss = sum((ref(_batch(step, r, rows)[0]) * _batch(step, r, rows)[1]).sum() for r in range(world)) / world
        loss.backward()
        ropt.step()
        if dopt is not None:
            dopt.zero_grad()
            (sum((dense_ref(_batch(step, r, rows)[0]) * _batch(step, r, rows)[1]).sum()
                 for r in range(world)) / world).backward()
            dopt.step()

        def work(r, step=step):
            c = clients[r]
            ids, up = _batch(step, r, rows)
            uniq, inv = torch.unique(ids, return_inverse=True)
            vals, _ = c.pull_rows({"t": uniq}, min_version=step)
            local = vals["t"].requires_grad_()
            (F.embedding(inv, local) * up).sum().backward()
            c.push_rows(step, {"t": (uniq, local.grad)})
        run_threads([lambda r=r: work(r) for r in range(world)])

    got, _ = clients[0].pull_rows({"t": torch.arange(rows)}, min_version=steps)
    torch.testing.assert_close(got["t"], ref.weight.detach(), rtol=1e-5, atol=1e-6)
    if dopt is not None:   # dense Adagrad/SGD leave zero-gradient rows alone: same as the row-wise PS update
        torch.testing.assert_close(got["t"], dense_ref.weight.detach(), rtol=1e-5, atol=1e-6)
    touched = torch.unique(torch.cat([_batch(s, r, rows)[0] for s in range(steps) for r in range(world)]))
    untouched = torch.tensor(sorted(set(range(rows)) - set(touched.tolist())))
    assert len(untouched) > 0
    torch.testing.assert_close(got["t"][untouched], init_rows(spec, untouched.numpy()))
    stats = clients[0].server_stats()
    assert [s["version"] for s in stats] == [steps, steps]
    for c in clients:
        c.close()


def test_lazy_init_is_dense_init():
    spec = TableSpec("t", 1000, 8, seed=5)
    ids = np.array([0, 7, 999, 123])
    torch.testing.assert_close(init_rows(spec, ids), dense_init(spec)[ids])
    assert torch.equal(hash_uniform(ids, 8, 5, 0.05), hash_uniform(ids, 8, 5, 0.05))
    assert not torch.equal(hash_uniform(ids, 8, 5), hash_uniform(ids, 8, 6))


MiB = 1 << 20


def test_table_larger_than_one_shard_cap_trains_on_two_shards(cluster_factory):
    """96 MiB table, 64 MiB cap per shard: one shard refuses with RESOURCE_EXHAUSTED; two shards hold and
    train all of it (every row pulled and updated), equal to dense SGD on the whole table."""
    rows, dim = 96 * MiB // (64 * 4), 64                 # 393216 x 64 float32 = 96 MiB
    spec = TableSpec("big", rows, dim, "sgd", lr=0.1, seed=1)
    assert spec.nbytes == 96 * MiB

    one = cluster_factory(1)
    attach(one.shards[0], 64 * MiB)
    (c1,) = _clients(one, spec, 1)
    c1.pull_rows({"big": torch.arange(0, rows // 2)})                    # 48 MiB: fits
    with pytest.raises(PSError) as e:
        c1.pull_rows({"big": torch.arange(rows // 2, rows)})             # +48 MiB: over the cap
    assert e.value.code.name == "RESOURCE_EXHAUSTED"
    assert "memory cap" in str(e.value) and "big" in str(e.value)
    s = c1.server_stats()[0]
    assert s["bytes"] <= 64 * MiB and s["rejected_exhausted"] == 1
    c1.close()

    two = cluster_factory(2)
    for sh in two.shards:
        attach(sh, 64 * MiB)
    (c,) = _clients(two, spec, 1)
    ref = dense_init(spec)
    all_ids = torch.arange(rows)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        vals, _ = c.pull_rows({"big": all_ids}, min_version=step)
        if step == 0:
            torch.testing.assert_close(vals["big"], ref)
        grad = torch.randn(rows, dim, generator=g)
        c.push_rows(step, {"big": (all_ids, grad)})
        ref.add_(grad, alpha=-0.1)
    vals, _ = c.pull_rows({"big": all_ids}, min_version=2)
    torch.testing.assert_close(vals["big"], ref)
    stats = c.server_stats()
    assert sum(s["tables"]["big"]["rows_held"] for s in stats) == rows
    assert all(s["bytes"] <= 64 * MiB for s in stats)
    assert [s["version"] for s in stats] == [2, 2]
    c.close()


def test_bsp_gate_and_empty_push_counts_as_zero(cluster_factory):
    """A step applies only once every worker pushed (an empty push counts as zero gradient); the next
    step's pull blocks until then; a retried push is acknowledged, not applied again."""
    spec = TableSpec("t", 100, 4, "sgd", lr=1.0, init="zeros")
    cluster = cluster_factory(2)
    a, b = _clients(cluster, spec, 2)
    ids = torch.tensor([2, 4])                     # both on shard 0
    a.pull_rows({"t": ids})
    a.push_rows(0, {"t": (ids, torch.ones(2, 4))})
    got = {}

    def pull_next():
        got["v"], _ = a.pull_rows({"t": ids}, min_version=1)
        got["t"] = time.monotonic()
    th = threading.Thread(target=pull_next)
    th.start()
    time.sleep(0.5)
    assert "v" not in got                          # waiting for worker b
    t_push = time.monotonic()
    b.push_rows(0, {})                             # touched nothing: empty pushes to both shards
    th.join(10)
    assert got["t"] >= t_push
    torch.testing.assert_close(got["v"]["t"], torch.full((2, 4), -0.5))   # mean over 2 workers, lr 1
    reps = [f.result() for f in a.push_rows_async(0, {"t": (ids, torch.ones(2, 4))})]
    assert all(r.duplicate for r in reps)
    v, _ = b.pull_rows({"t": ids}, min_version=1)
    torch.testing.assert_close(v["t"], torch.full((2, 4), -0.5))
    a.close()
    b.close()


def test_bad_requests_are_refused(cluster_factory):
    spec = TableSpec("t", 100, 4)
    cluster = cluster_factory(2)
    (c,) = _clients(cluster, spec, 1)
    with pytest.raises(PSError) as e:
        c.pull_rows({"t": torch.tensor([100])})
    assert e.value.code.name == "INVALID_ARGUMENT" and "out of range" in str(e.value)
    with pytest.raises(PSError) as e:          # rows pushed without having been pulled
        c.push_rows(0, {"t": (torch.tensor([3]), torch.ones(1, 4))})
    assert e.value.code.name == "FAILED_PRECONDITION"
    other = EmbeddingClient(cluster.addrs, 0, 1, [TableSpec("t", 100, 8)], timeout_s=10)
    with pytest.raises(PSError) as e:          # same table name, different shape
        other.register()
    assert e.value.code.name == "FAILED_PRECONDITION"
    store = EmbeddingStore(0, 2)
    store.register(0, 1, 2, "bsp", [spec])
    with pytest.raises(Exception) as e:
        store.pull(0, [("t", torch.tensor([1]))], 0)    # id 1 lives on shard 1
    assert "not owned" in str(e.value)
    c.close()
    other.close()


def test_ps_embedding_module_and_selection(cluster_factory):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.Embedding(50, 4)
            self.item = nn.Embedding(60, 4)
            self.fc = nn.Linear(8, 1)

        def forward(self, u, i):
            return self.fc(torch.cat([self.user(u), self.item(i)], 1))

    m = M()
    assert select_ps_modules(m) == ["user", "item"]
    assert select_ps_modules(m, "item*") == ["item"]
    with pytest.raises(ValueError, match="only nn.Embedding"):
        select_ps_modules(m, "fc")
    with pytest.raises(ValueError, match="selects no"):
        select_ps_modules(m, "nothing")
    cluster = cluster_factory(2)
    specs = [TableSpec("user", 50, 4, "sgd", lr=1.0), TableSpec("item", 60, 4, "sgd", lr=1.0)]
    c = EmbeddingClient(cluster.addrs, 0, 1, specs, timeout_s=10)
    c.register()
    embs = replace_embeddings(m, ["user", "item"], c)
    assert isinstance(m.user, PSEmbedding) and [n for n, _ in m.named_parameters()] == ["fc.weight", "fc.bias"]
    u, i = torch.tensor([1, 1, 3]), torch.tensor([5, 6, 7])
    before = init_rows(specs[0], np.array([1, 3]))
    m(u, i).sum().backward()
    grads = {}
    for e in embs.values():
        grads.update(e.row_grads())
    assert grads["user"][0].tolist() == [1, 3] and grads["user"][1].shape == (2, 4)
    c.push_rows(0, grads)
    after, _ = c.pull_rows({"user": torch.tensor([1, 3])}, min_version=1)
    torch.testing.assert_close(after["user"], before - grads["user"][1])
    c.close()


def test_requests_the_tables_cannot_serve_are_refused_by_name(cluster_factory):
    """What used to reach a table before any check (a world of 2**31 - 1 workers, a beta of 1 dividing by zero at
    the first step, a table named twice — allocated twice, so no checkpoint restored —, a wait with no end) is
    refused with INVALID_ARGUMENT naming it, and the store serves on."""
    import grpc

    from protos import PROTOCOL_VERSION, pb, rpc
    cluster = cluster_factory(1)
    stub = rpc.ParameterServerStub(grpc.insecure_channel(cluster.addrs[0]))

    def table(**over):
        msg = pb.EmbeddingTableSpec()
        TableSpec(**{"name": "t", "num_rows": 100, "dim": 4, **over}).to_proto(msg)
        return msg

    def register(**over):
        return stub.RegisterEmbedding(pb.RegisterEmbeddingRequest(**{
            "protocol_version": PROTOCOL_VERSION, "worker_id": 0, "world_size": 1, "num_shards": 1, "sync": "bsp",
            "tables": [table()], **over}), timeout=10)

    def refused(call, *words):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert all(w in e.value.details() for w in words), e.value.details()
    refused(lambda: register(world_size=(1 << 31) - 1), "world size")
    refused(lambda: register(tables=[table(), table(dim=8)]), "table 't' twice")
    refused(lambda: register(tables=[table(optimizer="adam", beta1=1.0)]), "beta1 and beta2 must be in [0, 1)")
    refused(lambda: register(tables=[table(lr=float("nan"))]), "lr must be > 0 and finite")
    refused(lambda: register(tables=[table(dim=1 << 20)]), "dim must be in")
    server_id = register().server_id
    ids = ids_to_bytes(torch.tensor([3]))
    pull = dict(worker_id=0, server_id=server_id)
    refused(lambda: stub.SparsePull(pb.SparsePullRequest(rows=[pb.EmbeddingRows(table="t", ids=ids)] * 2, **pull),
                                    timeout=10), "table 't' twice")
    refused(lambda: stub.SparsePull(pb.SparsePullRequest(rows=[pb.EmbeddingRows(table="t", ids=ids)],
                                                         timeout_s=float("inf"), **pull), timeout=10), "finite")
    rep = stub.SparsePull(pb.SparsePullRequest(rows=[pb.EmbeddingRows(table="t", ids=ids)], **pull), timeout=10)
    assert len(rep.rows[0].values) == 16 and store_rows(cluster) == 1      # row 3 allocated once
    assert attach(cluster.shards[0]).tables["t"].state_dict()["ids"].tolist() == [3]
    # an answer over the message limit (64 MiB: 2**22 + 1 rows of 16 B) is refused before any row is made
    many = ids_to_bytes(torch.arange((1 << 22) + 1) % 100)
    with pytest.raises(grpc.RpcError) as e:
        stub.SparsePull(pb.SparsePullRequest(rows=[pb.EmbeddingRows(table="t", ids=many)], **pull), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in e.value.details()
    assert store_rows(cluster) == 1


def store_rows(cluster) -> int:
    return attach(cluster.shards[0]).tables["t"].rows
