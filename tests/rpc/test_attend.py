"""Attend streams (protos/deltaps.proto, ps/membership.py attend/unattend): a worker that heartbeats holds one open
per shard; its end without a leaving heartbeat (the process died) evicts the worker at once, long before its
missed beats would; a clean close, or the end of a stream a newer one replaced, evicts nobody."""
import time

import grpc
import pytest
import torch
from helpers import client

from deltaps.optimizer_config import outer_optimizer_config
from protos import pb

AVG = outer_optimizer_config("avg")
N = 8
BEAT_S = 5.0     # 4 missed beats = 20 s: an eviction within the test's second is the stream's doing


def _job(cluster_factory, world):
    c = cluster_factory(1)
    clients = [client(c.addrs, r, world, sync=f"quorum:{world}", opt=AVG, local_steps=4, heartbeat_s=BEAT_S)
               for r in range(world)]
    for cl in clients:
        cl.setup([("w", torch.zeros(N))])
    return c, clients


def _wait_evicted(shard, worker, within_s=3.0) -> float:
    t0 = time.monotonic()
    while worker in shard.live and time.monotonic() - t0 < within_s:
        time.sleep(0.02)
    return time.monotonic() - t0


def test_the_end_of_a_workers_attend_stream_evicts_it_at_once(cluster_factory):
    c, (w0, w1) = _job(cluster_factory, 2)
    shard = c.shards[0]
    deadline = time.monotonic() + 3        # setup opens one stream per worker without waiting for the shard's handler
    while set(shard.attending) != {0, 1} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(shard.attending) == {0, 1}
    w1._attendance[0].cancel()                            # what the kernel does to a killed process's connection
    assert _wait_evicted(shard, 1) < 1.0
    assert shard.stats()["evictions"] == 1 and shard.live == {0}
    # the round no longer waits for it: worker 0's delta alone closes round 0
    w0.push({"w": torch.ones(N)}, 0)
    assert torch.equal(w0.pull(min_version=1)["w"], -torch.ones(N))
    w0.close()
    w1.close()


def test_a_clean_close_is_a_departure_not_a_death(cluster_factory):
    c, (w0, w1) = _job(cluster_factory, 2)
    shard = c.shards[0]
    w1.close()                                            # leaving heartbeat, then the stream ends
    time.sleep(0.5)
    assert shard.live == {0, 1} and shard.stats()["evictions"] == 0 and set(shard.attending) == {0}
    w0.close()


def test_only_the_end_of_a_workers_newest_stream_evicts_it(cluster_factory):
    c, (w0,) = _job(cluster_factory, 1)
    shard = c.shards[0]
    old = w0._attendance[0]
    w0._attendance[0] = None
    w0._attend()                                          # a reconnecting client's new stream
    deadline = time.monotonic() + 3
    while shard.attending.get(0) == 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    old.cancel()
    time.sleep(0.5)
    assert shard.live == {0} and shard.stats()["evictions"] == 0
    w0._attendance[0].cancel()                            # the newest one's end does
    assert _wait_evicted(shard, 0) < 1.0
    w0.close()


def test_attend_refuses_what_is_not_a_worker_of_the_job(cluster_factory):
    c, (w0,) = _job(cluster_factory, 1)
    stream = w0.stubs[0].Attend(pb.HeartbeatRequest(worker_id=7), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        next(stream)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker 7" in e.value.details()
    first = next(w0.stubs[0].Attend(pb.HeartbeatRequest(worker_id=0), timeout=5))
    assert first.live
    w0.close()


def test_attend_streams_never_take_every_server_thread(cluster_factory):
    """Each stream holds a server thread: past half the pool a worker is left to its heartbeats (RESOURCE_EXHAUSTED)
    and the shard still answers pushes and pulls; a stream a newer one of its worker replaced gives its thread back."""
    c = cluster_factory(1, threads=4)                   # 2 streams at most: workers 0 and 1 take them
    shard = c.shards[0]
    clients = [client(c.addrs, r, 3, sync="quorum:3", opt=AVG, local_steps=4, heartbeat_s=BEAT_S) for r in range(3)]
    for r, cl in enumerate(clients):
        cl.setup([("w", torch.zeros(N))])
        deadline = time.monotonic() + 3
        while r < 2 and r not in shard.attending and time.monotonic() < deadline:
            time.sleep(0.02)
    assert set(shard.attending) == {0, 1}
    stream = clients[2].stubs[0].Attend(pb.HeartbeatRequest(worker_id=2), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        next(stream)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "heartbeats" in e.value.details()
    for cl in clients:                                      # every thread not held by a stream still serves
        cl.push({"w": torch.ones(N)}, 0)
    assert torch.equal(clients[2].pull(min_version=1)["w"], -torch.ones(N))
    held, kept = c.servers[0].deltaps_servicer, []
    for _ in range(5):          # worker 0 reconnecting again and again, keeping every old stream open on its side
        kept.append(clients[0]._attendance[0])
        clients[0]._attendance[0] = None
        clients[0]._attend()
        time.sleep(0.2)
    deadline = time.monotonic() + 10      # the shard ends each replaced one (within ATTEND_CHECK_S)
    while held.streams != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held.streams == 2 and set(shard.attending) == {0, 1} and shard.attending[0] > 2
    assert shard.live == {0, 1, 2} and shard.stats()["evictions"] == 0
    for cl in clients:
        cl.close()
