"""Real gRPC shards on loopback (port 0): round trips, chunking, sync modes, server optimizers."""
import threading
import time

import pytest
import torch
from conftest import run_threads
from helpers import client, named

from deltaps.optimizer_config import OptimizerConfig


@pytest.mark.parametrize("num_shards", [2, 3])
def test_key_split_across_shards_round_trips_exactly(cluster_factory, num_shards):
    c = cluster_factory(num_shards)
    x = torch.randn(10_000)
    with client(c.addrs, chunk_bytes=4096) as cl:
        got = cl.setup([("x", x), ("y", torch.arange(7, dtype=torch.float32))])
        assert {k.shard for k in cl.by_param["x"]} == set(range(num_shards))
        assert torch.equal(got["x"], x) and torch.equal(got["y"], torch.arange(7, dtype=torch.float32))
        g = torch.randn(10_000)
        cl.push({"x": g, "y": torch.zeros(7)}, step=0)
        after = cl.pull(min_version=1)
        assert torch.equal(after["x"], x.add(g, alpha=-0.1))


def test_tensor_larger_than_64mib_is_chunked_and_intact(cluster_factory):
    c = cluster_factory(2)
    n = (68 << 20) // 4
    x = torch.randn(n)
    with client(c.addrs, opt=OptimizerConfig("sgd", lr=1.0)) as cl:
        got = cl.setup([("huge", x)])
        assert len(cl.by_param["huge"]) == 17          # 4 MiB keys
        assert torch.equal(got["huge"], x)
        g = torch.randn(n)
        cl.push({"huge": g}, step=0)
        assert torch.equal(cl.pull(min_version=1)["huge"], x.add(g, alpha=-1.0))
        assert cl.stats.snapshot()["push_rpcs"] == 17   # no message above one chunk


def test_bsp_applies_mean_of_three_workers_once_per_step(cluster_factory):
    c = cluster_factory(2)
    params = named(1)
    init = {n: t.clone() for n, t in params}
    grads = {r: [{n: torch.randn(t.shape) for n, t in params} for _ in range(3)] for r in range(3)}
    clients = [client(c.addrs, r, 3, chunk_bytes=2048) for r in range(3)]
    clients[0].setup(params)
    run_threads([lambda cl=cl: cl.setup(params) for cl in clients[1:]])
    versions = {}

    def work(r):
        for step in range(3):
            clients[r].push(grads[r][step], step)
            versions[(r, step)] = clients[r].pull(min_version=step + 1)

    run_threads([lambda r=r: work(r) for r in range(3)])
    expected = {n: v.clone() for n, v in init.items()}
    for step in range(3):
        for n in expected:
            expected[n] -= 0.1 * sum(grads[r][step][n] for r in range(3)) / 3
            for r in range(3):   # every worker saw exactly step+1 applied updates
                if step == 2:
                    assert torch.allclose(versions[(r, step)][n].view_as(expected[n]), expected[n], atol=1e-6)
    stats = clients[0].server_stats()
    keys = sum(s["num_keys"] for s in stats)
    assert sum(s["grads_applied"] for s in stats) == keys * 3     # once per step per key, not per push
    assert all(s["min_version"] == s["max_version"] == 3 for s in stats)
    assert all(s["max_staleness"] == 0 for s in stats)
    for cl in clients:
        cl.close()


def test_asp_applies_every_push(cluster_factory):
    c = cluster_factory(2)
    params = named(2)
    init = {n: t.clone() for n, t in params}
    clients = [client(c.addrs, r, 2, sync="asp") for r in range(2)]
    clients[0].setup(params)
    clients[1].setup(params)
    grads = [[{n: torch.randn(t.shape) for n, t in params} for _ in range(4)] for _ in range(2)]
    run_threads([lambda r=r: [clients[r].push(grads[r][s], s) for s in range(4)] for r in range(2)])
    final = clients[0].pull(min_version=4)
    for n, v in init.items():   # each push applied with weight 1/W, order does not matter for plain SGD
        exp = v - 0.1 * sum(grads[r][s][n] for r in range(2) for s in range(4)) / 2
        assert torch.allclose(final[n].view_as(exp), exp, atol=1e-5)
    stats = clients[0].server_stats()
    assert sum(s["grads_applied"] for s in stats) == sum(s["num_keys"] for s in stats) * 8
    for cl in clients:
        cl.close()


def test_ssp_blocks_worker_two_clocks_ahead_and_bounds_staleness(cluster_factory):
    c = cluster_factory(1)
    params = [("w", torch.zeros(100))]
    fast, slow = client(c.addrs, 0, 2, sync="ssp:1"), client(c.addrs, 1, 2, sync="ssp:1")
    fast.setup(params)
    slow.setup(params)
    g = {"w": torch.ones(100)}
    # fast completes clocks 0 and 1; its pull for clock 2 needs version >= 2 - 1 = 1, i.e. slow's clock 0.
    for clock in range(2):
        fast.pull(min_version=fast.sync.pull_min_version(clock))
        fast.push(g, clock)
    done = threading.Event()
    t = threading.Thread(target=lambda: (fast.pull(min_version=fast.sync.pull_min_version(2)), done.set()))
    t.start()
    assert not done.wait(0.8), "fast worker was not blocked 2 clocks ahead of the slow one"
    slow.push(g, 0)
    assert done.wait(10), "fast worker not released after the slow one caught up"
    t.join()
    fast.close()
    slow.close()


def test_ssp_staleness_never_exceeds_bound_under_random_timing(cluster_factory):
    c = cluster_factory(2)
    params = named(3)
    bound = 2
    clients = [client(c.addrs, r, 3, sync=f"ssp:{bound}", chunk_bytes=2048) for r in range(3)]
    for cl in clients:
        cl.setup(params)
    g = {n: torch.full(t.shape, 0.01) for n, t in params}
    rng = torch.Generator().manual_seed(0)
    delays = torch.rand(3, 12, generator=rng) * torch.tensor([[0.0], [0.01], [0.04]])

    def work(r):
        cl = clients[r]
        for clock in range(12):
            cl.pull(min_version=cl.sync.pull_min_version(clock))
            time.sleep(float(delays[r, clock]))
            cl.push(g, clock)

    run_threads([lambda r=r: work(r) for r in range(3)])
    stats = clients[0].server_stats()
    assert max(s["max_staleness"] for s in stats) <= bound
    assert max(s["max_staleness"] for s in stats) >= 1, "test did not exercise any staleness"
    assert sum(sum(s["staleness_counts"]) for s in stats) == sum(s["num_keys"] for s in stats) * 36
    for cl in clients:
        cl.close()


@pytest.mark.parametrize("make_opt,cfg", [
    (lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01),
     OptimizerConfig("adam", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.01)),
    (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     OptimizerConfig("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1),
     OptimizerConfig("sgd", lr=0.05, momentum=0.9, dampening=0.1)),
])
def test_server_optimizer_matches_torch_optim(cluster_factory, make_opt, cfg):
    c = cluster_factory(3)
    x0 = torch.randn(5000)
    local = x0.clone().requires_grad_(True)
    opt = make_opt([local])
    with client(c.addrs, opt=cfg, chunk_bytes=4096) as cl:   # the parameter spans all 3 shards
        cl.setup([("x", x0)])
        for step in range(20):
            g = torch.randn(5000)
            local.grad = g.clone()
            opt.step()
            cl.push({"x": g}, step)
            got = cl.pull(min_version=step + 1)["x"]
            assert torch.allclose(got, local.detach(), atol=1e-6, rtol=0), f"diverged at step {step}"


def test_worker_zero_initialises_every_shard_at_once(cluster_factory, monkeypatch):
    """A shard's first Init builds its optimizers (torch's first one imports torch._dynamo: ~1 s of a core);
    one shard after another, a 4-shard job waited ~4 s before its first step."""
    from ps.shard import Shard
    spans, lock = {}, threading.Lock()
    real_init = Shard.init

    def slow_init(self, values):
        start = time.monotonic()
        time.sleep(0.3)
        done = real_init(self, values)
        with lock:
            spans.setdefault(self.shard_id, []).append((start, time.monotonic()))
        return done

    monkeypatch.setattr(Shard, "init", slow_init)
    c = cluster_factory(3)
    params = named(2, sizes=(("a", (64,)), ("b", (64,)), ("c", (64,))))
    with client(c.addrs) as cl:
        got = cl.setup(params)
    assert all(torch.equal(got[n], t) for n, t in params)
    assert sorted(spans) == [0, 1, 2]
    first_ends = min(end for s in spans.values() for _, end in s)
    last_starts = max(start for s in spans.values() for start, _ in s)
    assert last_starts < first_ends, f"the shards' Inits ran one after another: {spans}"
