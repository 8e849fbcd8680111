"""DynamicTable (ps/embedding/dynamic.py) and the store driving it, without sockets: slot reuse after eviction,
the filter's bounded counts, a weights_only checkpoint round trip, the memory cap, asp pushes to evicted rows."""
import io

import pytest
import torch

from deltaps.embedding import TableSpec, init_rows, shard_of
from deltaps.errors import EmbeddingError
from ps.embedding.dynamic import DynamicTable
from ps.embedding.store import EmbeddingStore

TOP = 2**63 - 1


def _step(t, ids, g=1.0):
    """A pull (allocation + gather) and a push of the same ids, as the store runs them."""
    t.allocate(t.missing(ids))
    t.gather(ids)
    held = ids[t.slots(ids) >= 0]
    t.apply(torch.unique(ids), torch.full((torch.unique(ids).numel(), t.spec.dim), g))
    return held


def test_evicted_slots_are_reused_and_state_is_clean():
    t = DynamicTable(TableSpec("d", 0, 2, "adagrad", initial_accumulator=0.5, dynamic=True, ttl_steps=1), 0, 1)
    _step(t, torch.tensor([TOP, 0]))                      # touched at step 0
    _step(t, torch.tensor([5]))                           # after step 1 they were untouched for 2 > 1 steps
    assert t.rows_evicted == 2 and t.rows == 1 and t.used == 3 and len(t.free) == 2
    _step(t, torch.tensor([7, 8]))                        # both freed slots reused; then 5 is evicted
    assert t.used == 3 and len(t.free) == 1 and t.rows == 2 and t.rows_evicted == 3
    t.allocate(t.missing(torch.tensor([TOP])))
    s = t.slots(torch.tensor([TOP]))
    torch.testing.assert_close(t.values[s], init_rows(t.spec, [TOP]))
    assert float(t.state[0][s].max()) == 0.5 and int(t.last[s]) == t.steps


def test_filter_counts_are_bounded():
    t = DynamicTable(TableSpec("d", 0, 2, dynamic=True, min_count=2), 0, 1)
    t.max_pending = 100
    for k in range(10):
        t.gather(torch.arange(k * 50, (k + 1) * 50))      # 500 ids seen once, never admitted
        t.apply(torch.empty(0, dtype=torch.int64), torch.empty(0, 2))
    assert t.rows == 0 and len(t.pend_ids) <= 100
    assert bool((torch.from_numpy(t.pend_ids) >= 400).all())     # the most recently seen are kept
    assert t.missing(torch.tensor([499, 3])).tolist() == [499]   # 3 was forgotten: counts from 0 again


def test_state_dict_round_trip_weights_only():
    spec = TableSpec("d", 0, 3, "adam", dynamic=True, ttl_steps=3, min_count=2, seed=2)
    ids = torch.randint(0, TOP, (400,), generator=torch.Generator().manual_seed(0))
    a = DynamicTable(spec, 1, 2)
    mine = ids[shard_of(ids, 2, True) == 1]
    for k in range(6):
        _step(a, mine[k * 20:k * 20 + 60])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = DynamicTable.from_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), 1, 2)
    for t in (a, b):
        _step(t, mine[100:140])
    sa, sb = a.state_dict(), b.state_dict()
    for k in ("ids", "values", "last"):
        assert torch.equal(sa[k], sb[k]), k
    assert all(torch.equal(x, y) for x, y in zip(sa["pending"] + sa["state"], sb["pending"] + sb["state"]))
    assert (a.steps, a.opt_steps, a.rows_evicted, a.filtered_pushes) == (b.steps, b.opt_steps, b.rows_evicted,
                                                                         b.filtered_pushes)
    with pytest.raises(EmbeddingError, match="not owned"):
        DynamicTable.from_state_dict(a.state_dict(), 0, 2)


def test_store_memory_cap_and_asp_push_to_an_evicted_row():
    spec = TableSpec("d", 0, 4, "sgd", lr=1.0, dynamic=True, ttl_steps=1)
    store = EmbeddingStore(0, 1, memory_cap_bytes=10 * spec.bytes_per_row)
    store.register(0, 1, 1, "asp", [spec])
    store.pull(0, [("d", torch.arange(8))], 0)
    with pytest.raises(EmbeddingError) as e:
        store.pull(0, [("d", torch.arange(100, 104))], 0)
    assert e.value.code == "RESOURCE_EXHAUSTED"
    for step in range(3):                                  # asp: every push is a table step; rows 0..7 age out
        store.push(0, step, [("d", torch.tensor([0]), torch.ones(1, 4))])
    t = store.table("d")
    assert t.rows == 1 and t.rows_evicted == 7
    store.push(0, 3, [("d", torch.tensor([5]), torch.ones(1, 4))])   # evicted since its pull: dropped, counted
    assert t.filtered_pushes == 1 and t.rows == 0 and t.rows_evicted == 8   # row 0 aged out too
    store.pull(0, [("d", torch.arange(100, 110))], 0)     # evicted rows are room under the cap again
    assert store.stats()["tables"]["d"]["rows_held"] == 10 and store.nbytes == 10 * spec.bytes_per_row


def test_a_wide_tables_first_growth_holds_about_a_mebibyte_not_a_thousand_rows():
    # one 64k-wide adagrad row is 512 KiB: 1,024 of them (the old first growth) were 512 MiB for a single id
    wide = DynamicTable(TableSpec("w", 0, 1 << 16, "adagrad", dynamic=True), 0, 1)
    wide.allocate(torch.tensor([42]))
    assert wide.capacity == 2 and wide.rows == 1
    narrow = DynamicTable(TableSpec("n", 0, 8, "adagrad", dynamic=True), 0, 1)
    narrow.allocate(torch.tensor([42]))
    assert narrow.capacity == 1024          # small rows: as before
