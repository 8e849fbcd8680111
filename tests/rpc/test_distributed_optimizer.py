"""DistributedOptimizer: two workers (threads) through real shards equal one big-batch local run."""
import copy

import torch
from conftest import run_threads
from torch import nn

from worker.optimizer import DistributedOptimizer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def test_bsp_two_workers_equal_local_training_on_the_union_batch(cluster_factory):
    c = cluster_factory(2)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 20, generator=g) for _ in range(2)]
    ys = [torch.randint(0, 3, (16,), generator=g) for _ in range(2)]
    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    models = [copy.deepcopy(reference) for _ in range(2)]
    opts = [None, None]

    def make(r):
        opts[r] = DistributedOptimizer(torch.optim.Adam(models[r].parameters(), lr=0.01), models[r],
                                       servers=c.addrs, rank=r, world_size=2, chunk_bytes=4096, timeout_s=30)

    make(0)
    make(1)
    steps = 5

    def train(r):
        for _ in range(steps):
            loss = nn.functional.cross_entropy(models[r](xs[r]), ys[r])
            opts[r].zero_grad()
            loss.backward()
            opts[r].step()

    run_threads([lambda r=r: train(r) for r in range(2)])
    for _ in range(steps):   # mean of two equal-size batch gradients == gradient of the union
        loss = nn.functional.cross_entropy(reference(torch.cat(xs)), torch.cat(ys))
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    for m in models:
        for (n, p), q in zip(m.named_parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-5), n
    assert opts[0].clock == steps
    for o in opts:
        o.close()


def test_workers_built_from_the_jobs_seed_download_nothing_at_start(cluster_factory):
    """The first pull of a worker whose model is rank 0's (same seed) is 'unchanged' for every key; a worker built
    otherwise downloads the job's values and takes them."""
    c = cluster_factory(2)
    models = [_model(), _model(), _model()]
    with torch.no_grad():
        for p in models[2].parameters():
            p.add_(1.0)
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=r, world_size=3,
                                 chunk_bytes=4096, timeout_s=30) for r, m in enumerate(models)]
    pulled = [o.client.stats.snapshot().get("bytes_pulled_wire", 0) for o in opts]
    assert pulled[:2] == [0, 0] and pulled[2] == sum(p.numel() * 4 for p in models[0].parameters())
    for p, q in zip(models[2].parameters(), models[0].parameters()):
        assert torch.equal(p, q)
    for o in opts:
        o.close()


def test_unused_parameter_still_takes_part(cluster_factory):
    c = cluster_factory(1)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    m = Two()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, timeout_s=10)
    before = m.unused.weight.detach().clone()
    for _ in range(3):
        m(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(m.unused.weight, before)      # zero gradient pushed, server did not stall
    assert opt.clock == 3
    opt.close()


def test_server_optimizer_is_taken_from_wrapped_torch_optimizer(cluster_factory):
    c = cluster_factory(1)
    m = nn.Linear(3, 1)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.5, nesterov=True), m,
                               servers=c.addrs, timeout_s=10)
    cfg = c.shards[0].job.optimizer
    assert (cfg.name, cfg.lr, cfg.momentum, cfg.nesterov) == ("sgd", 0.3, 0.5, True)
    opt.close()


def test_second_backward_before_step_is_refused_and_accumulation_works(cluster_factory):
    import pytest
    c = cluster_factory(1)
    m = nn.Linear(4, 1)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, timeout_s=10)
    x = torch.randn(8, 4)
    m(x).sum().backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        m(x).sum().backward()
    opt.close()
    m2 = nn.Linear(4, 1)
    w0 = m2.weight.detach().clone()
    opt2 = DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1), m2, servers=cluster_factory(1).addrs,
                                timeout_s=10, backward_passes_per_step=2)
    g = torch.zeros_like(w0)
    for xb in (x[:4], x[4:]):
        m2(xb).sum().backward()
    g = m2.weight.grad.detach().clone() / 2          # the mean of the two passes is what gets pushed
    opt2.step()
    assert torch.allclose(m2.weight, w0 - 0.1 * g, atol=1e-6)
    opt2.close()
