"""The click-through workload's drifting id stream (--id-drift / --drift-every) and its table rules: ids renewed
at the asked rate, every id inside the fixed table sized for the run, the test set following the current ids,
and dynamic tables / TTL / frequency filter accepted only where they mean something."""
import numpy as np
import pytest

from worker.trainers.strategy import load_job
from worker.workloads import get_workload
from worker.workloads.ctr import CTRData, table_spec

BASE = dict(workload="ctr", mode="hybrid", embedding_rows=8000, embedding_dim=4, embedding_fields=4, steps=600,
            batch_size=512, hidden=8)


def test_without_drift_the_ids_are_the_same_throughout():
    d = CTRData(8000, 4, seed=3)
    assert d.generations == 1 and d.table_rows == 8000 and d.epoch_of(10**6) == 0
    ids = d.batch(0, 5, 512)[0]
    assert int(ids.max()) < 8000
    assert (ids // 2000 == np.arange(4)).all()                       # field f draws from its own range
    assert d.test_set(0) is d.test_set(0)


@pytest.mark.parametrize("drift", [0.1, 0.5, 1.0])
def test_each_epoch_renews_the_asked_share_of_every_field_s_ids(drift):
    d = CTRData(8000, 4, seed=0, drift=drift, drift_every=50, steps=600)
    slots = np.arange(d.per_field)
    gen = [np.floor(e * drift + d.phase[slots]) for e in range(12)]
    for e in range(11):
        renewed = (gen[e + 1] != gen[e]).mean()
        assert renewed == pytest.approx(drift, abs=2 / d.per_field), (e, renewed)
    seen = np.concatenate([d.batch(r, s, 512)[0].numpy().ravel() for r in range(2) for s in range(0, 600, 25)])
    assert seen.max() < d.table_rows and d.table_rows == 8000 * d.generations
    assert len(np.unique(seen)) > 2 * len(np.unique(d.batch(0, 0, 512)[0]))   # new ids keep coming


def test_epoch_ids_differ_and_the_test_set_follows_the_current_epoch():
    d = CTRData(8000, 4, seed=0, drift=0.5, drift_every=50, steps=600)
    first, late = set(d.test_set(0)[0].numpy().ravel()), set(d.test_set(11)[0].numpy().ravel())
    assert len(first & late) < 0.3 * len(late)
    assert d.epoch_of(49) == 0 and d.epoch_of(50) == 1
    w = get_workload(load_job(None, {**BASE, "id_drift": 0.5, "drift_every": 50}))
    batches = w.batches(0, 1)
    for _ in range(120):
        next(batches)
    assert w.step == 119 and w.data.epoch_of(w.step) == 2


def test_the_table_is_fixed_for_every_id_or_dynamic():
    fixed = table_spec(load_job(None, {**BASE, "id_drift": 0.5, "drift_every": 50}))
    assert not fixed.dynamic and fixed.num_rows == 8000 * CTRData(8000, 4, drift=0.5, drift_every=50, steps=600).generations
    dyn = table_spec(load_job(None, {**BASE, "embedding_dynamic": True, "embedding_ttl_steps": 100,
                                     "embedding_min_count": 2}))
    assert dyn.dynamic and dyn.num_rows == 0 and (dyn.ttl_steps, dyn.min_count) == (100, 2)


@pytest.mark.parametrize("over, match", [
    (dict(id_drift=1.5), "--id-drift must be in"),
    (dict(id_drift=0.5, drift_every=0), "--drift-every"),
    (dict(embedding_ttl_steps=10), "apply to dynamic tables"),
    (dict(embedding_dynamic=True, mode="allreduce"), "lives on the shards"),
    (dict(embedding_dynamic=True, mode="torchrec"), "lives on the shards"),
    (dict(worker_memory_limit="100MiB"), "below 256MiB"),
    (dict(worker_memory_limit="lots"), "bad byte size"),
])
def test_rules_name_the_problem(over, match):
    with pytest.raises(ValueError, match=match):
        load_job(None, {**BASE, **over})
