"""Model buffers through DistributedOptimizer (issue 19 item 5): a BatchNorm CNN trained by two deltaps workers
equals the same script under torch DDP (2 gloo ranks, broadcast_buffers=True, same per-rank batches).

The model also has a buffer its forward reads (Center): the parameters then depend on exactly which buffer
values every forward saw, so parameter equality checks that buffers are synchronised at DDP's moment."""
import multiprocessing
import os

import pytest
import torch
from conftest import run_threads
from torch import nn

from compression import Compressor
from deltaps.layout import BUFFER_ROLES, build_layout, layout_digest
from ps.shard import Shard
from ps.state import KeyState
from worker.optimizer import DistributedOptimizer

STEPS, WORLD, BATCH, LR = 30, 2, 16, 0.1


class Center(nn.Module):
    """x - c, where the buffer c follows the batch means while training (a forward that reads a buffer)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("c", torch.zeros(n))

    def forward(self, x):
        out = x - self.c
        if self.training:
            with torch.no_grad():
                self.c.mul_(0.8).add_(x.detach().mean(0), alpha=0.2)
        return out


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), Center(64), nn.Linear(64, 10))


def batch(rank: int, step: int):
    """Rank-specific data (rank 1's inputs shifted and scaled): its BatchNorm statistics differ from rank 0's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 1, 8, 8, generator=g) * (1 + rank) + rank
    return x, torch.randint(0, 10, (BATCH,), generator=g)


def forward_backward(model, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()


def _ddp_rank(rank: int, store: str, out: str) -> None:
    """One DDP rank (a spawned process): the same loop under DistributedDataParallel, state_dict to `out`."""
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)        # broadcast_buffers=True
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        forward_backward(ddp, opt, rank, step)
        opt.step()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
    # both ranks leave together: a rank tearing gloo down while its peer is still connected aborts the
    # peer with "terminate called without an active exception" (seen in CI)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """The DDP run's state_dict per rank (two gloo processes)."""
    tmp = tmp_path_factory.mktemp("ddp")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ddp_rank, args=(r, str(tmp / "store"), str(tmp / f"rank{r}.pt")))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"DDP rank exited with {p.exitcode}"
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def run_deltaps(cluster_factory, buffers: str, sync: str = "bsp", codec: str = "none", min_compress: int = 4096):
    """Two workers (threads) x STEPS through 2 in-process shards; returns (models, buffers before the last
    step(), optimizers)."""
    c = cluster_factory(2)
    models = [make_model() for _ in range(WORLD)]
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR), m, servers=c.addrs, rank=r,
                                 world_size=WORLD, sync=sync, buffers=buffers, codec=codec, chunk_bytes=4096,
                                 compressor=Compressor(codec, min_bytes=min_compress), timeout_s=30)
            for r, m in enumerate(models)]
    last = [None] * WORLD

    def train(r):
        for step in range(STEPS):
            forward_backward(models[r], opts[r], r, step)
            if step == STEPS - 1:
                last[r] = {n: b.clone() for n, b in models[r].named_buffers()}
            opts[r].step()

    run_threads([lambda r=r: train(r) for r in range(WORLD)])
    return models, last, opts, c


def max_diff(a: dict, b: dict, names) -> float:
    return max((a[n].double() - b[n].double()).abs().max().item() for n in names)


def buffer_names(m):
    return [n for n, _ in m.named_buffers()]


def test_broadcast_equals_ddp(cluster_factory, ddp):
    models, _, opts, c = run_deltaps(cluster_factory, "broadcast")
    bufs, params = buffer_names(models[0]), [n for n, _ in models[0].named_parameters()]
    s = [m.state_dict() for m in models]
    across = max_diff(s[0], s[1], bufs)
    vs_ddp_buf = max(max_diff(x, ddp[0], bufs) for x in s)
    vs_ddp_param = max(max_diff(x, ddp[0], params) for x in s)
    ddp_ranks = max_diff(ddp[0], ddp[1], bufs)
    print(f"\nbroadcast: buffers across deltaps workers {across:.3g}, vs DDP rank 0 {vs_ddp_buf:.3g}; "
          f"parameters vs DDP {vs_ddp_param:.3g} (DDP rank 0 vs rank 1 buffers after the last forward: {ddp_ranks:.3g})")
    assert across == 0.0                            # the same model on every worker
    assert vs_ddp_buf < 1e-5 and vs_ddp_param < 1e-5
    assert ddp_ranks > 1e-2                         # the data makes the ranks' statistics differ
    assert all(int(m[1].num_batches_tracked) == STEPS for m in models)
    assert models[0][1].num_batches_tracked.dtype == torch.int64
    # buffer keys live on the shards (role in the checkpointed spec, no optimizer, no pull view)
    keys = [ks for sh in c.shards for ks in sh.keys.values() if ks.spec.is_buffer]
    assert {ks.spec.param for ks in keys} == set(bufs)
    assert all(ks.opt is None and ks.view is None and ks.version == STEPS for ks in keys)
    state = c.shards[0].state_dict()
    fresh = Shard(0, 2)
    fresh.load_state_dict(state)
    for name, ks in c.shards[0].keys.items():
        back = fresh.keys[name]
        assert back.spec == ks.spec and torch.equal(back.value, ks.value)
        assert (back.opt is None) == ks.spec.is_buffer
    for o in opts:
        o.close()


def test_average_is_the_workers_mean(cluster_factory, ddp):
    models, last, opts, _ = run_deltaps(cluster_factory, "average")
    bufs = buffer_names(models[0])
    mean = {n: sum(last[r][n].double() for r in range(WORLD)) / WORLD for n in bufs}
    s = [m.state_dict() for m in models]
    across, vs_mean = max_diff(s[0], s[1], bufs), max(max_diff(x, mean, bufs) for x in s)
    spread = max_diff(last[0], last[1], bufs)
    print(f"\naverage: buffers across workers {across:.3g}, vs the mean of the workers' pre-step buffers "
          f"{vs_mean:.3g} (the workers' own buffers differed by {spread:.3g})")
    assert across == 0.0 and vs_mean < 1e-6 and spread > 1e-2
    assert all(int(m[1].num_batches_tracked) == STEPS for m in models)
    for o in opts:
        o.close()


def test_local_leaves_buffers_alone(cluster_factory, ddp):
    models, _, opts, c = run_deltaps(cluster_factory, "local")
    bufs, params = buffer_names(models[0]), [n for n, _ in models[0].named_parameters()]
    s = [m.state_dict() for m in models]
    across, vs_ddp_param = max_diff(s[0], s[1], bufs), max_diff(s[0], ddp[0], params)
    print(f"\nlocal: buffers across workers {across:.3g}; parameters vs DDP {vs_ddp_param:.3g} "
          f"(Center's buffer is read by the forward)")
    assert across > 1e-2
    assert max_diff(s[0], s[1], params) == 0.0      # parameters still come from the shards
    assert vs_ddp_param > 1e-4                      # buffer timing matters to this model's parameters
    assert not any(ks.spec.is_buffer for sh in c.shards for ks in sh.keys.values())
    for o in opts:
        o.close()


def test_asp_broadcast_ends_equal(cluster_factory):
    models, _, opts, _ = run_deltaps(cluster_factory, "broadcast", sync="asp")
    run_threads([lambda o=o: (o.client.barrier("done"), o.load(o.client.pull())) for o in opts])   # as trainers end
    s = [m.state_dict() for m in models]
    assert max_diff(s[0], s[1], list(s[0])) == 0.0
    for o in opts:
        o.close()


def test_buffers_are_exact_under_a_lossy_codec(cluster_factory):
    models, last, opts, c = run_deltaps(cluster_factory, "broadcast", codec="int8", min_compress=0)
    for m in models:     # rank 0's buffers bit for bit (int8 pushes and pulls cover parameters only)
        for n, b in m.named_buffers():
            assert torch.equal(b, last[0][n]), n
    assert any(ks.view is not None for sh in c.shards for ks in sh.keys.values())
    c.shards[0].set_codec("none")
    c.shards[0].set_codec("int8")                    # views are rebuilt for parameters only
    assert all((ks.view is None) == ks.spec.is_buffer for ks in c.shards[0].keys.values())
    for o in opts:
        o.close()


def test_buffer_layout_roles_and_digest():
    params = [("w", 10, "float32")]
    plain = build_layout(params, 2)
    assert layout_digest(plain, 2) == layout_digest(build_layout(params, 2, buffers=[]), 2)
    bcast = build_layout(params, 2, buffers=[("bn.n", 1)], buffer_role=BUFFER_ROLES["broadcast"])
    avg = build_layout(params, 2, buffers=[("bn.n", 1)], buffer_role=BUFFER_ROLES["average"])
    assert [k.role for k in bcast] == ["param", "buffer:broadcast"]
    assert bcast[1].dtype == "float32" and bcast[1].is_buffer and not bcast[0].is_buffer
    assert len({layout_digest(x, 2) for x in (plain, bcast, avg)}) == 3
    with pytest.raises(ValueError, match="unique"):
        build_layout(params, 2, buffers=[("w", 1)])
    with pytest.raises(ValueError, match="buffer sync"):
        DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), make_model(), servers=["x:1"],
                             buffers="sometimes")
    ks = KeyState.from_state_dict({"spec": ["w#0", "w", 0, 10, "float32", 0], "value": torch.zeros(10),
                                   "initialized": False, "version": 0, "pushed": {}, "agg": None, "agg_from": []},
                                  None, "none")
    assert ks.spec.role == "param"                   # checkpoints written before buffer keys still load


def test_shard_buffer_rules():
    from compression import Decoded
    from deltaps.layout import Key
    from ps import buffers

    def key(mode):
        ks = KeyState(Key("b#0", "b", 0, 2, "float32", 0, BUFFER_ROLES[mode]), torch.full((2,), 1.0))
        ks.agg = torch.zeros(2)
        return ks

    def push(ks, worker, v):
        buffers.take(ks, worker, None if v is None else Decoded(2, dense=torch.full((2,), float(v))))
        ks.agg_from.add(worker)

    for mode, pushes, want in [("broadcast", [(2, 7), (0, 5), (1, 3)], 5.0),   # the lowest id, in any order
                               ("average", [(1, 3), (0, 5), (2, 7)], 5.0),
                               ("average", [(0, 3), (1, None)], 2.0),          # skipped: the current value (1)
                               ("broadcast", [(0, None), (1, 3)], 1.0)]:
        ks = key(mode)
        for w, v in pushes:
            push(ks, w, v)
        buffers.finish(ks)
        assert ks.value.tolist() == [want, want], (mode, pushes)
    ks = key("broadcast")                            # asp/ssp: only the lowest live worker's pushes count
    buffers.assign(ks, 1, Decoded(2, dense=torch.full((2,), 9.0)), {1, 2})
    buffers.assign(ks, 2, Decoded(2, dense=torch.full((2,), 4.0)), {1, 2})
    assert ks.value.tolist() == [9.0, 9.0]
    ks = key("average")                              # each push moves the value 1/W of the way
    buffers.assign(ks, 1, Decoded(2, dense=torch.full((2,), 5.0)), {0, 1})
    assert ks.value.tolist() == [3.0, 3.0]
