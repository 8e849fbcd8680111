"""Hypothesis fuzzing of the RPC handlers against a real (in-process) gRPC server: random and mutated
Push/Pull/Register request bytes and random field values. No crash (no UNKNOWN status = no unhandled
exception), no hang (every call has a deadline and the server keeps answering), and a rejected request
leaves the shard state unchanged."""
import grpc
import numpy as np
import pytest
import torch
from helpers import client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaps.optimizer_config import OptimizerConfig
from protos import PROTOCOL_VERSION, pb

N = 16
SETTINGS = dict(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# Statuses a refusal may carry; UNKNOWN would mean a handler raised something unexpected, INTERNAL that
# undecodable bytes reached grpc's own parser (ps/handlers.py parses them: INVALID_ARGUMENT).
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.CANCELLED}


@pytest.fixture(scope="module")
def target():
    from conftest import Cluster
    c = Cluster(1, wait_timeout_s=0.3)
    cl = client(c.addrs, 0, 2, opt=OptimizerConfig("sgd", lr=1.0), timeout_s=2)
    cl.setup([("w", torch.arange(N, dtype=torch.float32))])
    ch = grpc.insecure_channel(c.addrs[0])
    raw = {m: ch.unary_unary(f"/deltaps.ParameterServer/{m}") for m in ("Push", "Pull", "Register", "Init", "Barrier")}
    yield c, cl, raw
    cl.close()
    c.stop()


def _state(shard):
    ks = shard.keys["w#0"]
    return (ks.value.clone(), ks.version, dict(ks.pushed), set(ks.agg_from),
            None if ks.agg is None else ks.agg.clone(), set(shard.live), shard.codec_epoch)


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)) and \
        (a[4] is None) == (b[4] is None)


def _send(target, method, data: bytes):
    c, _, raw = target
    shard = c.shards[0]
    before = _state(shard)
    try:
        raw[method](data, timeout=1.5)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, (e.code(), e.details())
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or "waited" not in (e.details() or ""):
            assert _same(before, _state(shard)), (method, e.code(), e.details())
    # still serving
    assert c.shards[0].stats()["num_keys"] == 1


def _valid_push(step=0, worker=1):
    g = np.ones(N, np.float32).tobytes()
    return pb.PushRequest(worker_id=worker, step=step, seq=3, grads=[
        pb.TensorChunk(key="w#0", dtype="float32", shape=[N], codec="none", data=g)]).SerializeToString()


def _valid_register(target):
    _, cl, _ = target
    opt = pb.OptimizerConfig()
    cl.optimizer.to_proto(opt)
    k = cl.layout[0]
    return pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker_id=1, world_size=2, num_shards=1, sync="bsp",
                              optimizer=opt, keys=[pb.KeySpec(key=k.key, param=k.param, offset=k.offset, numel=k.numel,
                                                              dtype=k.dtype, shard=0)],
                              layout_digest="nope", codec="none").SerializeToString()


@settings(**SETTINGS)
@given(method=st.sampled_from(["Push", "Pull", "Register", "Init", "Barrier"]), data=st.binary(max_size=300))
def test_random_bytes(target, method, data):
    _send(target, method, data)


def _mutate(data: bytes, ops):
    b = bytearray(data)
    for kind, pos, val in ops:
        if not b:
            break
        p = pos % len(b)
        if kind == 0:
            b[p] ^= val or 1
        elif kind == 1:
            del b[p:]
        elif kind == 2:
            b.insert(p, val)
        else:
            b[p] = 0xFF
    return bytes(b)


MUTATIONS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6)


@settings(**SETTINGS)
@given(which=st.sampled_from(["Push", "Register", "Pull"]), ops=MUTATIONS)
def test_mutated_valid_requests(target, which, ops):
    base = {"Push": _valid_push(step=7),   # step 7 is from the future: even a clean copy is refused
            "Register": _valid_register(target),
            "Pull": pb.PullRequest(worker_id=0, keys=["w#0"], min_version=99, timeout_s=0.2).SerializeToString()}[which]
    _send(target, which, _mutate(base, ops))


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
chunk = st.builds(
    pb.TensorChunk, key=st.sampled_from(["w#0", "w#1", "", "x" * 300]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8", "complex64", "", "garbage"]),
    shape=st.lists(st.integers(-5, 1 << 40), max_size=3),
    codec=st.sampled_from(["none", "fp16", "int8", "topk", "qsgd", "sign", "dgc", "randk", "zstd", ""]),
    header=st.one_of(st.just(b""), st.binary(max_size=40)),
    data=st.one_of(st.binary(max_size=80), st.builds(lambda xs: np.array(xs, np.float32).tobytes(),
                                                     st.lists(floats, min_size=N, max_size=N))))


@settings(**SETTINGS)
@given(worker=st.integers(-3, 5), step=st.integers(-2**63, 2**63 - 1) | st.integers(-2, 4),
       grads=st.lists(chunk, max_size=3), pulled=st.lists(st.integers(-2**63, 2**63 - 1), max_size=4),
       server_id=st.sampled_from(["", "deadbeef"]))
def test_random_push_fields(target, worker, step, grads, pulled, server_id):
    req = pb.PushRequest(worker_id=worker, step=step, seq=1, grads=grads, pulled_versions=pulled, server_id=server_id)
    _send(target, "Push", req.SerializeToString())


@settings(**SETTINGS)
@given(worker=st.integers(-2**31, 2**31 - 1), keys=st.lists(st.sampled_from(["w#0", "zz", ""]), max_size=3),
       min_version=st.integers(-2**63, 2**63 - 1), timeout_s=st.floats(allow_nan=True, allow_infinity=True),
       have=st.lists(st.integers(-2**63, 2**63 - 1), max_size=3))
def test_random_pull_fields(target, worker, keys, min_version, timeout_s, have):
    req = pb.PullRequest(worker_id=worker, keys=keys, min_version=min_version, timeout_s=timeout_s,
                         have_versions=have)
    _send(target, "Pull", req.SerializeToString())


@settings(**SETTINGS)
@given(proto=st.integers(0, 3), worker=st.integers(-2, 4), world=st.integers(-1, 4), shards=st.integers(-1, 3),
       sync=st.sampled_from(["bsp", "asp", "ssp:1", "ssp:-1", "ssp:x", ""]),
       opt_name=st.sampled_from(["sgd", "adam", "lbfgs", ""]), lr=st.floats(allow_nan=True, allow_infinity=True),
       key_shard=st.integers(-1, 2), numel=st.integers(-5, 1 << 40))
def test_random_register_fields(target, proto, worker, world, shards, sync, opt_name, lr, key_shard, numel):
    req = pb.RegisterRequest(protocol_version=proto, worker_id=worker, world_size=world, num_shards=shards, sync=sync,
                             optimizer=pb.OptimizerConfig(name=opt_name, lr=lr),
                             keys=[pb.KeySpec(key="w#0", param="w", offset=0, numel=numel, dtype="float32",
                                              shard=key_shard)], layout_digest="x", codec="none")
    _send(target, "Register", req.SerializeToString())


def test_server_still_trains_after_the_fuzzing(target):
    c, cl, _ = target
    shard = c.shards[0]
    ks = shard.keys["w#0"]
    step = ks.version
    for w in (0, 1):
        if ks.pushed.get(w, 0) == step:
            shard.push(w, step, [("w#0", torch.zeros(N))], [])
    assert ks.version == step + 1


# ---- payload decoders: random mutations of real payloads of every codec (tests/test_codecs.py has fixed
# corruptions only). A decoder either returns a tensor of the declared size or raises CodecError.
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(spec=st.sampled_from(["none", "fp16", "bf16", "int8", "qsgd", "sign", "topk:ratio=0.1", "randk:ratio=0.1",
                             "dgc:ratio=0.1"]),
       ops=MUTATIONS, header_ops=st.dictionaries(st.sampled_from(["k", "n", "scale", "enc", "bits", "seed", "levels",
                                                                  "chunk", "norm", "x"]),
                                                 st.one_of(st.integers(-2**40, 2**40), st.floats(), st.text(max_size=4),
                                                           st.binary(max_size=4), st.none()), max_size=2))
def test_decoders_survive_mutated_payloads(spec, ops, header_ops):
    import dataclasses

    from compression import CodecError, accumulate_payload, decode_payload, get_codec, unpack_payload
    p = get_codec(spec).compress(torch.randn(300, generator=torch.Generator().manual_seed(1)), seed=3)
    bad = dataclasses.replace(p, data=_mutate(bytes(p.data), ops), header={**p.header, **header_ops})
    for fn in (decode_payload, unpack_payload, lambda q: accumulate_payload(q, torch.zeros(q.numel))):
        try:
            out = fn(bad)
        except CodecError:
            continue
        if isinstance(out, torch.Tensor):
            assert out.numel() == bad.numel
