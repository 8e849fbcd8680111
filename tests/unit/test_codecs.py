"""Codec correctness: shapes/dtypes, error bounds, exact selection, accumulate, corrupt payloads."""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import (
    CodecError,
    Compressor,
    ErrorFeedback,
    Payload,
    accumulate_payload,
    decode_payload,
    get_codec,
    unpack_payload,
)
from compression.codecs.sparse import topk_indices

SPECS = ["none", "fp16", "bf16", "int8:chunk=64", "qsgd:levels=16,chunk=64", "sign",
         "topk:ratio=0.05", "randk:ratio=0.05", "dgc:ratio=0.05", "chunktopk:density=0.05,chunk=64",
         "chunktopk:density=0.02,chunk=4096,bits=4", "lowbit:bits=4,chunk=64", "lowbit:bits=2"]
LOSSY_BODY = [s for s in SPECS if s != "none"]


def rand(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (2, 3, 130), (0,), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_shape_dtype_preserved(spec, shape, dtype):
    """Every codec, called directly, round-trips shape and dtype, empty tensors included."""
    x = rand(shape, dtype)
    p = get_codec(spec).compress(x, seed=1)
    y = decode_payload(p)
    assert p.codec == spec.split(":")[0]
    assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "cpu"


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(0,), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_compressor_sends_empty_tensors_as_none(spec, shape, dtype):
    """Even with no size floor an empty tensor goes raw (no codec shrinks 0 bytes) and comes back as it left."""
    comp = Compressor(spec, min_bytes=0)
    x = torch.empty(shape, dtype=dtype)
    p = comp.compress("k", x)
    y = decode_payload(p)
    assert p.codec == "none" and p.nbytes == 0
    assert y.shape == x.shape and y.dtype == x.dtype
    assert comp.stats()["by_codec"] == {"none": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_none_exact(dtype):
    x = rand((17, 3), dtype)
    assert torch.equal(decode_payload(get_codec("none").compress(x)), x)


@pytest.mark.parametrize("name,dt", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("src", [torch.float32, torch.float64])
def test_half_casts_exact_within_dtype(name, dt, src):
    x = rand((1000,), src) * 100
    x[:4] = torch.tensor([0.0, -0.0, 1e-8, 65504.0], dtype=src)
    y = decode_payload(get_codec(name).compress(x))
    assert torch.equal(y, x.to(dt).to(src))


@given(st.integers(1, 3000), st.sampled_from([1, 7, 64, 4096]), st.integers(0, 2**31), st.floats(1e-3, 1e3))
@settings(max_examples=40, deadline=None)
def test_int8_error_within_half_scale(n, chunk, seed, mag):
    x = rand((n,), seed=seed % 1000) * mag
    p = get_codec(f"int8:chunk={chunk}").compress(x)
    y = decode_payload(p)
    nch = -(-n // chunk)
    scale = torch.frombuffer(bytearray(p.data[:4 * nch]), dtype=torch.float32)
    amax = torch.stack([x[i * chunk:(i + 1) * chunk].abs().max() for i in range(nch)])
    assert torch.allclose(scale, amax / 127, rtol=1e-6, atol=0)
    bound = scale.repeat_interleave(chunk)[:n] / 2
    # + float32 rounding of x/s and of q*s (half an ulp of |x| each; matters on exact .5 ties)
    assert ((x - y).abs() <= bound * (1 + 1e-5) + x.abs() * 2**-23 + 1e-30).all()


def test_int8_zero_chunk_and_rounding():
    x = torch.zeros(130)
    x[70] = 3.0
    y = decode_payload(get_codec("int8:chunk=64").compress(x))
    assert torch.equal(y, x)


def test_qsgd_unbiased_and_seeded():
    x = rand((256,)) * torch.linspace(0.01, 3, 256)
    c = get_codec("qsgd:levels=4,chunk=64")
    assert bytes(c.compress(x, seed=5).data) == bytes(c.compress(x, seed=5).data)
    assert bytes(c.compress(x, seed=5).data) != bytes(c.compress(x, seed=6).data)
    seeds = 2000
    mean = sum(decode_payload(c.compress(x, seed=s)) for s in range(seeds)) / seeds
    m = x.view(-1, 64).abs().amax(1).repeat_interleave(64)
    # per-element std of one sample <= m/levels/2
    assert ((mean - x).abs() <= 5 * (m / 4 / 2) / math.sqrt(seeds) + 1e-6).all()
    single = decode_payload(c.compress(x, seed=0))
    assert ((single - x).abs() <= m / 4 + 1e-6).all()  # one level at most


def test_sign_bits_and_scale():
    x = rand((1001,))
    p = get_codec("sign").compress(x)
    assert p.nbytes == 126
    y = decode_payload(p)
    assert math.isclose(p.header["scale"], float(x.abs().mean()), rel_tol=1e-5)
    assert torch.equal(y < 0, x < 0)
    assert torch.allclose(y.abs(), torch.full_like(y, p.header["scale"]))


def _brute_topk(x, k):
    a = x.abs().tolist()
    order = sorted(range(len(a)), key=lambda i: (-a[i], i))
    return sorted(order[:k])


@given(st.integers(1, 400), st.floats(0.001, 1.0), st.integers(0, 1000), st.booleans())
@settings(max_examples=60, deadline=None)
def test_topk_exact_k_largest_with_ties(n, ratio, seed, ties):
    x = rand((n,), seed=seed)
    if ties:
        x = (x * 3).round()  # many equal magnitudes
    k = max(1, math.ceil(ratio * n))
    p = get_codec(f"topk:ratio={ratio}").compress(x)
    assert p.header["k"] == min(k, n)
    idx = unpack_payload(p).indices.tolist()
    assert idx == _brute_topk(x, min(k, n))
    y = decode_payload(p)
    assert torch.equal(y[idx], x[idx]) and int((y != 0).sum()) <= len(idx)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2])
def test_topk_large_uses_sampling_path_and_is_exact(ratio):
    n = 300_001
    x = rand((n,), seed=3)
    x[::97] = 2.5  # a tie block around the threshold
    k = math.ceil(ratio * n)
    idx = topk_indices(x, k, seed=1)
    assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
    a = x.abs()
    vk = torch.topk(a, k).values[-1]
    assert bool((a[idx] >= vk).all()) and int((a > vk).sum()) <= k
    # ties taken from the lowest indices
    tied = torch.nonzero(a == vk).view(-1)
    chosen_tied = idx[a[idx] == vk]
    assert torch.equal(chosen_tied, tied[:chosen_tied.numel()])
    assert torch.equal(idx, topk_indices(x, k, seed=99))  # independent of the sample


def test_randk_indices_regenerated():
    x = rand((5000,))
    c = get_codec("randk:ratio=0.01")
    p = c.compress(x, seed=42)
    assert p.nbytes == 4 * 50 and p.header["seed"] == 42 and "enc" not in p.header
    y = decode_payload(p)
    nz = torch.nonzero(y).view(-1)
    assert nz.numel() == 50 and torch.equal(y[nz], x[nz])
    assert torch.equal(decode_payload(c.compress(x, seed=42)), y)
    assert not torch.equal(decode_payload(c.compress(x, seed=43)), y)


@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(0, 2**40))
@settings(max_examples=40, deadline=None)
def test_random_subset_distinct_in_range(n, k, seed):
    from compression.rng import random_subset
    k = min(n, k)
    idx = random_subset(n, k, seed)
    assert idx.numel() == k and int(idx[0]) >= 0 and int(idx[-1]) < n
    assert bool((idx[1:] > idx[:-1]).all())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("alpha", [1.0, -0.5])
def test_accumulate_equals_dense_add(spec, alpha):
    x = rand((40, 25), seed=7)
    p = get_codec(spec).compress(x, seed=3)
    base = rand((40, 25), seed=8)
    out = base.clone()
    accumulate_payload(p, out, alpha)
    assert torch.allclose(out, base + alpha * decode_payload(p), atol=1e-6)


@pytest.mark.parametrize("spec", ["chunktopk:density=0.03,chunk=256", "lowbit:bits=4,chunk=100"])
def test_the_shards_sum_of_round_payloads_equals_the_dense_sum(spec):
    """A round codec's pushes, scatter-added / accumulated as a shard does, sum exactly to their decoded values."""
    c = get_codec(spec)
    payloads = [c.compress(rand(10_000, seed=w)) for w in range(4)]
    acc = torch.zeros(10_000)
    for p in payloads:
        accumulate_payload(p, acc)                     # what a shard does with each worker's push
    dense = torch.zeros(10_000)
    for p in payloads:
        dense += decode_payload(p).view(-1)
    assert torch.equal(acc, dense)


@pytest.mark.parametrize("spec", SPECS)
def test_decompress_into_out(spec):
    x = rand((300,), seed=2)
    c = get_codec(spec)
    p = c.compress(x, seed=1)
    if spec == "none":
        return
    out = torch.full((300,), 7.0)
    assert torch.equal(c.decompress(p, out=out), decode_payload(p)) and torch.equal(out, decode_payload(p))


def test_dgc_momentum_masking_and_warmup():
    c = get_codec("dgc:ratio=0.01,momentum=0.5,warmup_steps=8")
    assert [c.density(s) for s in (0, 2, 4, 6, 8)] == [0.25, 0.0625, 0.015625, 0.01, 0.01]
    x = rand((1000,), seed=1)
    p = c.compress(x, key="w")
    assert p.header["k"] == 250
    sent = decode_payload(p)
    idx = torch.nonzero(sent).view(-1)
    assert torch.equal(sent[idx], x[idx])  # step 1: v = u = g
    v = c.residual("w").clone()
    assert torch.equal(v[idx], torch.zeros(len(idx))) and torch.equal(v + sent, x)
    p2 = c.compress(x, key="w")
    # u masked where sent: u2 = 0.5*u1*(1-mask) + x ; v2 = v1 + u2
    u1 = x.clone()
    u1[idx] = 0
    expect_v = v + 0.5 * u1 + x
    assert torch.allclose(decode_payload(p2) + c.residual("w"), expect_v, atol=1e-6)
    assert c.residual("other") is None


def test_dgc_clipping_limits_norm():
    c = get_codec("dgc:ratio=1.0,momentum=0.0,clip=1.0")
    y = decode_payload(c.compress(rand((500,)) * 10, key="k"))
    assert abs(float(y.norm()) - 1.0) < 1e-3


def _corruptions(p: Payload):
    yield "cut body", dataclasses.replace(p, data=bytes(p.data)[:-1])
    yield "extra byte", dataclasses.replace(p, data=bytes(p.data) + b"\0")
    yield "wrong shape", dataclasses.replace(p, shape=(p.numel + 8,))
    yield "bad dtype", dataclasses.replace(p, dtype="complex64")
    yield "negative dim", dataclasses.replace(p, shape=(-1,))
    for k, _v in p.header.items():
        yield f"missing {k}", dataclasses.replace(p, header={a: b for a, b in p.header.items() if a != k})
        yield f"bad {k}", dataclasses.replace(p, header={**p.header, k: "x"})
        yield f"negative {k}", dataclasses.replace(p, header={**p.header, k: -3})


@pytest.mark.parametrize("spec", SPECS)
def test_decoders_reject_corrupt_payloads(spec):
    p = get_codec(spec).compress(rand((64, 4), seed=4), seed=2)
    for what, bad in _corruptions(p):
        with pytest.raises(CodecError):
            decode_payload(bad)
            pytest.fail(f"{spec}: accepted {what}")
        with pytest.raises(CodecError):
            accumulate_payload(bad, torch.zeros(p.numel))


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "dgc:ratio=0.1"])
@pytest.mark.parametrize("enc", ["u16", "bp"])
def test_sparse_rejects_bad_indices(spec, enc):
    from compression.wire import bitpack
    p = get_codec(spec).compress(rand((100,)), seed=0)
    k = p.header["k"]
    vals = bytes(p.data)[:4 * k]
    for bad_idx in ([100] + list(range(1, k)), [5] * k, list(range(k))[::-1], list(range(k - 1)) + [1000]):
        if enc == "u16":
            header = {"k": k, "n": 100, "enc": "u16"}
            body = vals + torch.tensor(bad_idx, dtype=torch.int32).numpy().astype("<u2").tobytes()
        else:  # gaps minus one that run past n (wrapped ones are caught as out of range too)
            d = torch.tensor(bad_idx).diff().sub(1).remainder(1 << 10).numpy().astype("uint64")
            if bad_idx[0] >= 100:
                continue  # i0 out of range is a header error, tested below
            header = {"k": k, "n": 100, "enc": "bp", "bits": 10, "i0": bad_idx[0]}
            body = vals + bitpack(d, 10).tobytes()
        bad = dataclasses.replace(p, data=body, header=header)
        with pytest.raises(CodecError, match="indices"):
            decode_payload(bad)
        with pytest.raises(CodecError, match="indices"):
            accumulate_payload(bad, torch.zeros(100))
        with pytest.raises(CodecError, match="indices"):
            unpack_payload(bad)


def test_unknown_codec_and_bad_spec():
    with pytest.raises(CodecError, match="unknown codec"):
        decode_payload(Payload("zstd9", (3,), "float32", b"\0" * 12))
    for spec in ["topk:ratio=2", "int8:chunk=0", "qsgd:levels=300", "nope", "topk:foo=1",
                 # accepted once, then every push failed on the shard (a bool header) or in msgpack (a huge int);
                 # a NaN clip turned clipping off; a repeated key silently kept the last value
                 "int8:chunk=true", "qsgd:levels=true", "int8:chunk=100000000000000000000", "dgc:clip=nan",
                 "dgc:warmup_steps=true", "topk:ratio=0.1,ratio=0.9"]:
        with pytest.raises(CodecError):
            get_codec(spec)


def test_integer_tensors_rejected_by_lossy_codecs():
    with pytest.raises(CodecError):
        get_codec("int8").compress(torch.arange(10))


TINY = torch.finfo(torch.float32).tiny     # smallest normal float32; below it, 1 / x overflows


@pytest.mark.parametrize("spec", ["lowbit:bits=2,chunk=64", "lowbit:bits=4,chunk=64", "chunktopk:density=0.25,chunk=64",
                                  "lowrank:rank=2", "lowrank:rank=2,bits=8", "int8:chunk=64", "qsgd:levels=16,chunk=64"])
@pytest.mark.parametrize("shape", [(256,), (32, 16)])
def test_subnormal_chunks_stay_finite_and_error_feedback_loses_nothing(spec, shape):
    """A dead unit's rows after many Adam steps hold subnormal deltas: a chunk (or the whole tensor) whose largest
    |x| is below float32's smallest normal must encode to finite values and leave a finite residual — a scale whose
    reciprocal overflowed once turned 0 x inf into NaN in the residual and killed a 2-bit job at round 78."""
    x = rand(shape, seed=3).mul_(1e-3)
    flat = x.view(-1)
    flat[:64] = torch.linspace(-1, 1, 64) * (TINY / 4)       # one chunk of subnormals ...
    flat[28:36] = 0.0                                        # ... and zeros among them (0 x inf)
    whole = torch.full(shape, TINY / 8)                      # a tensor of nothing but subnormals and zeros
    whole.view(-1)[::3] = 0.0
    for t in (x, whole):
        ef = ErrorFeedback(get_codec(spec))
        sent = torch.zeros(t.numel(), dtype=torch.float64)
        for r in range(3):
            sent += decode_payload(ef.compress(t, seed=r, key="k")).view(-1).double()
            residual = ef.residual("k")
            assert torch.isfinite(sent).all() and torch.isfinite(residual).all(), f"round {r}"
        assert torch.allclose(sent + residual.double(), 3 * t.view(-1).double(), rtol=0, atol=1e-9)
