"""Local-update training (DiLoCo-style, worker/local_updates.py) through real loopback shards: the outer
optimizer on the shards against torch's own, H=1 against synchronous PS training, streaming fragments."""
import grpc
import pytest
import torch
from conftest import run_threads
from torch import nn

from deltaps.errors import PSError
from deltaps.optimizer_config import OptimizerConfig, outer_optimizer_config
from worker.local_updates import split_fragments
from worker.optimizer import DistributedOptimizer

WORLD, BATCH = 2, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 8, generator=g) * (1 + rank), torch.randint(0, 4, (BATCH,), generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def train_deltaps(cluster_factory, steps: int, lr: float, **kw):
    """WORLD workers (threads) x steps of inner SGD through 2 shards; returns the models after flush()
    and the final pull, and the cluster."""
    c = cluster_factory(2)
    models = [make_model() for _ in range(WORLD)]
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr), m, servers=c.addrs, rank=r,
                                 world_size=WORLD, timeout_s=30, **kw) for r, m in enumerate(models)]

    def train(r):
        for step in range(steps):
            opts[r].zero_grad()
            loss_of(models[r], r, step).backward()
            opts[r].step()
        opts[r].flush()
        opts[r].client.barrier("done")
        opts[r].load(opts[r].client.pull(min_version=0))

    run_threads([lambda r=r: train(r) for r in range(WORLD)])
    for o in opts:
        o.close()
    return models, c


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_h1_inner_sgd_outer_avg_equals_synchronous_ps_with_server_sgd(cluster_factory):
    local, c = train_deltaps(cluster_factory, 12, 0.1, local_steps=1, outer=outer_optimizer_config("avg"))
    sync, _ = train_deltaps(cluster_factory, 12, 0.1)
    diff = max_diff(local[0], sync[0])
    print(f"\nH=1, inner SGD, outer avg vs synchronous PS with server SGD: max |diff| {diff:.3g}")
    assert max_diff(local[0], local[1]) == 0.0
    assert diff < 1e-6
    st = c.shards[0].stats()
    assert st["local_steps"] == 1 and st["outer_updates"] == st["grads_applied"] > 0


def reference_local_updates(steps: int, H: int, lr: float, outer: torch.optim.Optimizer, theta: list):
    """The same job simulated with plain torch: WORLD local models of inner SGD from the global model,
    every H steps the outer optimizer applied to the mean delta (theta - local) as the gradient."""
    locals_ = [make_model() for _ in range(WORLD)]
    inner = [torch.optim.SGD(m.parameters(), lr=lr) for m in locals_]
    for step in range(steps):
        for r in range(WORLD):
            inner[r].zero_grad()
            loss_of(locals_[r], r, step).backward()
            inner[r].step()
        if (step + 1) % H == 0 or step == steps - 1:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    t.grad = sum(t.detach() - list(m.parameters())[i].detach() for m in locals_) / WORLD
            outer.step()
            with torch.no_grad():
                for m in locals_:
                    for p, t in zip(m.parameters(), theta):
                        p.copy_(t)
    return theta


def test_outer_nesterov_on_the_shards_equals_torch_sgd_nesterov_on_the_mean_delta(cluster_factory):
    steps, H, lr = 14, 3, 0.1          # 4 full rounds and a last partial one (flush)
    got, c = train_deltaps(cluster_factory, steps, lr, local_steps=H,
                           outer=outer_optimizer_config("nesterov", lr=0.7, momentum=0.9))
    theta = [p.detach().clone().requires_grad_(True) for p in make_model().parameters()]
    ref = reference_local_updates(steps, H, lr, torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True), theta)
    diff = max((p - t).abs().max().item() for p, t in zip(got[0].parameters(), ref))
    print(f"\nouter nesterov: shards vs torch.optim.SGD(nesterov=True) on the mean delta: max |diff| {diff:.3g}")
    assert diff < 1e-5
    assert max_diff(got[0], got[1]) == 0.0
    assert all(ks.version == 5 for sh in c.shards for ks in sh.keys.values())   # 4 rounds + the flush round
    st = next(iter(c.shards[0].keys.values())).opt.state_dict()
    assert st["state"] and "momentum_buffer" in st["state"][0]               # outer momentum lives on the shard


def test_streaming_fragments_sync_staggered_and_end_equal(cluster_factory):
    steps, H = 16, 4
    got, c = train_deltaps(cluster_factory, steps, 0.1, local_steps=H, stream_fragments=2,
                           outer=outer_optimizer_config("avg"), codec="int8")
    assert max_diff(got[0], got[1]) == 0.0
    versions = sorted({ks.version for sh in c.shards for ks in sh.keys.values()})
    # fragment 0 syncs at inner steps 2, 6, 10, 14 (+ the flush round), fragment 1 at 4, 8, 12, 16
    assert versions in ([4, 5], [5], [4]), versions
    assert sum(sh.stats()["outer_updates"] for sh in c.shards) > 0


def reference_overlapped(steps: int, H: int, tau: int, lr: float) -> list[torch.Tensor]:
    """Outer avg with the exchange overlapping tau inner steps, in plain torch: the round sent after inner
    step t lands after step t + tau, each worker keeping its progress since the send (p += new - p_at_send);
    after the last step a final round without overlap. Returns the final global model."""
    locals_ = [make_model() for _ in range(WORLD)]
    inner = [torch.optim.SGD(m.parameters(), lr=lr) for m in locals_]
    params = [list(m.parameters()) for m in locals_]
    pending = None                     # (inner step of the send, new global model, each worker's p at send)

    def land():
        for r in range(WORLD):
            for p, new, sent in zip(params[r], pending[1], pending[2][r]):
                p.add_(new - sent)

    for step in range(1, steps + 1):
        for r in range(WORLD):
            inner[r].zero_grad()
            loss_of(locals_[r], r, step - 1).backward()
            inner[r].step()
        with torch.no_grad():
            if pending and step - pending[0] >= tau:
                land()
                pending = None
            if step % H == 0:          # avg: the new global model is the mean of the local models
                new = [sum(ps[i].detach() for ps in params) / WORLD for i in range(len(params[0]))]
                pending = (step, new, [[p.detach().clone() for p in ps] for ps in params])
                if not tau:
                    land()
                    pending = None
    with torch.no_grad():
        if pending:
            land()
        return [sum(ps[i].detach() for ps in params) / WORLD for i in range(len(params[0]))]


@pytest.mark.parametrize("tau", [0, 2, 3])
def test_an_exchange_overlapping_tau_inner_steps_keeps_the_progress_made_meanwhile(cluster_factory, tau):
    steps, H = 14, 4                   # rounds at 4, 8, 12 landing tau steps later, then the flush round
    got, _ = train_deltaps(cluster_factory, steps, 0.1, local_steps=H, overlap_steps=tau,
                           outer=outer_optimizer_config("avg"))
    ref = reference_overlapped(steps, H, tau, 0.1)
    diff = max((p - t).abs().max().item() for p, t in zip(got[0].parameters(), ref))
    assert diff < 1e-5, diff
    assert max_diff(got[0], got[1]) == 0.0
    if tau:   # the delayed merge is not the same training as waiting for each round
        assert max((p - t).abs().max().item() for p, t in
                   zip(got[0].parameters(), reference_overlapped(steps, H, 0, 0.1))) > 1e-4


def test_overlap_steps_must_end_before_the_next_round(cluster_factory):
    c = cluster_factory(1)
    m = make_model()
    with pytest.raises(ValueError, match="--overlap-steps"):
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=0, world_size=1,
                             local_steps=4, overlap_steps=4, timeout_s=10)
    with pytest.raises(ValueError, match="--overlap-steps"):   # it lands before the next fragment's round
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=0, world_size=1,
                             local_steps=4, stream_fragments=2, overlap_steps=2, timeout_s=10)


def test_split_fragments_is_contiguous_and_covers_every_parameter():
    named = list(make_model().named_parameters())
    for f in range(1, len(named) + 1):
        groups = split_fragments(named, f)
        assert len(groups) == f and all(groups)
        assert [n for g in groups for n in g] == [n for n, _ in named]
    with pytest.raises(ValueError, match="stream-fragments"):
        split_fragments(named, len(named) + 1)


def test_a_worker_of_another_local_step_count_is_refused(cluster_factory):
    c = cluster_factory(1)
    m = make_model()
    first = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=0, world_size=2,
                                 local_steps=4, outer=outer_optimizer_config("avg"), timeout_s=10)
    with pytest.raises(PSError, match="--local-steps") as e:
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=1, world_size=2,
                             timeout_s=10, reconnect_deadline_s=2)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    first.close()


def test_outer_optimizer_configs():
    assert outer_optimizer_config("avg") == OptimizerConfig("sgd", lr=1.0)
    assert outer_optimizer_config("nesterov", 0.7, 0.9) == OptimizerConfig("sgd", lr=0.7, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        outer_optimizer_config("nesterov", 0.7, 0.0)
    with pytest.raises(ValueError, match="unknown outer optimizer"):
        outer_optimizer_config("adam")


def test_global_model_is_the_shards_model_between_rounds(cluster_factory):
    c = cluster_factory(1)
    m = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=0, world_size=1,
                               local_steps=4, outer=outer_optimizer_config("avg"), timeout_s=10)
    for step in range(6):             # one round at step 4, then 2 local steps
        opt.zero_grad()
        loss_of(m, 0, step).backward()
        opt.step()
    assert opt.synced and opt.local.inner == 6 and opt.round == 1
    own = [p.detach().clone() for p in m.parameters()]
    server = opt.client.pull(min_version=0)
    with opt.global_model():
        assert all(torch.equal(p.detach().view(-1), server[n]) for n, p in m.named_parameters())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), own))
    assert not all(torch.equal(p.detach().view(-1), server[n]) for n, p in m.named_parameters())
    opt.close()


def test_a_codec_switch_waits_for_the_exchange_still_in_flight(cluster_factory):
    """A rollback announced while a streamed round is still encoding is adopted at the first step with nothing in
    flight: the exchange keeps the codec and error feedback it started with."""
    c = cluster_factory(1)
    m = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, servers=c.addrs, rank=0, world_size=1,
                               timeout_s=30, codec="int8", local_steps=4, stream_fragments=2,
                               outer=outer_optimizer_config("avg"))
    opt.client.codec = "none"                        # what the shards announce after `deltaps ctl set-codec none`
    opt.local.inflight[0] = ([], {})                 # a fragment's exchange still encoding
    opt._end_step()
    assert opt.client.compressor.spec == "int8" and opt.codec_switches == []
    opt.local.inflight.clear()
    opt._end_step()
    assert opt.client.compressor.spec == "none" and len(opt.codec_switches) == 1
    opt.close()
