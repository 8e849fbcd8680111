"""Dynamic embedding tables (ps/embedding/dynamic.py) over real loopback gRPC shards: raw 64-bit ids hashed to
shards and allocated on first touch, TTL eviction with flat memory, the frequency filter, bad ids refused,
per-table metrics, and a shard crash restored from its checkpoint (rows, values, eviction and filter state)."""
import time

import pytest
import torch
from test_embedding_durability import _Shards

from deltaps.embedding import TableSpec, init_rows, shard_of
from deltaps.errors import PSError
from ps.metrics import ServerMetrics
from worker.embedding import EmbeddingClient

TOP = 2**63 - 1


def _client(cluster_or_addrs, spec, rank=0, world=1, **kw):
    addrs = getattr(cluster_or_addrs, "addrs", cluster_or_addrs)
    c = EmbeddingClient(addrs, rank, world, [spec], timeout_s=20, **kw)
    c.register()
    return c


def _held(shard, table="d") -> set[int]:
    return {int(i) for i in shard.embedding.table(table).state_dict()["ids"]}


def test_64bit_ids_at_the_extremes_are_allocated_on_first_touch_on_their_hashed_shard(cluster_factory):
    spec = TableSpec("d", 0, 8, "sgd", lr=1.0, dynamic=True, seed=7)
    cluster = cluster_factory(3)
    c = _client(cluster, spec)
    rnd = torch.randint(0, TOP, (61,), generator=torch.Generator().manual_seed(1))
    ids = torch.unique(torch.cat([torch.tensor([0, 1, 2, TOP - 1, TOP, 2**32, 2**62]), rnd]))
    vals, _ = c.pull_rows({"d": ids})
    torch.testing.assert_close(vals["d"], init_rows(spec, ids.numpy()))       # deterministic init of the raw id
    owner = shard_of(ids, 3, dynamic=True)
    for s, sh in enumerate(cluster.shards):                                    # routed to, and held by, the owner
        assert _held(sh) == {int(i) for i in ids[owner == s]}
    grad = torch.ones(ids.numel(), 8)
    c.push_rows(0, {"d": (ids, grad)})
    after, _ = c.pull_rows({"d": ids}, min_version=1)
    torch.testing.assert_close(after["d"], vals["d"] - 1.0)
    stats = c.server_stats()
    assert sum(s["tables"]["d"]["rows_held"] for s in stats) == ids.numel()
    assert all(s["tables"]["d"]["dynamic"] and s["tables"]["d"]["rows_owned"] is None for s in stats)
    c.close()


def test_the_hash_spreads_adjacent_and_strided_ids_and_the_client_routes_by_it(cluster_factory):
    n = 4
    for ids in (torch.arange(20_000), torch.arange(0, 80_000, 4), torch.arange(TOP - 20_000, TOP)):
        counts = torch.bincount(shard_of(ids, n, dynamic=True), minlength=n)
        assert counts.min() > 0.9 * ids.numel() / n, counts                     # id % 4 would put stride 4 on one
    assert torch.equal(shard_of(torch.arange(10), n), torch.arange(10) % n)     # fixed tables: unchanged
    cluster = cluster_factory(n)
    c = _client(cluster, TableSpec("d", 0, 2, dynamic=True))
    ids = torch.arange(0, 400, 4)
    c.pull_rows({"d": ids})
    held = [s["tables"]["d"]["rows_held"] for s in c.server_stats()]
    assert held == torch.bincount(shard_of(ids, n, dynamic=True), minlength=n).tolist() and min(held) > 10
    c.close()


def test_ttl_evicts_rows_and_memory_stays_flat_over_a_drifting_id_stream(cluster_factory):
    """800 new ids per step, ttl 2: rows touched in the last 3 steps are held, older ones evicted and their
    slots reused; capacity stops growing; an evicted row comes back from its init value; metrics count it."""
    spec = TableSpec("d", 0, 8, "adagrad", lr=0.1, dynamic=True, ttl_steps=2, seed=3)
    cluster = cluster_factory(2)
    c = _client(cluster, spec)
    per_step, steps, caps = 800, 16, []
    for step in range(steps):
        ids = torch.arange(step * per_step, (step + 1) * per_step) * 1_000_003 + 2**40     # never seen before
        c.pull_rows({"d": ids}, min_version=step)
        c.push_rows(step, {"d": (ids, torch.ones(per_step, 8))})
        stats = c.server_stats()
        caps.append(sum(s["tables"]["d"]["capacity"] for s in stats))
        live = sum(s["tables"]["d"]["rows_held"] for s in stats)
        assert live <= 3 * per_step, (step, live)
    evicted = sum(s["tables"]["d"]["rows_evicted"] for s in stats)
    assert live + evicted == steps * per_step and evicted >= (steps - 3) * per_step
    assert caps[-1] == caps[5] and caps[-1] * spec.bytes_per_row < 4 * 3 * per_step * spec.bytes_per_row
    assert sum(s["bytes"] for s in stats) == live * spec.bytes_per_row
    first = torch.arange(0, 4) * 1_000_003 + 2**40                                   # evicted at step 2
    vals, _ = c.pull_rows({"d": first}, min_version=steps)
    torch.testing.assert_close(vals["d"], init_rows(spec, first.numpy()))          # a new row again
    for sh, st in zip(cluster.shards, stats):
        m = ServerMetrics(sh, process=False)
        lab = {"shard": str(sh.shard_id), "table": "d"}
        assert m.registry.get_sample_value("deltaps_server_embedding_rows_evicted_total", lab) == \
            st["tables"]["d"]["rows_evicted"] > 0
        assert m.registry.get_sample_value("deltaps_server_embedding_rows", lab) == \
            sh.embedding.table("d").rows
    c.close()


def test_frequency_filter_admits_a_row_on_its_min_count_th_pull(cluster_factory):
    """min_count 3: pulls 1 and 2 serve the init value and their gradients are dropped (counted); the third
    pull allocates the row at its init value (no jump) and its gradient applies."""
    spec = TableSpec("d", 0, 4, "sgd", lr=1.0, dynamic=True, min_count=3, seed=5)
    cluster = cluster_factory(2)
    c = _client(cluster, spec)
    x, y = torch.tensor([TOP]), torch.tensor([12345])
    init = init_rows(spec, [TOP])
    for step in range(3):
        v, _ = c.pull_rows({"d": x}, min_version=step)
        torch.testing.assert_close(v["d"], init)
        held = sum(s["tables"]["d"]["rows_held"] for s in c.server_stats())
        assert held == (1 if step == 2 else 0), step
        c.push_rows(step, {"d": (x, torch.ones(1, 4))})
    v, _ = c.pull_rows({"d": torch.cat([x, y])}, min_version=3)
    torch.testing.assert_close(v["d"][0], init[0] - 1.0)                         # only the third push applied
    tabs = [s["tables"]["d"] for s in c.server_stats()]
    assert sum(t["filtered_pushes"] for t in tabs) == 2 and sum(t["filtered_pulls"] for t in tabs) == 3
    assert sum(t["pending_ids"] for t in tabs) == 1                              # y: seen once
    sh = cluster.shards[int(shard_of(x, 2, dynamic=True))]
    m = ServerMetrics(sh, process=False)
    assert m.registry.get_sample_value("deltaps_server_embedding_filtered_pushes_total",
                                       {"shard": str(sh.shard_id), "table": "d"}) == 2
    c.close()


def test_an_evaluation_s_peek_makes_touches_and_counts_nothing(cluster_factory):
    """A peek (PSEmbedding in eval mode) reads held rows and the init value of the others; it makes no row,
    refreshes no TTL and adds no sighting to the frequency filter — on dynamic and fixed tables alike."""
    dyn = TableSpec("d", 0, 4, "sgd", lr=1.0, dynamic=True, ttl_steps=1, min_count=2, seed=3)
    fixed = TableSpec("f", 1000, 4, "sgd", lr=1.0, seed=3)
    cluster = cluster_factory(2)
    c = EmbeddingClient(cluster.addrs, 0, 1, [dyn, fixed], timeout_s=20)
    c.register()
    held, new = torch.tensor([7, 2**40]), torch.tensor([TOP, 99])
    for step in range(2):                                       # two sightings: held admitted and trained
        c.pull_rows({"d": held, "f": held % 1000}, min_version=step)
        c.push_rows(step, {"d": (held, torch.ones(2, 4)), "f": (held % 1000, torch.ones(2, 4))})
    before = c.server_stats()
    v, _ = c.pull_rows({"d": torch.cat([held, new]), "f": torch.cat([held, new]) % 1000}, min_version=2, peek=True)
    torch.testing.assert_close(v["d"][:2], init_rows(dyn, held.numpy()) - 1.0)    # the second push applied
    torch.testing.assert_close(v["d"][2:], init_rows(dyn, new.numpy()))
    torch.testing.assert_close(v["f"][2:], init_rows(fixed, (new % 1000).numpy()))
    after = c.server_stats()
    for table in ("d", "f"):
        assert [s["tables"][table]["rows_held"] for s in after] == [s["tables"][table]["rows_held"] for s in before]
    assert sum(s["tables"]["d"]["pending_ids"] for s in after) == 0          # new ids were not counted
    assert sum(s["peeks"] for s in after) == 2
    for step in range(2, 4):                                    # the peek did not refresh the TTL: held expire
        c.push_rows(step, {})
    assert sum(s["tables"]["d"]["rows_held"] for s in c.server_stats()) == 0
    c.close()


def test_bad_ids_and_bad_specs_are_refused_clearly(cluster_factory):
    spec = TableSpec("clicks", 0, 4, dynamic=True)
    cluster = cluster_factory(2)
    c = _client(cluster, spec)
    nan_cast = torch.tensor([float("nan")]).to(torch.int64)
    for bad, words in ((torch.tensor([3, -5]), ["-5"]), (torch.tensor([-(2**63)]), ["NaN"]), (nan_cast, [])):
        if int(bad.min()) >= 0:
            continue                                                             # NaN casts to 0 on some CPUs
        with pytest.raises(PSError) as e:
            c.pull_rows({"clicks": bad})
        msg = str(e.value)
        assert e.value.code.name == "INVALID_ARGUMENT", msg
        assert "table clicks" in msg and "negative row id" in msg and all(w in msg for w in words), msg
        with pytest.raises(PSError) as e:
            c.push_rows(0, {"clicks": (bad, torch.ones(bad.numel(), 4))})
        assert e.value.code.name == "INVALID_ARGUMENT" and "negative row id" in str(e.value)
    c.close()
    for bad_spec, words in ((TableSpec("x", 10, 4, dynamic=True), "no row count"),
                            (TableSpec("y", 10, 4, ttl_steps=5), "dynamic tables only"),
                            (TableSpec("z", 0, 4, dynamic=True, min_count=-1), "must be >= 0")):
        other = EmbeddingClient(cluster.addrs, 0, 1, [bad_spec], timeout_s=10)
        with pytest.raises(PSError) as e:
            other.register()
        assert e.value.code.name == "INVALID_ARGUMENT" and words in str(e.value), str(e.value)
        other.close()


# ---- crash and restore ---------------------------------------------------------------------------
SPEC = TableSpec("d", 0, 4, "adam", lr=0.05, eps=1e-8, dynamic=True, ttl_steps=2, min_count=2, seed=11)
POOL = torch.randint(0, TOP, (160,), generator=torch.Generator().manual_seed(4))


def _ids(step, rank):
    """A drifting window of 64-bit ids: old ones age out (TTL), new ones must be seen twice (filter)."""
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.unique(POOL[step * 10 + torch.randint(0, 40, (16,), generator=g)])


def _train(tmp, steps, hooks=None):
    """2 workers, bsp: both pull their step's ids, then both push; returns the shards' tables at the end."""
    hooks = hooks or {}
    sh = _Shards(tmp)
    cls = [_client(sh.addrs, SPEC, r, 2, reconnect_deadline_s=20) for r in range(2)]
    for step in range(steps):
        if step in hooks:
            hooks[step](sh)
        grads = []
        for r, c in enumerate(cls):
            ids = _ids(step, r)
            v, _ = c.pull_rows({"d": ids}, min_version=step)
            grads.append((ids, v["d"] * 0.5 + 0.1 * (r + 1)))
        for c, (ids, g) in zip(cls, grads):
            c.push_rows(step, {"d": (ids, g)})
    final, _ = cls[0].pull_rows({"d": POOL}, min_version=steps)
    tables = [s.embedding.table("d") for s in sh.shards]
    for c in cls:
        c.close()
    sh.stop()
    return final["d"], tables, cls


def _same(a: dict, b: dict):
    for k in ("ids", "values", "last", "steps", "opt_steps", "rows_evicted"):
        assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k
    assert all(torch.equal(x, y) for x, y in zip(a["state"], b["state"]))
    assert all(torch.equal(x, y) for x, y in zip(a["pending"], b["pending"]))


def _wait_version(shard, version, timeout=20.0):
    t0 = time.monotonic()
    while shard.embedding.version < version and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return shard.embedding.version


def test_dynamic_rows_survive_a_shard_crash_and_restore_exactly(tmp_path):
    """Checkpoint both shards before step 4; steps 4 and 5 run; shard 0 crashes and comes back from the
    checkpoint: its rows, values, optimizer state, last touches and the filter's counts are the checkpoint's;
    the workers' sessions replay steps 4 and 5 and the run ends bit-identical to one without the crash."""
    ref, ref_tables, _ = _train(tmp_path / "ref", 9)
    seen = {}

    def at4(sh):
        sh.cks[0].checkpoint("test")
        seen["ckpt"] = sh.shards[0].embedding.table("d").state_dict()

    def at6(sh):
        sh.crash(0)
        shard = sh.restored(0)
        seen["restored"] = shard.embedding.table("d").state_dict()     # read before it serves (and replays)
        sh.start(0, shard)
        seen["version"] = _wait_version(sh.shards[0], 6)                # replayed by the sessions
    got, tables, cls = _train(tmp_path / "crash", 9, {4: at4, 6: at6})
    ck = seen["ckpt"]
    assert ck["ids"].numel() > 0 and ck["rows_evicted"] > 0 and ck["pending"][0].numel() > 0
    _same(seen["restored"], ck)
    assert seen["version"] == 6 and cls[0].sessions[0].restarts == 1
    assert torch.equal(got, ref)
    for a, b in zip(tables, ref_tables):
        _same(a.state_dict(), b.state_dict())
