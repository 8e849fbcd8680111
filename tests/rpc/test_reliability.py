"""Failure semantics in one process: checkpoints, restore, replay after a shard crash, eviction, rejoin,
idempotent retries in every sync mode, --nonfinite skip, reconnect deadline."""
import logging
import os
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import run_threads
from helpers import client, named

from compression import Compressor
from deltaps.errors import PSError
from deltaps.optimizer_config import OptimizerConfig
from deltaps.tools.launch import free_port
from protos import pb, rpc
from ps.checkpoint import list_checkpoints
from ps.durability import Checkpointer, restore_latest
from ps.server import start_server
from ps.shard import Shard


def _state_equal(a: Shard, b: Shard):
    assert a.keys.keys() == b.keys.keys()
    for name, ka in a.keys.items():
        kb = b.keys[name]
        assert torch.equal(ka.value, kb.value), name
        assert (ka.version, ka.pushed, ka.agg_from, ka.initialized) == (kb.version, kb.pushed, kb.agg_from,
                                                                          kb.initialized), name
        assert (ka.agg is None) == (kb.agg is None) and (ka.agg is None or torch.equal(ka.agg, kb.agg))
        sa, sb = ka.opt.state_dict()["state"], kb.opt.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for k in sa[i]:
                assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (name, k)
    assert (a.live, a.codec, a.codec_epoch) == (b.live, b.codec, b.codec_epoch)
    for c in ("pushes", "grads_applied", "duplicates"):
        assert a.counters[c] == b.counters[c], c


def _two_worker_job(c, sync="bsp", opt=None):
    params = named(3)
    cls = [client(c.addrs, r, 2, sync=sync, opt=opt or OptimizerConfig("adam", lr=0.01), chunk_bytes=2048)
           for r in range(2)]
    cls[0].setup(params)
    cls[1].setup(params)
    return params, cls


def test_checkpoint_round_trip_mid_step(cluster_factory, tmp_path):
    """Parameters, Adam state, versions, pushed table, a half-aggregated bsp step, codec epoch, counters."""
    c = cluster_factory(1)
    params, (a, b) = _two_worker_job(c)
    g = {n: torch.randn(t.shape) for n, t in params}
    for step in range(3):
        a.push(g, step)
        b.push(g, step)
    a.push(g, 3)                      # worker 1 has not pushed step 3: agg + agg_from in progress
    a.set_codec("int8")
    shard = c.shards[0]
    assert any(ks.agg_from == {0} for ks in shard.keys.values())
    ck = Checkpointer(shard, str(tmp_path))
    path = ck.checkpoint("test")
    assert os.path.exists(path) and shard.durable_step(0) == 4 and shard.durable_step(1) == 3
    fresh = Shard(0, 1)
    assert restore_latest(fresh, str(tmp_path)) == path
    _state_equal(shard, fresh)
    assert fresh.server_id != shard.server_id and fresh.checkpoint_version == 3
    # both continue identically: worker 1 completes step 3 on each
    for s in (shard, fresh):
        s.push(1, 3, [(k, torch.ones(ks.spec.numel)) for k, ks in sorted(s.keys.items())], [])
    _state_equal(shard, fresh)
    assert min(ks.version for ks in fresh.keys.values()) == 4
    for cl in (a, b):
        cl.close()


def _corrupt(path, how):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        if how == "truncate":
            f.write(data[: len(data) // 2])
        else:
            f.write(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog, how):
    shard = Shard(0, 1)
    shard.register(0, 1, 1, "bsp", OptimizerConfig("sgd", lr=1.0), [_key()], "d", "none")
    shard.init([("w#0", torch.zeros(8))])
    ck = Checkpointer(shard, str(tmp_path))
    first = ck.checkpoint()
    shard.push(0, 0, [("w#0", torch.ones(8))], [])
    newest = ck.checkpoint()
    assert [p for _, p in list_checkpoints(str(tmp_path), 0)] == [newest, first]
    _corrupt(newest, how)
    fresh = Shard(0, 1)
    with caplog.at_level(logging.ERROR, logger="deltaps.checkpoint"):
        assert restore_latest(fresh, str(tmp_path)) == first
    assert "skipping checkpoint" in caplog.text and os.path.basename(newest) in caplog.text
    assert fresh.keys["w#0"].version == 0 and torch.equal(fresh.keys["w#0"].value, torch.zeros(8))


def _key(n=8):
    from deltaps.layout import Key
    return Key("w#0", "w", 0, n, "float32", 0)


@pytest.mark.parametrize("sync", ["bsp", "asp", "ssp:1"])
def test_retried_push_is_acked_not_applied_in_every_sync_mode(sync):
    shard = Shard(0, 1)
    shard.register(0, 2, 1, sync, OptimizerConfig("sgd", lr=1.0), [_key()], "d", "none")
    shard.init([("w#0", torch.zeros(8))])
    for w in (0, 1):
        dup, *_ = shard.push(w, 0, [("w#0", torch.full((8,), 2.0))], [])
        assert dup == [False]
        dup, *_ = shard.push(w, 0, [("w#0", torch.full((8,), 2.0))], [])   # the retry: same step
        assert dup == [True]
    assert torch.equal(shard.keys["w#0"].value, torch.full((8,), -2.0))   # mean of two 2s (bsp) / 2 x 2/2 (asp)
    assert shard.keys["w#0"].version == 1 and shard.counters["duplicates"] == 2


def test_nonfinite_skip_acks_without_applying():
    shard = Shard(0, 1, nonfinite="skip")
    shard.register(0, 2, 1, "bsp", OptimizerConfig("sgd", lr=1.0), [_key()], "d", "none")
    shard.init([("w#0", torch.zeros(8))])
    bad = torch.ones(8)
    bad[3] = float("nan")
    assert shard.push(0, 0, [("w#0", bad)], [])[0] == [False]
    shard.push(1, 0, [("w#0", torch.full((8,), 4.0))], [])
    ks = shard.keys["w#0"]
    assert ks.version == 1 and torch.equal(ks.value, torch.full((8,), -2.0))   # the NaN push counted as zero
    assert shard.counters["nonfinite_skipped"] == 1 and shard.stats()["nonfinite_skipped"] == 1
    with pytest.raises(ValueError):
        Shard(0, 1, nonfinite="ignore")


def test_silent_worker_is_evicted_and_rejoins_at_current_version(cluster_factory):
    c = cluster_factory(1, worker_timeout_s=0.6)
    shard = c.shards[0]
    params, (a, b) = _two_worker_job(c, opt=OptimizerConfig("sgd", lr=1.0))
    init = {n: t.clone() for n, t in params}
    g = {n: torch.ones(t.shape) for n, t in params}
    a.push(g, 0)
    b.push(g, 0)
    t0 = time.monotonic()                          # worker 1's last word: its silence runs from here
    a.pull(min_version=1)
    a.push(g, 1)                                   # worker 1 goes silent: step 1 waits only on it
    got = a.pull(min_version=2)                    # ... until it is evicted, then completes with worker 0 alone
    waited = time.monotonic() - t0
    assert 0.5 < waited < 0.6 + 1.0, waited
    assert shard.live == {0} and shard.counters["evictions"] == 1 and shard.stats()["evictions"] == 1
    for n in init:
        assert torch.allclose(got[n], init[n].view(-1) - 2.0)     # step 0: mean 1, step 1: worker 0's 1
    a.push(g, 2)                                   # worker 0 alone is not blocked
    a.pull(min_version=3)
    # worker 1 comes back: a new client (a restarted process) registers again
    b2 = client(c.addrs, 1, 2, opt=OptimizerConfig("sgd", lr=1.0), chunk_bytes=2048)
    b2.setup(params)
    assert shard.live == {0, 1} and b2.start_step == 3
    a.push(g, 3)
    b2.push({n: 3 * v for n, v in g.items()}, 3)      # its pushes count again: mean(1, 3) = 2
    got = a.pull(min_version=4)
    for n in init:
        assert torch.allclose(got[n], init[n].view(-1) - 5.0)
    for cl in (a, b, b2):
        cl.close()


def test_evicted_but_alive_worker_rejoins_on_its_next_push(cluster_factory):
    c = cluster_factory(1, worker_timeout_s=0.3)
    params, (a, b) = _two_worker_job(c, sync="asp", opt=OptimizerConfig("sgd", lr=1.0))
    g = {n: torch.ones(t.shape) for n, t in params}
    time.sleep(1.0)                          # both silent: both evicted
    assert c.shards[0].live == set()
    a.push(g, 0)                             # refused as not live -> re-register -> applied
    assert 0 in c.shards[0].live
    for cl in (a, b):
        cl.close()


def test_reconnect_deadline_turns_a_dead_shard_into_a_clean_error(cluster_factory):
    c = cluster_factory(1)
    params = named(4)
    cl = client(c.addrs, 0, 1, reconnect_deadline_s=1.5)
    cl.setup(params)
    c.stop()
    t0 = time.monotonic()
    with pytest.raises(PSError) as e:
        cl.push({n: torch.zeros(t.shape) for n, t in params}, 0)
    took = time.monotonic() - t0
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "shard 0" in str(e.value) and c.addrs[0] in str(e.value)
    assert 1.4 < took < 6, took
    cl.close()


class _Restartable:
    """One in-process shard on a fixed port that can 'crash' (stop without a checkpoint) and come back."""

    def __init__(self, tmp, every_steps):
        self.tmp, self.every = str(tmp), every_steps
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.start(Shard(0, 1))

    def start(self, shard):
        self.shard = shard
        self.ck = Checkpointer(shard, self.tmp, every_steps=self.every)
        self.ck.start()
        self.server, _ = start_server(shard, "127.0.0.1", self.port)

    def crash(self):
        self.ck._stop.set()
        self.server.stop(grace=None).wait()

    def restart(self):
        shard = Shard(0, 1)
        restore_latest(shard, self.tmp)
        self.start(shard)


def _run(addr, steps, crash_at=None, srv=None, sync="bsp", codec="none"):
    params = named(5)
    cls = [client([addr], r, 2, sync=sync, opt=OptimizerConfig("adam", lr=0.01), chunk_bytes=2048,
                  reconnect_deadline_s=20, codec=codec, compressor=Compressor(codec, min_bytes=0))
           for r in range(2)]
    cls[0].setup(params)
    cls[1].setup(params)
    gen = torch.Generator().manual_seed(1)
    grads = [[{n: torch.randn(t.shape, generator=gen) for n, t in params} for _ in range(steps)] for _ in range(2)]
    for step in range(steps):
        if step == crash_at:
            srv.crash()
            time.sleep(0.3)
            srv.restart()
        run_threads([lambda r=r: (cls[r].push(grads[r][step], step), cls[r].pull(min_version=step + 1))
                     for r in range(2)])   # two workers = two threads (a replay waits for the peer's)
        time.sleep(0.05)          # let the checkpointer thread see every step
    final = cls[0].pull(min_version=steps)
    sessions = [cl.sessions[0] for cl in cls]
    for cl in cls:
        cl.close()
    return final, sessions


@pytest.mark.parametrize("codec", ["none", "chunktopk:density=0.05,chunk=64", "lowrank:rank=4,bits=8"])   # + round codecs
def test_shard_crash_after_acked_pushes_is_replayed_exactly_once(tmp_path, codec):
    """Checkpoint every 4 steps; crash at step 10 (pushes of steps 8-9 acknowledged but only in memory)."""
    ref_srv = _Restartable(tmp_path / "ref", 4)
    ref, _ = _run(ref_srv.addr, 14, codec=codec)
    ref_srv.crash()
    srv = _Restartable(tmp_path / "crash", 4)
    got, sessions = _run(srv.addr, 14, crash_at=10, srv=srv, codec=codec)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n          # bit-identical to the run without the crash
    assert all(s.restarts == 1 and s.replayed > 0 for s in sessions)
    ks = list(srv.shard.keys.values())
    assert all(k.version == 14 for k in ks)
    assert srv.shard.counters["duplicates"] > 0        # the replay's already-checkpointed pushes were acked only
    assert max(len(s.buffer) for s in sessions) <= 2 * 4 * len(ks) + 2 * len(ks)
    srv.crash()


def test_replay_buffer_bound_gives_data_loss_not_silence(tmp_path):
    srv = _Restartable(tmp_path, 0)          # never checkpoints (but says it does): buffer hits replay_steps
    params = named(6)
    cl = client([srv.addr], 0, 1, replay_steps=3, reconnect_deadline_s=10)
    cl.setup(params)
    srv.ck.checkpoint("start")               # step 0 is durable, nothing later
    g = {n: torch.zeros(t.shape) for n, t in params}
    for step in range(6):
        cl.push(g, step)
    assert cl.sessions[0].dropped_below == 3
    srv.crash()
    srv.restart()
    with pytest.raises(PSError) as e:
        cl.push(g, 6)
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "replay_steps" in str(e.value)
    cl.close()
    srv.crash()


def test_negative_step_stale_server_id_and_garbage_bytes(cluster_factory):
    c = cluster_factory(1)
    params = named(8)
    with client(c.addrs, 0, 1) as cl:
        cl.setup(params)
        stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
        k = cl.layout[0]
        chunk = pb.TensorChunk(key=k.key, dtype="float32", shape=[k.numel], codec="none",
                               data=np.ones(k.numel, np.float32).tobytes())
        before = c.shards[0].keys[k.key].value.clone()
        for req, code, word in ((pb.PushRequest(worker_id=0, step=-1, grads=[chunk]), grpc.StatusCode.INVALID_ARGUMENT,
                                 "step"),
                                (pb.PushRequest(worker_id=0, step=0, grads=[chunk], server_id="0123"),
                                 grpc.StatusCode.ABORTED, "restarted")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Push(req, timeout=5)
            assert e.value.code() == code and word in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Pull(pb.PullRequest(keys=[k.key], server_id="0123"), timeout=5)
        assert e.value.code() == grpc.StatusCode.ABORTED
        raw = grpc.insecure_channel(c.addrs[0]).unary_unary("/deltaps.ParameterServer/Push")
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\xff\xff\xff\xff", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid PushRequest" in e.value.details()
        assert torch.equal(c.shards[0].keys[k.key].value, before) and c.shards[0].keys[k.key].version == 0


def test_closing_a_client_cancels_its_exchange_in_flight(cluster_factory):
    """A worker whose step failed mid-round (a codec refusing NaN, an out-of-memory) closes its client while a pull
    in its pool still waits for a round its peers will not finish: close() cancels that RPC and returns at once, so
    the process exits and its launcher reports the failure, instead of waiting out --timeout-s first."""
    c = cluster_factory(1)
    w0, w1 = [client(c.addrs, r, 2, timeout_s=60.0) for r in range(2)]
    for w in (w0, w1):
        w.setup(named())
    w0.push({n: torch.ones_like(t) for n, t in named()}, 0)
    waiting = w0.pool.submit(w0.pull, min_version=1)       # worker 1 never pushes round 0
    time.sleep(0.3)
    assert not waiting.done()
    t0 = time.monotonic()
    w0.close()
    assert time.monotonic() - t0 < 5.0
    assert isinstance(waiting.exception(timeout=1.0), PSError)
    w1.close()


def test_a_codec_switch_waits_for_a_shard_that_is_restarting(tmp_path):
    # the rollback switch sent while the shard is down: it used to fail at once (UNAVAILABLE) with earlier
    # shards switched; through the shard's session it waits for the restart and lands
    srv = _Restartable(tmp_path, 1)
    cl = client([srv.addr], 0, 1, codec="int8", reconnect_deadline_s=20)
    cl.setup(named(7))
    srv.ck.checkpoint("start")
    srv.crash()
    threading.Timer(1.0, srv.restart).start()
    epoch = cl.set_codec("none")
    assert epoch >= 1 and srv.shard.codec == "none" and cl.codec == "none"
    cl.close()
    srv.crash()


def test_a_codec_switch_after_the_last_checkpoint_reaches_the_restored_shard(tmp_path):
    # the checkpoint holds int8 at epoch 0; the switch to none (epoch 1) came after it. Each worker that sees the
    # restart sends the switch again at its epoch: the first lands, the second changes nothing (epoch stays 1)
    srv = _Restartable(tmp_path, 0)
    cls = [client([srv.addr], r, 2, codec="int8", reconnect_deadline_s=20) for r in range(2)]
    for cl in cls:
        cl.setup(named(7), pull=False)
    srv.ck.checkpoint("start")
    cls[0].set_codec("none")
    cls[1].pull(min_version=0)                      # the answer tells worker 1 of the switch
    assert [cl.codec_epoch for cl in cls] == [1, 1]
    srv.crash()
    srv.restart()
    assert (srv.shard.codec, srv.shard.codec_epoch) == ("int8", 0)
    for cl in cls:
        cl.pull(min_version=0)                      # refused (a new incarnation): register again, then pull
    assert (srv.shard.codec, srv.shard.codec_epoch) == ("none", 1)
    assert [(cl.codec, cl.codec_epoch) for cl in cls] == [("none", 1), ("none", 1)]
    for cl in cls:
        cl.close()
    srv.crash()


def test_a_restarted_shard_of_an_elastic_job_keeps_its_joiners(tmp_path):
    # joiners start with the job's first --world-size (2); the first Register after a restore re-bases an elastic
    # job on the registrant's worker count: a recovering worker sends the count it last saw, not its start-up one
    srv = _Restartable(tmp_path, 1)
    cls = [client([srv.addr], r, 2, min_workers=1, max_workers=4, reconnect_deadline_s=20) for r in range(4)]
    for cl in cls:
        cl.setup(named(8), pull=False)
    for cl in cls:
        cl.pull(min_version=0)                       # every pull answer carries the live set: 0-3
    assert cls[0].live_workers == [0, 1, 2, 3]
    srv.ck.checkpoint("start")
    srv.crash()
    srv.restart()
    cls[0].pull(min_version=0)                       # refused (a new incarnation): register again, then pull
    assert srv.shard.live == {0, 1, 2, 3} and srv.shard.job.world_size == 4
    for cl in cls:
        cl.close()
    srv.crash()
