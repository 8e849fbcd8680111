"""Elastic jobs on one shard: joins up to --max-workers, leaves, the bsp mean over the live set, a pause below
--min-workers that ends when a worker joins, and a restore that resumes with another worker count."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from deltaps.errors import PAUSED, ShardError
from deltaps.layout import build_layout
from deltaps.optimizer_config import OptimizerConfig
from ps.shard import Shard

SGD = OptimizerConfig("sgd", lr=1.0)
LAYOUT = build_layout([("w", 4, "float32")], 1)


def _register(shard, worker, world=2, lo=1, hi=4):
    return shard.register(worker, world, 1, "bsp", SGD, LAYOUT, "digest", "none", "none", lo, hi)


def _job(lo=1, hi=4, world=2, **kw) -> Shard:
    shard = Shard(0, 1, wait_timeout_s=kw.pop("wait_timeout_s", 5.0), **kw)
    for w in range(world):
        _register(shard, w, world, lo, hi)
    shard.init([("w#0", torch.zeros(4))])
    return shard


def _push(shard, worker, step, value):
    return shard.push(worker, step, [("w#0", torch.full((4,), float(value)))], [step])


def test_joins_leaves_and_the_bsp_mean_follow_the_live_set():
    shard = _job()
    _push(shard, 0, 0, 1.0)
    _push(shard, 1, 0, 3.0)
    assert shard.keys["w#0"].version == 1 and torch.allclose(shard.keys["w#0"].value, torch.full((4,), -2.0))
    _register(shard, 2)                       # joins mid-run: a world size of 2 is fine for an elastic job
    _register(shard, 3, world=4)
    assert shard.live == {0, 1, 2, 3} and shard.worker_step(3) == 1
    for w, g in ((0, 1.0), (1, 2.0), (2, 3.0)):
        _push(shard, w, 1, g)
    assert shard.keys["w#0"].version == 1     # still waits for worker 3
    _push(shard, 3, 1, 6.0)
    assert shard.keys["w#0"].version == 2 and torch.allclose(shard.keys["w#0"].value, torch.full((4,), -5.0))
    from ps.durability import durable_steps
    assert durable_steps(shard.state_dict())[3] == 2      # a joiner's pushes become durable like the others'
    shard.evict(3, "test")                    # leaves: the next step is the mean over three
    for w, g in ((0, 3.0), (1, 3.0), (2, 6.0)):
        _push(shard, w, 2, g)
    assert torch.allclose(shard.keys["w#0"].value, torch.full((4,), -9.0))
    st = shard.stats()
    assert st["step_contributors"][2:] == [1, 1, 1] and st["live_workers"] == [0, 1, 2] and st["joins"] == 2
    with pytest.raises(ShardError, match="max-workers 4") as e:
        _register(shard, 4)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ShardError, match="--max-workers") as e:
        shard.register(5, 2, 1, "bsp", SGD, LAYOUT, "digest", "none", "none", 1, 8)
    assert e.value.code == "INVALID_ARGUMENT" or "disagrees" in str(e.value)


def test_a_job_below_min_workers_pauses_until_one_joins():
    shard = _job(lo=2, hi=4, wait_timeout_s=0.4)
    _push(shard, 0, 0, 1.0)
    _push(shard, 1, 0, 1.0)
    shard.evict(1, "test")
    assert shard.paused and shard.stats()["paused"]
    with pytest.raises(ShardError) as e:      # held, then refused with PAUSED: the client retries
        _push(shard, 0, 1, 2.0)
    assert e.value.code == "UNAVAILABLE" and e.value.reason == PAUSED
    done = threading.Event()

    def push_when_resumed():
        _push(shard, 0, 1, 2.0)
        done.set()
    shard.wait_timeout_s = 10.0
    t = threading.Thread(target=push_when_resumed, daemon=True)
    t.start()
    time.sleep(0.3)
    assert not done.is_set()                  # still paused
    _register(shard, 2, lo=2)                 # a new worker joins: the job resumes
    t.join(5)
    assert done.is_set() and not shard.paused
    _push(shard, 2, 1, 4.0)
    assert shard.keys["w#0"].version == 2 and torch.allclose(shard.keys["w#0"].value, torch.full((4,), -4.0))


def test_restored_job_resumes_with_another_worker_count():
    shard = _job(world=4)
    for w in range(4):
        _push(shard, w, 0, float(w))
    _push(shard, 0, 1, 1.0)                   # half a step in the checkpoint
    state = shard.state_dict()
    restored = Shard(0, 1, wait_timeout_s=5.0)
    restored.load_state_dict(state)
    assert restored.job.world_size == 4 and restored.live == {0, 1, 2, 3}
    _register(restored, 0, world=2)           # resumes with 2 workers: 2 and 3 leave
    assert restored.live == {0, 1} and restored.job.world_size == 2
    _register(restored, 1, world=2)
    _push(restored, 0, 1, 1.0)                # a duplicate of the checkpointed push
    _push(restored, 1, 1, 3.0)
    ks = restored.keys["w#0"]
    assert ks.version == 2 and torch.allclose(ks.value, torch.full((4,), -1.5 - 2.0))
    fixed = _job(lo=0, hi=0, world=2)         # not elastic: another world size is refused as before
    with pytest.raises(ShardError, match="world size"):
        fixed.register(0, 3, 1, "bsp", SGD, LAYOUT, "digest", "none", "none")


@pytest.mark.parametrize("sync", ["asp", "ssp:1"])
def test_asp_and_ssp_jobs_take_joiners_and_pause_too(sync):
    shard = Shard(0, 1, wait_timeout_s=0.3)
    for w in range(2):
        shard.register(w, 2, 1, sync, SGD, LAYOUT, "digest", "none", "none", 2, 3)
    shard.init([("w#0", torch.zeros(4))])
    _push(shard, 0, 0, 2.0)                   # applied on arrival, scaled by 1/|live| = 1/2
    assert torch.allclose(shard.keys["w#0"].value, torch.full((4,), -1.0))
    shard.register(2, 2, 1, sync, SGD, LAYOUT, "digest", "none", "none", 2, 3)
    assert shard.live == {0, 1, 2} and shard.worker_step(2) == 0
    _push(shard, 2, 0, 3.0)                   # now 1/3
    assert torch.allclose(shard.keys["w#0"].value, torch.full((4,), -2.0))
    shard.evict(1, "test")
    shard.evict(2, "test")
    assert shard.paused
    with pytest.raises(ShardError) as e:
        _push(shard, 0, 1, 1.0)
    assert e.value.reason == PAUSED
