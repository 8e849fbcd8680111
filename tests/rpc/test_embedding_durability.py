"""Embedding tables are durable and covered by eviction: store state round trip, checkpoint/restore of a shard
mid-step (a half-aggregated bsp step survives, lost steps are replayed exactly once), the Checkpointer sees
embedding-only progress, a silent worker is evicted and rejoins (ps/embedding/, worker/embedding/session.py)."""
import io
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import run_threads
from helpers import client, named

from deltaps.embedding import TableSpec
from deltaps.errors import EmbeddingError
from deltaps.optimizer_config import OptimizerConfig
from deltaps.tools.launch import free_port
from ps.durability import Checkpointer, restore_latest, snapshot
from ps.embedding import EmbeddingStore, attach, store_of
from ps.server import start_server
from ps.shard import Shard
from worker.embedding import EmbeddingClient

ROWS, DIM = 300, 8


def _batch(step, rank, n=30):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, ROWS, (n,), generator=g), torch.randn(n, DIM, generator=g)


def _store_rows(store: EmbeddingStore) -> dict:
    """{table: {global row id: (value, optimizer state...)}}: independent of slot order."""
    out = {}
    for name, t in store.tables.items():
        sd = t.state_dict()
        out[name] = {int(i): (sd["values"][k], *[s[k] for s in sd["state"]]) for k, i in enumerate(sd["ids"])}
    return out


def _assert_same_store(a: EmbeddingStore, b: EmbeddingStore):
    ra, rb = _store_rows(a), _store_rows(b)
    assert ra.keys() == rb.keys()
    for name in ra:
        assert ra[name].keys() == rb[name].keys(), name
        for i in ra[name]:
            assert all(torch.equal(x, y) for x, y in zip(ra[name][i], rb[name][i])), (name, i)
    assert {n: t.opt_steps for n, t in a.tables.items()} == {n: t.opt_steps for n, t in b.tables.items()}
    assert (a.version, a.pushed, a.live, a.world_size, a.sync) == (b.version, b.pushed, b.live, b.world_size, b.sync)
    assert a._agg.keys() == b._agg.keys()
    assert a.counters == b.counters


def _push_direct(store, worker, step, specs):
    """One worker's step against a store directly: pull its rows of the batch, push their gradients."""
    ids, up = _batch(step, worker)
    mine = ids % store.num_shards == store.shard_id
    uniq, inv = torch.unique(ids[mine], return_inverse=True)
    vals, _, _ = store.pull(worker, [(s.name, uniq) for s in specs], step)
    grads = []
    for s, v in zip(specs, vals):
        local = v.clone().requires_grad_()
        (F.embedding(inv, local) * up[mine]).sum().backward()
        grads.append((s.name, uniq, local.grad))
    return store.push(worker, step, grads)


def test_store_state_dict_round_trip_mid_step():
    """Rows (values + which ids are held), optimizer state, per-table step counter, version, pushed table,
    live set, a half-aggregated bsp step and counters survive torch.save / torch.load(weights_only=True);
    the restored store then computes exactly what the original does."""
    specs = [TableSpec("a", ROWS, DIM, "adam", lr=0.05, eps=1e-8, seed=1),
             TableSpec("g", ROWS, DIM, "adagrad", lr=0.1, initial_accumulator=0.1, seed=2),
             TableSpec("s", ROWS, DIM, "sgd", lr=0.5, seed=3)]
    store = EmbeddingStore(1, 2, memory_cap_bytes=1 << 30)
    for w in range(2):
        store.register(w, 2, 2, "bsp", specs)
    for step in range(3):
        for w in range(2):
            _push_direct(store, w, step, specs)
    assert _push_direct(store, 0, 3, specs) == (False, 3)          # worker 1 has not pushed step 3
    buf = io.BytesIO()
    torch.save(store.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    back = EmbeddingStore(1, 2, memory_cap_bytes=1 << 30)
    back.load_state_dict(state)
    _assert_same_store(store, back)
    assert back._agg.keys() == {0} and back.version == 3 and back.pushed == {0: 4, 1: 3}
    assert back.tables["a"].opt_steps == 3 and back.tables["a"].rows > 0
    for s in (store, back):                                        # worker 1 completes step 3 on both
        assert _push_direct(s, 1, 3, specs) == (False, 4)
        assert s.push(0, 3, [])[0]                                 # a retry is acknowledged, not applied
    _assert_same_store(store, back)
    with pytest.raises(ValueError, match="shard 1/2"):
        EmbeddingStore(0, 2).load_state_dict(state)


def test_restored_store_over_its_cap_serves_held_rows_and_refuses_new_ones():
    spec = TableSpec("t", 1000, 16, "adagrad", seed=4)
    store = EmbeddingStore(0, 1)
    store.register(0, 1, 1, "bsp", [spec])
    store.pull(0, [("t", torch.arange(100))], 0)
    shard = Shard(0, 1)
    attach(shard, 50 * spec.bytes_per_row)                         # the new command line's cap: half of it
    store_of(shard).load_state_dict(store.state_dict())
    small = shard.embedding
    assert small.memory_cap_bytes == 50 * spec.bytes_per_row and small.nbytes == 100 * spec.bytes_per_row
    vals, _, _ = small.pull(0, [("t", torch.arange(100))], 0)     # rows it holds: served
    torch.testing.assert_close(vals[0], store.pull(0, [("t", torch.arange(100))], 0)[0][0])
    with pytest.raises(EmbeddingError) as e:                       # a new row: refused, nothing crashes
        small.pull(0, [("t", torch.tensor([500]))], 0)
    assert e.value.code == "RESOURCE_EXHAUSTED" and "memory cap" in str(e.value)


class _Shards:
    """Two in-process shards on fixed ports, checkpointing into tmp; shard i can crash and come back restored."""

    def __init__(self, tmp, cap=0):
        self.tmp, self.cap = tmp, cap
        self.ports = [free_port(), free_port()]
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.shards, self.servers, self.cks = [None, None], [None, None], [None, None]
        for i in range(2):
            self.start(i, Shard(i, 2))

    def start(self, i, shard):
        if self.cap:
            attach(shard, self.cap)
        self.shards[i] = shard
        self.cks[i] = Checkpointer(shard, str(self.tmp / f"s{i}"))
        self.servers[i], _ = start_server(shard, "127.0.0.1", self.ports[i])

    def checkpoint(self):
        return [ck.checkpoint("test") for ck in self.cks]

    def crash(self, i):
        self.servers[i].stop(grace=None).wait()

    def restored(self, i):
        """Shard i as its latest checkpoint left it, not serving yet."""
        shard = Shard(i, 2)
        if self.cap:
            attach(shard, self.cap)
        assert restore_latest(shard, str(self.tmp / f"s{i}")) is not None
        return shard

    def restart(self, i):
        shard = self.restored(i)
        self.start(i, shard)
        return shard

    def stop(self):
        for s in self.servers:
            s.stop(grace=None)


def _train(addrs, steps, hooks=None):
    """2 workers (threads), bsp, an Adam table on 2 shards; hooks[step](clients) runs before that step's work,
    hooks[(step, 'mid')] after worker 0's part of the step and before worker 1's, hooks[(step, 'pulled')]
    between worker 0's pull and its push (then worker 1's part)."""
    hooks = hooks or {}
    spec = TableSpec("t", ROWS, DIM, "adam", lr=0.05, eps=1e-8, seed=9)
    cls = [EmbeddingClient(addrs, r, 2, [spec], timeout_s=20, reconnect_deadline_s=20) for r in range(2)]
    for c in cls:
        c.register()

    def work(r, step, between=None):
        ids, up = _batch(step, r)
        uniq, inv = torch.unique(ids, return_inverse=True)
        vals, _ = cls[r].pull_rows({"t": uniq}, min_version=step)
        local = vals["t"].requires_grad_()
        (F.embedding(inv, local) * up).sum().backward()
        if between:
            between(cls)
        cls[r].push_rows(step, {"t": (uniq, local.grad)})
    for step in range(steps):
        if step in hooks:
            hooks[step](cls)
        if (step, "pulled") in hooks:
            work(0, step, hooks[(step, "pulled")])
            work(1, step)
        elif (step, "mid") in hooks:
            work(0, step)
            hooks[(step, "mid")](cls)
            work(1, step)
        else:
            run_threads([lambda r=r: work(r, step) for r in range(2)])
    final, _ = cls[0].pull_rows({"t": torch.arange(ROWS)}, min_version=steps)
    for c in cls:
        c.close()
    return final["t"], cls


def _reference(tmp):
    """The same 8-step job without a crash: the rows every crash test must end with."""
    shards = _Shards(tmp / "ref")
    ref, _ = _train(shards.addrs, 8)
    shards.stop()
    return ref


def _wait_version(store, version, timeout=20.0):
    t0 = time.monotonic()
    while store.version < version and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return store.version


def test_shard_restart_mid_step_keeps_the_half_aggregated_step_and_replays_the_rest(tmp_path):
    """Checkpoint both shards while bsp step 3 is half aggregated (worker 0 pushed, worker 1 not); steps 3
    and 4 then complete; shard 0 crashes and comes back from that checkpoint: it holds worker 0's half of
    step 3, the workers' sessions replay what it lost, and every row ends bit-identical to a run without
    the crash."""
    ref = _reference(tmp_path)
    sh = _Shards(tmp_path / "crash")
    seen = {}

    def mid3(cls):
        seen["ckpt"] = sh.checkpoint()

    def at5(cls):
        sh.crash(0)
        time.sleep(0.2)
        restored = sh.restart(0).embedding
        seen["restored"] = (restored.version, set(restored._agg), dict(restored.pushed))
        # no worker calls the shard now (as a hybrid rank inside the dense allreduce would not): the
        # sessions notice the lost connection themselves, re-register and replay steps 3 and 4
        seen["replayed_in_background"] = _wait_version(restored, 5)
    got, cls = _train(sh.addrs, 8, {(3, "mid"): mid3, 5: at5})
    assert seen["restored"] == (3, {0}, {0: 4, 1: 3})              # worker 0's half of step 3 survived
    assert seen["replayed_in_background"] == 5
    assert torch.equal(got, ref)                                   # nothing lost, nothing applied twice
    store = sh.shards[0].embedding
    assert store.version == 8
    assert all(c.sessions[0].restarts == 1 for c in cls)
    # durable_step trimmed the replay buffers to what the checkpoint lacks: worker 0 re-sent step 4,
    # worker 1 steps 3 and 4 (its half of step 3 completes the restored half-aggregated step)
    assert [c.sessions[0].replayed for c in cls] == [1, 2]
    assert all(c.sessions[1].restarts == 0 for c in cls)
    assert sh.shards[1].embedding.version == 8
    sh.stop()


def test_rows_pulled_before_a_restart_can_be_pushed_after_it(tmp_path):
    """Worker 0 pulls step 5's rows (some first seen at step 5), shard 0 crashes and comes back from a step-2
    checkpoint, the sessions replay steps 2-4 in the background; worker 0 then pushes step 5 to the restored
    shard, which never held those rows: it allocates them (the push is flagged replay, as the pull was served
    by the previous incarnation) and the run ends bit-identical to one without the crash."""
    ref = _reference(tmp_path)
    sh = _Shards(tmp_path / "crash")
    seen = {}

    def at2(cls):
        sh.checkpoint()

    def between(cls):
        sh.crash(0)
        time.sleep(0.2)
        restored = sh.restart(0).embedding
        seen["held"] = {int(i) for i in _batch(5, 0)[0].unique() if restored.table("t").slots(i.view(1))[0] >= 0}
        seen["replayed"] = _wait_version(restored, 5)              # replayed by the sessions' watch
        seen["allocated_before_push"] = restored.counters["rows_allocated_by_replay"]
    got, cls = _train(sh.addrs, 8, {2: at2, (5, "pulled"): between})
    assert seen["replayed"] == 5
    assert len(seen["held"]) < _batch(5, 0)[0].unique().numel()   # some of step 5's rows were new to it
    assert sh.shards[0].embedding.counters["rows_allocated_by_replay"] > seen["allocated_before_push"]
    assert torch.equal(got, ref)
    sh.stop()


def test_checkpointer_sees_embedding_only_progress(tmp_path):
    """An embedding-only shard (no dense job) checkpoints by steps and by time after embedding pushes, and
    reports durable steps that account for them."""
    shard = Shard(0, 1)
    server, port = start_server(shard, "127.0.0.1", 0)
    by_steps = Checkpointer(shard, str(tmp_path / "a"), every_steps=2)
    by_time = Checkpointer(shard, str(tmp_path / "b"), every_s=0.05)
    assert by_steps.due() is None and by_time.checkpoint() is None   # nothing registered yet
    spec = TableSpec("t", 50, 4, "sgd", lr=1.0)
    c = EmbeddingClient([f"127.0.0.1:{port}"], 0, 1, [spec], timeout_s=10)
    c.register()
    ids = torch.tensor([1, 2])
    for step in range(2):
        c.pull_rows({"t": ids}, min_version=step)
        c.push_rows(step, {"t": (ids, torch.ones(2, 4))})
    assert by_steps.due() == "step 2"
    time.sleep(0.06)
    assert by_time.due() and by_time.checkpoint()
    time.sleep(0.06)
    assert by_time.due() is None                                   # nothing changed since
    c.pull_rows({"t": ids}, min_version=2)
    rep = c.push_rows_async(2, {"t": (ids, torch.ones(2, 4))})[0].result()
    assert rep.durable_step == 2                                   # steps 0, 1 are in the checkpoint
    time.sleep(0.06)
    assert by_time.due()                                           # an embedding push is a change
    state = snapshot(shard)
    assert state["embedding"]["version"] == 3 and state["job"] is None
    c.close()
    server.stop(grace=None)


def test_silent_worker_is_evicted_step_completes_with_the_others_then_it_rejoins(cluster_factory):
    c = cluster_factory(2, worker_timeout_s=1.0)
    spec = TableSpec("t", 20, 2, "sgd", lr=1.0, init="zeros")
    a, b = (EmbeddingClient(c.addrs, r, 2, [spec], timeout_s=20) for r in range(2))
    a.register()
    b.register()
    ids = torch.tensor([0, 1])                                     # one row on each shard
    for cl in (a, b):
        cl.pull_rows({"t": ids})
    run_threads([lambda cl=cl: cl.push_rows(0, {"t": (ids, torch.ones(2, 2))}) for cl in (a, b)])
    t0 = time.monotonic()                                          # worker 1's last word: its silence runs from here
    a.pull_rows({"t": ids}, min_version=1)
    a.push_rows(1, {"t": (ids, 2 * torch.ones(2, 2))})             # worker 1 goes silent: step 1 waits on it
    got, _ = a.pull_rows({"t": ids}, min_version=2)                # ... until it is evicted
    waited = time.monotonic() - t0
    assert 0.8 < waited < 1.0 + 1.5, waited
    torch.testing.assert_close(got["t"], torch.full((2, 2), -3.0))   # step 0: mean 1; step 1: worker 0's 2
    stores = [sh.embedding for sh in c.shards]
    assert all(s.live == {0} and s.counters["evictions"] == 1 for s in stores)
    reps = [f.result() for f in b.push_rows_async(1, {"t": (ids, torch.ones(2, 2))})]   # back: rejoins
    assert all(r.duplicate for r in reps)                          # step 1 was applied without it
    assert all(s.live == {0, 1} and s.counters["rejoins"] == 1 and s.pushed[1] == 2 for s in stores)
    for cl in (a, b):
        cl.pull_rows({"t": ids}, min_version=2)
    run_threads([lambda cl=cl, g=g: cl.push_rows(2, {"t": (ids, g * torch.ones(2, 2))})
                 for cl, g in ((a, 1.0), (b, 3.0))])
    got, _ = b.pull_rows({"t": ids}, min_version=3)
    torch.testing.assert_close(got["t"], torch.full((2, 2), -5.0))   # its pushes count again: mean(1, 3)
    a.close()
    b.close()


def test_dense_membership_evicts_and_readmits_the_embedding_tables_too(cluster_factory):
    c = cluster_factory(1)
    shard = c.shards[0]
    params = named(3)
    a, b = (client(c.addrs, r, 2, opt=OptimizerConfig("sgd", lr=1.0)) for r in range(2))
    a.setup(params)
    b.setup(params)
    spec = TableSpec("t", 20, 2, "sgd", lr=1.0, init="zeros")
    embs = [EmbeddingClient(c.addrs, r, 2, [spec], timeout_s=10) for r in range(2)]
    for e in embs:
        e.register()
    assert shard.evict(1, "test")
    assert shard.live == {0} and shard.embedding.live == {0}
    b2 = client(c.addrs, 1, 2, opt=OptimizerConfig("sgd", lr=1.0))   # worker 1 comes back: a dense Register
    b2.setup(params)
    assert shard.live == {0, 1} and shard.embedding.live == {0, 1} and shard.embedding.counters["rejoins"] == 1
    for cl in (a, b, b2, *embs):
        cl.close()
