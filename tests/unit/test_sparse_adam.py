"""Server Adam on top-k steps (ps/optimizer.py): lazy on the coordinates sent, dense torch Adam otherwise."""
import copy

import torch

from compression import Compressor, unpack_payload
from compression.server import Decoded
from deltaps.optimizer_config import OptimizerConfig
from ps.optimizer import CATCH_UP_POWER, KeyOptimizer

CFG = OptimizerConfig("adam", lr=1e-3)


def grads(steps, n=2000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(steps)]


def test_sparse_path_with_every_coordinate_equals_torch_adam():
    for wd in (0.0, 0.01):
        cfg = OptimizerConfig("adam", lr=1e-2, weight_decay=wd)
        a, b = torch.ones(2000), torch.ones(2000)
        ref, lazy = KeyOptimizer(a, cfg), KeyOptimizer(b, cfg)
        for g in grads(20):
            ref.apply(g)
            lazy.apply_sparse(torch.arange(2000), g)
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
        assert torch.allclose(ref.opt.state[a]["exp_avg_sq"], lazy.opt.state[b]["exp_avg_sq"], rtol=1e-5)


def test_a_burst_of_k_silent_steps_moves_k_to_the_catch_up_power_steps():
    """A coordinate silent for k-1 steps, then receiving its accumulated residual (k x a steady gradient),
    moves k**CATCH_UP_POWER Adam steps of lr, not one (plain lazy Adam) and not a blow-up; silent
    coordinates do not move at all (dense Adam keeps moving them on decayed m)."""
    n, k = 1000, 40
    lazy_v, dense_v = torch.zeros(n), torch.zeros(n)
    lazy, dense = KeyOptimizer(lazy_v, CFG), KeyOptimizer(dense_v, CFG)
    busy = torch.arange(0, 10)           # sent every step
    for _ in range(k):
        g = torch.zeros(n)
        g[busy] = 0.01
        before = lazy_v.clone()
        lazy.apply_sparse(busy, g[busy])
        dense.apply(g)
        assert torch.equal(lazy_v[10:], before[10:])            # silent: untouched
    burst = torch.arange(500, 510)
    g = torch.zeros(n)
    g[burst] = 0.01 * (k + 1)            # the residual of k + 1 steps of gradient 0.01, sent at step k + 1
    before_l = lazy_v.clone()
    lazy.apply_sparse(burst, g[burst])
    dense.apply(g)
    step_l = (lazy_v - before_l).abs()
    # m and v of a never-sent coordinate are its mean gradient after bias correction: a sign step, scaled
    assert torch.allclose(step_l[burst], torch.full((10,), CFG.lr * (k + 1) ** CATCH_UP_POWER), rtol=1e-4)
    assert step_l[busy].max() == 0 and lazy.coord_steps[burst].eq(k + 1).all()
    moved_after = []
    for _ in range(10):                  # silent again: dense Adam keeps moving it, lazy does not
        b_l, b_d = lazy_v.clone(), dense_v.clone()
        lazy.apply_sparse(busy, torch.full((10,), 0.01))
        g = torch.zeros(n)
        g[busy] = 0.01
        dense.apply(g)
        assert torch.equal(lazy_v[burst], b_l[burst])
        moved_after.append(float((dense_v[burst] - b_d[burst]).abs().max()))
    assert sum(moved_after) > 2 * CFG.lr


def test_apply_step_picks_the_path_from_the_pushes():
    n = 4096
    c = Compressor("topk:ratio=0.01", min_bytes=0)
    g = grads(1, n)[0]
    d = unpack_payload(c.compress("w", g, step=0))
    assert d.sparse and d.codec == "topk"
    v1 = torch.zeros(n)
    lazy = KeyOptimizer(v1, CFG)
    agg = torch.zeros(n)
    d.add_to(agg)
    lazy.note_push(d)
    lazy.apply_step(agg.clone())
    assert int((v1 != 0).sum()) == d.indices.numel()          # only the sent coordinates moved
    # a dense push in the step (raw small tensor, warm-up, other codec) -> torch's dense step
    lazy.note_push(d)
    lazy.note_push(Decoded(n, dense=g, codec="none"))
    before = v1.clone()
    lazy.apply_step(g.clone())
    assert int((v1 != before).sum()) > n // 2
    # SGD servers are unchanged whatever the pushes
    s1, s2 = torch.zeros(n), torch.zeros(n)
    sgd = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
    a, b = KeyOptimizer(s1, sgd), KeyOptimizer(s2, sgd)
    a.note_push(d)
    a.apply_step(agg.clone())
    b.apply(agg.clone())
    assert torch.equal(s1, s2)


def test_state_dict_round_trip_keeps_coordinate_steps():
    v = torch.zeros(100)
    o = KeyOptimizer(v, CFG)
    o.apply(torch.ones(100))
    o.apply_sparse(torch.tensor([3, 7]), torch.tensor([1.0, -1.0]))
    assert o.coord_steps[3] == 2 and o.coord_steps[0] == 1
    w = v.clone()
    o2 = KeyOptimizer(w, CFG)
    o2.load_state_dict(copy.deepcopy(o.state_dict()))   # as KeyState.state_dict does
    for opt in (o, o2):
        opt.apply_sparse(torch.tensor([3]), torch.tensor([0.5]))
    assert torch.equal(v, w) and torch.equal(o.coord_steps, o2.coord_steps)


def test_dense_steps_after_a_lazy_phase_are_torch_adam_with_zeros_on_the_silent_steps():
    """A dense step (warm-up, rollback, a raw push) after lazy steps: one step of its gradient after each
    coordinate's silent steps, m and v decayed over them — torch's Adam with zero gradients on the silent
    steps (from a fresh optimizer, where zero momentum does not drift, exactly equal)."""
    n = 100
    a, b = torch.zeros(n), torch.zeros(n)
    o, ref = KeyOptimizer(a, CFG), KeyOptimizer(b, CFG)
    first = torch.zeros(n)
    first[[3, 7]] = torch.tensor([1.0, -1.0])
    o.apply_sparse(torch.tensor([3, 7]), first[[3, 7]])
    ref.apply(first)
    for g in grads(3, n):
        o.apply(g)
        ref.apply(g)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)
    assert torch.allclose(o.opt.state[a]["exp_avg_sq"], ref.opt.state[b]["exp_avg_sq"], rtol=1e-5)
    assert o.coord_steps.eq(4).all()


def test_a_half_aggregated_step_keeps_its_kind_across_a_checkpoint():
    n = 4096
    d = unpack_payload(Compressor("topk:ratio=0.01", min_bytes=0).compress("w", grads(1, n)[0], step=0))
    o = KeyOptimizer(torch.zeros(n), CFG)
    o.note_push(Decoded(n, dense=torch.ones(n), codec="none"))      # a dense push, then the checkpoint
    o2 = KeyOptimizer(torch.zeros(n), CFG)
    o2.load_state_dict(copy.deepcopy(o.state_dict()))
    o2.note_push(d)                                                  # a top-k push after the restore
    o2.apply_step(torch.ones(n))
    assert o2.coord_steps is None and int((o2.value != 0).sum()) == n   # the dense path, as without the crash


def test_shard_bsp_step_of_topk_pushes_moves_only_the_union():
    from deltaps.layout import build_layout
    from ps.shard import Shard

    n = 4096
    layout = build_layout([("w", n, "float32")], 1)
    for codec, moved_max in (("topk:ratio=0.01", 2 * 41), ("int8", n)):
        shard = Shard(0, 1, wait_timeout_s=5.0)
        for w in (0, 1):
            shard.register(w, 2, 1, "bsp", CFG, layout, "digest", codec, "none")
        shard.init([("w#0", torch.zeros(n))])
        comps = [Compressor(codec, min_bytes=0) for _ in range(2)]
        for w, g in enumerate(grads(2, n, seed=3)):
            shard.push(w, 0, [("w#0", unpack_payload(comps[w].compress("w#0", g, step=0, seed=w)))], [0])
        moved = int((shard.keys["w#0"].value != 0).sum())
        assert (moved <= moved_max) if codec.startswith("topk") else moved > n // 2, (codec, moved)
