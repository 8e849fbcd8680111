"""Compressed pulls: deltas against a shared view, identical on every worker, exact again after rollback."""
import pytest
import torch
from helpers import client

from compression import CodecError, available_codecs, get_codec
from deltaps.pull_codec import DIGEST_BYTES, resolve_pull_codec, values_digest


def _clients(c, n, **kw):
    cls = [client(c.addrs, r, n, chunk_bytes=8192, **kw) for r in range(n)]
    params = [("w", torch.randn(5000, generator=torch.Generator().manual_seed(0))), ("b", torch.zeros(300))]
    for cl in cls:
        cl.setup(params)
    views = [cl.pull(out=None, delta=True) for cl in cls]
    return cls, views


def _step(cls, views, step, seed):
    g = torch.Generator().manual_seed(seed)
    for _r, cl in enumerate(cls):
        cl.push({"w": torch.randn(5000, generator=g), "b": torch.randn(300, generator=g)}, step)
    for cl, v in zip(cls, views):
        cl.pull(min_version=step + 1, out=v, delta=True)


def test_int8_deltas_keep_every_worker_on_the_same_view(cluster_factory):
    c = cluster_factory(2)
    cls, views = _clients(c, 2, pull_codec="int8")
    for step in range(10):
        _step(cls, views, step, step)
    exact = cls[0].pull()                       # plain pull: exact server values
    for n in ("w", "b"):
        assert torch.equal(views[0][n], views[1][n])                   # bit-identical on both workers
        server_view = torch.cat([c.shards[k.shard].keys[k.key].view.view for k in cls[0].by_param[n]])
        assert torch.equal(views[0][n], server_view)
        err = (views[0][n] - exact[n]).abs().max().item()
        assert 0 < err < 0.02 * exact[n].abs().max().item()         # lossy but close: error feedback
    plain = 11 * 5300 * 4                     # 1 initial + 10 step pulls of exact float32 values
    wire = cls[1].stats.snapshot()["bytes_pulled_wire"]
    assert wire < 0.5 * plain, (wire, plain)  # one full view, then int8 deltas (~1/4 of float32)
    for cl in cls:
        cl.close()


def test_unchanged_keys_cost_nothing_and_new_clients_get_the_full_view(cluster_factory):
    c = cluster_factory(1)
    cls, views = _clients(c, 1, pull_codec="int8")
    _step(cls, views, 0, 1)
    before = cls[0].stats.snapshot()["bytes_pulled_wire"]
    cls[0].pull(min_version=1, out=views[0], delta=True)          # nothing new on the server
    assert cls[0].stats.snapshot()["bytes_pulled_wire"] == before
    late = client(c.addrs, 0, 1, chunk_bytes=8192, pull_codec="int8")
    late.setup([("w", torch.zeros(5000)), ("b", torch.zeros(300))])
    fresh = late.pull(delta=True)
    assert torch.equal(fresh["w"], views[0]["w"])                  # joiner holds the shared view too
    late.close()
    cls[0].close()


@pytest.mark.parametrize("pull_codec", ["none", "int8", "lowrank:rank=4"])
def test_a_worker_holding_the_jobs_values_downloads_nothing_at_its_first_pull(cluster_factory, pull_codec):
    """Workers built from the job's seed hold what rank 0 put on the shards: their first delta pull offers the
    digest of their values and gets 'unchanged' (no 2.6 MB download per worker at 10 Mbit/s before the clocks
    start); a worker holding anything else gets the full values; both then follow the same rounds."""
    c = cluster_factory(2)
    init = [("w", torch.randn(64, 50, generator=torch.Generator().manual_seed(0))), ("b", torch.zeros(50))]
    cls = [client(c.addrs, r, 3, chunk_bytes=8192, pull_codec=pull_codec) for r in range(3)]
    for cl in cls:
        cl.setup(init, pull=False)
    own = [{n: t.reshape(-1).clone() for n, t in init} for _ in range(2)]
    other = {n: t.reshape(-1) + 1.0 for n, t in init}
    views = [cls[0].pull(out=own[0], delta=True), cls[1].pull(out=own[1], delta=True),
             cls[2].pull(out=other, delta=True)]
    assert [cl.stats.snapshot().get("bytes_pulled_wire", 0) for cl in cls[:2]] == [0, 0]
    assert cls[2].stats.snapshot()["bytes_pulled_wire"] >= (64 * 50 + 50) * 4
    exact = cls[0].pull()
    for n in ("w", "b"):
        assert all(torch.equal(v[n], exact[n]) for v in views)
        assert all(cl.view_versions[k.key] == 0 for cl in cls for k in cl.by_param[n])
    g = torch.Generator().manual_seed(1)
    for cl in cls:
        cl.push({"w": torch.randn(3200, generator=g), "b": torch.randn(50, generator=g)}, 0)
    for cl, v in zip(cls, views):
        cl.pull(min_version=1, out=v, delta=True)
    for n in ("w", "b"):
        assert torch.equal(views[0][n], views[1][n]) and torch.equal(views[0][n], views[2][n])
    for cl in cls:
        cl.close()


def test_the_digest_is_of_the_float32_bytes():
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    assert len(values_digest(x)) == DIGEST_BYTES
    assert values_digest(x) == values_digest(x.reshape(-1).clone()) == values_digest(x.double())   # what goes on the wire
    y = x.reshape(-1).clone()
    y[5] = torch.nextafter(y[5], torch.tensor(float("inf")))                                       # one ulp
    assert values_digest(y) != values_digest(x)
    assert values_digest(torch.zeros(4)) != values_digest(torch.zeros(5))


def test_rollback_to_none_makes_pulls_exact_again(cluster_factory):
    c = cluster_factory(2)
    cls, views = _clients(c, 2, codec="int8", pull_codec="auto")
    assert c.shards[0].pull_spec == "int8"
    _step(cls, views, 0, 3)
    cls[0].set_codec("none")
    assert all(s.pull_spec == "none" for s in c.shards)
    _step(cls, views, 1, 4)
    exact = cls[0].pull()
    for n in ("w", "b"):
        assert torch.equal(views[0][n], exact[n]) and torch.equal(views[1][n], exact[n])
    for cl in cls:
        cl.close()


def test_pull_codec_resolution():
    assert resolve_pull_codec("auto", "none") == "none"
    assert resolve_pull_codec("auto", "topk:ratio=0.01") == "int8"
    assert resolve_pull_codec("auto", "int8") == "int8"
    assert resolve_pull_codec("auto", "qsgd:levels=16") == "int8"
    assert resolve_pull_codec("auto", "fp16") == "fp16"
    assert resolve_pull_codec("fp16", "none") == "fp16"
    with pytest.raises(CodecError, match="stateful"):
        resolve_pull_codec("dgc:ratio=0.01", "none")
    with pytest.raises(CodecError):
        resolve_pull_codec("bogus", "none")


def test_pull_codec_refuses_exactly_the_stateful_codecs():
    """The rule is the codec's own `stateful` attribute: no list of names to keep in step with the registry."""
    for name in available_codecs():
        if get_codec(name).stateful:
            with pytest.raises(CodecError, match="stateful"):
                resolve_pull_codec(name, "none")
        else:
            assert resolve_pull_codec(name, "none") == name


def _pushed_mean(n, seed):
    """The mean of what _step(seed) pushes from n clients."""
    g = torch.Generator().manual_seed(seed)
    pushes = [{"w": torch.randn(5000, generator=g), "b": torch.randn(300, generator=g)} for _ in range(n)]
    return {k: sum(p[k] for p in pushes) / n for k in ("w", "b")}


@pytest.mark.parametrize("residual", ["carry", "drop", "auto"])
def test_an_outer_step_starts_from_the_shards_model_under_carry_and_from_the_pull_view_under_drop(cluster_factory,
                                                                                                 residual):
    """A local-update job (outer avg: model -= mean delta) pulling through a sparse codec: the view lags the shard's
    model by what the pulls did not carry. carry keeps that in the model; drop (auto, under a round codec's pull)
    starts the next step from the view."""
    from deltaps.optimizer_config import outer_optimizer_config
    c = cluster_factory(1)
    cls, views = _clients(c, 2, pull_codec="chunktopk:density=0.05,chunk=256", local_steps=1,
                          opt=outer_optimizer_config("avg", pull_residual=residual))
    _step(cls, views, 0, 1)
    model1, view1 = cls[0].pull(), {n: v.clone() for n, v in views[0].items()}
    assert (model1["w"] - view1["w"]).abs().max() > 0.1          # the sparse pull left most of the step behind
    _step(cls, views, 1, 2)
    start = model1 if residual == "carry" else view1
    mean = _pushed_mean(2, 2)
    model2 = cls[0].pull()
    for n in ("w", "b"):
        assert torch.allclose(model2[n], start[n] - mean[n], atol=1e-5), n
    for cl in cls:
        cl.close()


def test_pull_residual_is_checked_where_it_is_set():
    from deltaps.config import load_config
    from deltaps.optimizer_config import OptimizerConfig, outer_optimizer_config
    with pytest.raises(ValueError, match="pull residual must be one of auto, carry, drop"):
        outer_optimizer_config("nesterov", 0.9, 0.8, pull_residual="keep")
    with pytest.raises(ValueError, match="--pull-residual drop needs --mode ps --local-steps"):
        load_config(None, {"pull_residual": "drop"})
    assert load_config(None, {"pull_residual": "drop", "local_steps": 8}).pull_residual == "drop"
    from protos import pb
    assert OptimizerConfig.from_proto(pb.OptimizerConfig(name="sgd", lr=1.0)).pull_residual == "auto"   # unset
    import torch.optim
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert OptimizerConfig.from_torch(sgd).pull_residual == "carry"      # gradient pushes: nothing is dropped
    from deltaps.pull_codec import resolve_pull_residual
    assert resolve_pull_residual("auto", "chunktopk:density=0.125,chunk=4096,bits=2") == "drop"     # a round codec
    assert resolve_pull_residual("auto", "int8") == "carry" and resolve_pull_residual("auto", "none") == "carry"
    assert resolve_pull_residual("auto", "chunktopk", local_updates=False) == "carry"     # gradient steps
    assert resolve_pull_residual("carry", "chunktopk") == "carry" and resolve_pull_residual("drop", "int8") == "drop"


@pytest.mark.parametrize("keys", ["whole", "balanced"])
def test_a_matrix_codec_gets_whole_row_keys_on_both_sides_of_the_wire(cluster_factory, keys):
    """lowrank: the layout cuts the (100, 50) weight at whole rows (whole: 8 KiB keys, 40 rows; balanced: the row
    blocks that even out the shards' bytes), the shards learn each key's cols from its KeySpec, compress their pull
    deltas as (rows, 50) factor pairs, and every worker ends on the same view; a KeySpec whose cols do not divide
    its elements is refused by name."""
    from deltaps.errors import ShardError
    from deltaps.optimizer_config import outer_optimizer_config
    from protos import pb
    from ps.buffers import key_from_spec
    c = cluster_factory(2)
    cls = [client(c.addrs, r, 2, chunk_bytes=8192, codec=f"lowrank:rank=4,bits=8,keys={keys}", local_steps=1,
                  opt=outer_optimizer_config("avg")) for r in range(2)]
    for cl in cls:
        cl.setup([("w", torch.randn(100, 50, generator=torch.Generator().manual_seed(0))), ("b", torch.zeros(300))])
    if keys == "whole":
        assert [(k.numel, k.cols) for k in cls[0].by_param["w"]] == [(2000, 50), (2000, 50), (1000, 50)]
    else:       # within the 8 KiB key size (>= 3 blocks), spread so that both shards carry their share of the bytes
        w = cls[0].by_param["w"]
        assert len(w) >= 3 and all(k.cols == 50 and k.numel % 50 == 0 for k in w) and sum(k.numel for k in w) == 5000
        assert {k.shard for k in w} == {0, 1}
    assert [k.cols for k in cls[0].by_param["b"]] == [0]
    views = [cl.pull(out=None, delta=True) for cl in cls]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for cl in cls:
            cl.push({"w": torch.randn(100, 50, generator=g), "b": torch.randn(300, generator=g)}, step)
        for cl, v in zip(cls, views):
            cl.pull(min_version=step + 1, out=v, delta=True)
    for k in cls[0].by_param["w"]:
        ks = c.shards[k.shard].keys[k.key]
        assert ks.spec.cols == 50 and ks.view.delta.header["form"] == "factors"
        assert ks.view.delta.shape == (k.numel // 50, 50)
    for n in ("w", "b"):
        assert torch.equal(views[0][n], views[1][n])
    for cl in cls:
        cl.close()
    with pytest.raises(ShardError, match="cols=7 must be 0 or, for a parameter, divide its 100 elements") as e:
        key_from_spec(pb.KeySpec(key="w#0", param="w", numel=100, dtype="float32", cols=7))
    assert e.value.code == "INVALID_ARGUMENT"
