"""Bad requests get the right gRPC status and a message naming the problem; shard state is unchanged."""
import time

import grpc
import msgpack
import numpy as np
import pytest
import torch
from helpers import client

from deltaps.errors import PSError
from deltaps.optimizer_config import OptimizerConfig
from deltaps.transport import grpc_options
from protos import PROTOCOL_VERSION, pb, rpc
from ps import server as ps_server


@pytest.fixture
def setup(cluster_factory):
    c = cluster_factory(1)
    cl = client(c.addrs, 0, 2, chunk_bytes=1 << 20, timeout_s=5)
    cl.setup([("w", torch.arange(100, dtype=torch.float32))])
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0], options=grpc_options(8 << 20)))
    yield c, cl, stub
    cl.close()


def _chunk(key="w#0", n=100, data=None, codec="none", header=b"", dtype="float32"):
    data = np.ones(n, np.float32).tobytes() if data is None else data
    return pb.TensorChunk(key=key, dtype=dtype, shape=[n], codec=codec, header=header, data=data)


def _push(stub, chunk, step=0, worker=0):
    return stub.Push(pb.PushRequest(worker_id=worker, step=step, seq=1, grads=[chunk]), timeout=5)


def _expect(code, fn, *words):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    for w in words:
        assert w in e.value.details(), e.value.details()


def _unchanged(c):
    ks = c.shards[0].keys["w#0"]
    assert torch.equal(ks.value, torch.arange(100, dtype=torch.float32)) and ks.version == 0
    assert not ks.agg_from


@pytest.mark.parametrize("chunk,code,words", [
    (_chunk(key="nope#0"), grpc.StatusCode.INVALID_ARGUMENT, ["unknown key", "nope#0"]),
    (_chunk(n=99), grpc.StatusCode.INVALID_ARGUMENT, ["99", "100"]),
    (_chunk(data=np.full(100, np.nan, np.float32).tobytes()), grpc.StatusCode.INVALID_ARGUMENT, ["NaN"]),
    (_chunk(data=np.r_[np.ones(99), np.inf].astype(np.float32).tobytes()), grpc.StatusCode.INVALID_ARGUMENT, ["Inf"]),
    (_chunk(data=np.r_[-np.inf, np.ones(99)].astype(np.float32).tobytes()), grpc.StatusCode.INVALID_ARGUMENT, ["Inf"]),
    (_chunk(data=b"\0" * 17), grpc.StatusCode.INVALID_ARGUMENT, ["w#0"]),
    (_chunk(codec="zstd9"), grpc.StatusCode.INVALID_ARGUMENT, ["unknown codec", "zstd9"]),
    (_chunk(codec="topk", header=b"\xc1garbage", data=b"\0" * 8), grpc.StatusCode.INVALID_ARGUMENT, ["header"]),
    (_chunk(codec="topk", header=msgpack.packb({"k": 1, "n": 100}),
            data=np.array([500], np.int32).tobytes() + np.ones(1, np.float32).tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, ["w#0"]),
    (_chunk(dtype="complex64"), grpc.StatusCode.INVALID_ARGUMENT, ["complex64"]),
])
def test_bad_push_is_rejected_and_state_unchanged(setup, chunk, code, words):
    c, _, stub = setup
    _expect(code, lambda: _push(stub, chunk), *words)
    _unchanged(c)


def test_push_from_the_future_and_unknown_worker(setup):
    c, _, stub = setup
    _expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: _push(stub, _chunk(), step=5), "step 5")
    _expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: _push(stub, _chunk(), worker=7), "worker 7")
    _unchanged(c)


def test_retried_push_is_acknowledged_but_applied_once(setup):
    c, cl, stub = setup
    first = _push(stub, _chunk(), step=0)
    again = _push(stub, _chunk(), step=0)
    assert list(first.duplicate) == [False] and list(again.duplicate) == [True]
    _push(stub, _chunk(), step=0, worker=1)       # the second worker completes the BSP step
    got = cl.pull(min_version=1)["w"]
    assert torch.allclose(got, torch.arange(100, dtype=torch.float32) - 0.1)   # mean of two ones, once
    assert c.shards[0].stats()["duplicates"] == 1


def test_register_mismatches(setup):
    _, cl, stub = setup
    opt = pb.OptimizerConfig()
    cl.optimizer.to_proto(opt)
    base = dict(protocol_version=PROTOCOL_VERSION, worker_id=1, world_size=2, num_shards=1, sync="bsp",
                layout_digest="x", optimizer=opt)
    _expect(grpc.StatusCode.FAILED_PRECONDITION,
            lambda: stub.Register(pb.RegisterRequest(**{**base, "protocol_version": 99}), timeout=5), "protocol version")
    _expect(grpc.StatusCode.FAILED_PRECONDITION,
            lambda: stub.Register(pb.RegisterRequest(**{**base, "world_size": 3}), timeout=5), "world size")
    _expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: stub.Register(pb.RegisterRequest(**base), timeout=5),
            "layout digest")
    _expect(grpc.StatusCode.FAILED_PRECONDITION,
            lambda: stub.Register(pb.RegisterRequest(**{**base, "num_shards": 2}), timeout=5), "shards")
    _expect(grpc.StatusCode.INVALID_ARGUMENT,
            lambda: stub.Register(pb.RegisterRequest(**{**base, "sync": "eventually"}), timeout=5), "sync mode")


def test_pull_timeout_unknown_key_bad_codec_and_oversize(setup):
    _, _, stub = setup
    _expect(grpc.StatusCode.DEADLINE_EXCEEDED,
            lambda: stub.Pull(pb.PullRequest(keys=["w#0"], min_version=3, timeout_s=0.3), timeout=5), "w#0")
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.Pull(pb.PullRequest(keys=["zz"]), timeout=5), "zz")
    _expect(grpc.StatusCode.INVALID_ARGUMENT,
            lambda: stub.Pull(pb.PullRequest(keys=["w#0"], min_version=3, timeout_s=float("inf")), timeout=5), "finite")
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.SetCodec(pb.SetCodecRequest(codec="lz4"), timeout=5),
            "lz4")
    _expect(grpc.StatusCode.INVALID_ARGUMENT,
            lambda: stub.SetCodec(pb.SetCodecRequest(codec="int8", epoch=-1), timeout=5), "epoch -1")
    huge = _chunk(data=b"\0" * (70 << 20))     # over the server's 64 MiB limit
    big_stub = rpc.ParameterServerStub(grpc.insecure_channel(_addr(setup),
                                                             options=grpc_options(128 << 20)))
    _expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: _push(big_stub, huge))


def test_bad_digest_offers_are_refused_by_name(setup):
    c, _, stub = setup
    ok = b"\1" * 16
    for req, words in [(pb.PullRequest(keys=["w#0"], have_digests=[ok]), ["have_digests", "have_versions"]),
                       (pb.PullRequest(keys=["w#0"], have_versions=[-1], have_digests=[ok, ok]), ["one entry per key"]),
                       (pb.PullRequest(keys=["w#0"], have_versions=[-1], have_digests=[b"abc"]), ["16 bytes"])]:
        _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda req=req: stub.Pull(req, timeout=5), *words)
    # in a PushPull a bad offer is refused before its push is applied
    push = pb.PushRequest(worker_id=0, step=0, seq=1, grads=[_chunk()])
    bad = pb.PullRequest(worker_id=0, keys=["w#0"], have_versions=[0], have_digests=[b"abc"])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push_pull(stub, push, bad), "16 bytes")
    _unchanged(c)
    # a digest of other values gets the full value, not 'unchanged'
    rep = stub.Pull(pb.PullRequest(keys=["w#0"], have_versions=[-1], have_digests=[ok]), timeout=5)
    assert list(rep.kinds) == [0] and len(rep.values[0].data) == 400


def _addr(setup):
    c, _, _ = setup
    return c.addrs[0]


def test_push_before_register(cluster_factory):
    c = cluster_factory(1)
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
    _expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: _push(stub, _chunk()), "Register")


def _push_pull(stub, push=None, pull=None):
    return stub.PushPull(pb.PushPullRequest(push=push, pull=pull), timeout=5)


def test_push_pull_needs_both_halves_from_the_same_worker(setup):
    c, _, stub = setup
    push = pb.PushRequest(worker_id=0, step=0, seq=1, grads=[_chunk()])
    pull = pb.PullRequest(worker_id=0, keys=["w#0"], min_version=0, have_versions=[0])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push_pull(stub, push=push), "both")
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push_pull(stub, pull=pull), "both")
    other = pb.PullRequest(worker_id=1, keys=["w#0"], min_version=0, have_versions=[0])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push_pull(stub, push, other), "worker_id")
    # a bad push half is refused before anything is applied or pulled
    bad = pb.PushRequest(worker_id=0, step=0, seq=1, grads=[_chunk(data=np.full(100, np.nan, np.float32).tobytes())])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push_pull(stub, bad, pull), "NaN")
    _unchanged(c)


def test_push_pull_retry_is_acknowledged_not_applied_twice(setup):
    """A PushPull re-sent after a lost answer: the push is a duplicate, the pull is served again."""
    c, _, stub = setup
    c.shards[0].evict(1)                       # world of 2; worker 1 never comes: the step completes with 0
    push = pb.PushRequest(worker_id=0, step=0, seq=1, grads=[_chunk()])
    pull = pb.PullRequest(worker_id=0, keys=["w#0"], min_version=1, have_versions=[0])
    first = _push_pull(stub, push, pull)
    again = _push_pull(stub, push, pull)
    assert list(first.push.duplicate) == [False] and list(again.push.duplicate) == [True]
    assert list(first.pull.versions) == list(again.pull.versions) == [1]
    assert c.shards[0].keys["w#0"].version == 1 and c.shards[0].counters["duplicates"] == 1
    assert c.shards[0].counters["grads_applied"] == 1


def test_a_payload_whose_shape_does_not_match_its_key_is_refused_before_it_is_decoded(setup):
    # a lowrank "factors" chunk of 46 kB stands for a 46340 x 46340 matrix (8.6 GB decoded): refused by its shape
    c, _, stub = setup
    huge = pb.TensorChunk(key="w#0", dtype="float32", shape=[46340, 46340], codec="lowrank",
                          header=msgpack.packb({"form": "factors", "rank": 1, "bits": 4}), data=b"\0" * 46348)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push(stub, huge), "w#0", "2147395600 elements", "100")
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push(stub, pb.TensorChunk(
        key="w#0", dtype="float32", shape=[-100, -1], codec="none", data=b"\0" * 400)), "[-100, -1]")
    _unchanged(c)


def test_a_key_named_twice_in_one_request_is_refused(setup):
    c, _, stub = setup
    two = pb.PushRequest(worker_id=0, step=0, seq=1, grads=[_chunk(), _chunk(data=np.full(100, 2, np.float32).tobytes())])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.Push(two, timeout=5), "key 'w#0' twice")
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.Pull(pb.PullRequest(keys=["w#0"] * 3), timeout=5),
            "key 'w#0' twice")
    _unchanged(c)


def test_a_push_pull_whose_pull_is_bad_applies_nothing(setup):
    c, _, stub = setup
    push = pb.PushRequest(worker_id=0, step=0, seq=1, grads=[_chunk()])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: _push_pull(stub, push, pb.PullRequest(worker_id=0, keys=["zz"])),
            "zz")
    _unchanged(c)


def test_an_initial_value_with_nan_is_refused_and_the_key_can_still_be_initialised(cluster_factory):
    c = cluster_factory(1)
    cl = client(c.addrs, 1, 2, timeout_s=5)         # rank 1 registers; rank 0 would Init
    cl.setup([("w", torch.zeros(100))], pull=False)
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
    bad = np.r_[np.ones(99), np.nan].astype(np.float32).tobytes()
    _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.Init(pb.InitRequest(values=[_chunk(data=bad)]), timeout=5),
            "w#0", "NaN")
    assert not c.shards[0].keys["w#0"].initialized
    assert stub.Init(pb.InitRequest(values=[_chunk()]), timeout=5).initialized == 1
    cl.close()


def test_a_register_that_cannot_define_a_job_is_refused_and_defines_none(cluster_factory):
    c = cluster_factory(1)
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
    opt = pb.OptimizerConfig()
    OptimizerConfig("sgd", lr=0.1).to_proto(opt)
    key = pb.KeySpec(key="w#0", param="w", offset=0, numel=100, dtype="float32", shard=0)
    base = dict(protocol_version=PROTOCOL_VERSION, worker_id=0, world_size=1, num_shards=1, sync="bsp",
                layout_digest="x", optimizer=opt, keys=[key])
    nesterov = pb.OptimizerConfig()
    nesterov.CopyFrom(opt)
    nesterov.nesterov = True            # with momentum 0: torch refuses it at every Init
    for over, words in (({"keys": [pb.KeySpec(key="w#0", param="w", numel=-1, shard=0)]}, ["numel=-1"]),
                        ({"keys": [key, key]}, ["key 'w#0' twice"]),
                        ({"world_size": (1 << 31) - 1}, ["world size"]),
                        ({"optimizer": nesterov}, ["Nesterov momentum needs a momentum > 0"])):
        _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda over=over: stub.Register(pb.RegisterRequest(**{**base, **over}),
                                                                                  timeout=5), *words)
        assert c.shards[0].job is None
    cl = client(c.addrs, 0, 1, timeout_s=5)
    cl.setup([("w", torch.arange(100, dtype=torch.float32))])      # a good job is still welcome
    cl.close()


def test_a_push_held_by_a_paused_job_is_answered_before_its_callers_deadline(cluster_factory):
    # the shard's own wait (30 s here, 300 by default) is longer than a client's deadline (120 s by default): held
    # past the deadline, the client got DEADLINE_EXCEEDED and the worker died, though a paused job only waits
    c = cluster_factory(1, wait_timeout_s=30.0)
    clients = [client(c.addrs, r, 2, timeout_s=5, min_workers=2, max_workers=2) for r in range(2)]
    for cl in clients:
        cl.setup([("w", torch.arange(100, dtype=torch.float32))], pull=False)
    c.shards[0].evict(1, "test")
    assert c.shards[0].paused
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
    t0 = time.monotonic()
    _expect(grpc.StatusCode.UNAVAILABLE, lambda: _push(stub, _chunk(), worker=0), "paused")
    assert time.monotonic() - t0 < 5              # answered ~1 s before the 5 s deadline, not at the shard's 30 s
    for cl in clients:
        cl.close()


def test_a_refusal_reaching_the_worker_names_the_shard_that_refused(setup):
    c, cl, _ = setup
    with pytest.raises(PSError) as e:
        cl.push({"w": torch.full((100,), float("nan"))}, 0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"shard 0 at {c.addrs[0]}: Push" in str(e.value) and "NaN" in str(e.value), str(e.value)


def test_unexpected_handler_error_is_internal_naming_rpc_and_error(setup, monkeypatch, caplog):
    """A fault of the shard's own (not a refusal) is INTERNAL naming the RPC and the error, not gRPC's
    UNKNOWN "Exception calling application"; the traceback is logged once, the shard keeps serving."""
    c, cl, stub = setup
    shard = c.shards[0]

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero in a test")
    monkeypatch.setattr(shard, "heartbeat", broken)
    monkeypatch.setattr(ps_server, "_TRACED", set())
    with caplog.at_level("WARNING", logger="deltaps.server"):
        for _ in range(3):
            _expect(grpc.StatusCode.INTERNAL, lambda: stub.Heartbeat(pb.HeartbeatRequest(worker_id=0), timeout=5),
                    "Heartbeat", "ZeroDivisionError", "division by zero in a test", "shard 0")
    assert len([r for r in caplog.records if r.exc_info]) == 1   # one traceback, then rate-limited lines
    monkeypatch.undo()
    assert stub.Heartbeat(pb.HeartbeatRequest(worker_id=0), timeout=5).live
