"""Compact index sections of the sparse codecs (u16 / delta + bit-packing), see compression.wire."""
import dataclasses
import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import CodecError, accumulate_payload, decode_payload, get_codec, unpack_payload, wire
from compression.codecs.sparse import SparseCodec


def _ref_pack(d, bits):
    s = 0
    for i, x in enumerate(int(v) for v in d):
        s |= x << (i * bits)
    return s.to_bytes(wire.packed_nbytes(len(d), bits), "little")


def _ref_kernel_words(d, bits):
    """The CuPy 'bitpack' kernel, one output word per i, in plain Python (same loop bounds)."""
    m = len(d)
    out = []
    for i in range(-(-(m * bits) // 64)):
        lo = i * 64
        j, last = lo // bits, min(m - 1, (lo + 63) // bits)
        acc = 0
        while j <= last:
            s = j * bits - lo
            acc |= ((int(d[j]) << s) if s >= 0 else (int(d[j]) >> -s)) & ((1 << 64) - 1)
            j += 1
        out.append(acc)
    return np.array(out, dtype="<u8").view(np.uint8)[:wire.packed_nbytes(m, bits)].tobytes()


@pytest.mark.parametrize("bits", list(range(1, 32)))
def test_bitpack_matches_reference_and_kernel(bits):
    g = np.random.default_rng(bits)
    for m in (1, 2, 3, 5, 63, 64, 65, 129, 1000):
        d = g.integers(0, 1 << bits, m, dtype=np.uint64)
        d[:2] = (1 << bits) - 1  # all-ones values hit every spill
        packed = wire.bitpack(d, bits)
        assert packed.tobytes() == _ref_pack(d, bits) == _ref_kernel_words(d, bits)
        assert np.array_equal(wire.bitunpack(packed, m, bits), d)


def _sparse_payload(idx, n, dtype=torch.float32, spec="topk:ratio=0.5"):
    """A payload for exactly these indices via the codec's own encoder."""
    codec = get_codec(spec)
    x = torch.arange(1, n + 1, dtype=dtype)
    return codec._encode(x, torch.as_tensor(idx, dtype=torch.int64), x, {}), x


def _check_roundtrip(idx, n, dtype=torch.float32):
    p, x = _sparse_payload(idx, n, dtype)
    d = unpack_payload(p)
    assert d.indices.dtype in (torch.int32, torch.int64)
    assert d.indices.tolist() == list(idx)
    assert torch.equal(d.values, x[list(idx)])
    out = torch.zeros(n, dtype=dtype)
    d.add_to(out)
    accumulate_payload(p, out)
    expect = torch.zeros(n, dtype=dtype)
    expect[list(idx)] = 2 * x[list(idx)]
    assert torch.equal(out, expect)
    msgpack.packb(p.header)  # header stays msgpack-able
    return p


@pytest.mark.parametrize("n", [65535, 65536, 65537, 70000])
@pytest.mark.parametrize("pattern", ["ends", "dense", "spread", "one", "two_far"])
def test_roundtrip_around_u16_limit(n, pattern):
    idx = {"ends": [0, 1, n // 2, n - 2, n - 1], "dense": list(range(n - 3000, n)),
           "spread": list(range(3, n, 97)), "one": [n - 1], "two_far": [0, n - 1]}[pattern]
    p = _check_roundtrip(idx, n)
    assert p.header["enc"] in ("u16", "bp")
    if n > 65536:
        assert p.header["enc"] == "bp"
    if pattern == "dense":
        assert p.header["bits"] == 1 and p.nbytes == 4 * 3000 + wire.packed_nbytes(2999, 1)
    if pattern == "two_far" and n <= 65536:
        assert p.header["enc"] == "u16" and p.nbytes == 8 + 4  # u16 beats bits=16 + header fields


def test_u16_chosen_only_when_smaller_on_the_wire():
    for n in (10, 1000, 65536, 65537):
        for k in (1, 2, 5, 9, 40):
            idx = np.unique(np.linspace(0, n - 1, k).astype(np.int64))
            p, _ = _sparse_payload(idx, n)
            base = {"k": len(idx), "n": n}
            bits = wire.gap_bits(int(np.diff(idx).max()) - 1 if len(idx) > 1 else 0)
            cost_u16 = 2 * len(idx) + len(msgpack.packb({**base, "enc": "u16"}))
            cost_bp = (wire.packed_nbytes(len(idx) - 1, bits)
                       + len(msgpack.packb({**base, "enc": "bp", "bits": bits, "i0": int(idx[0])})))
            want = "u16" if n <= 65536 and cost_u16 <= cost_bp else "bp"
            assert p.header["enc"] == want, (n, k, cost_u16, cost_bp)
            assert len(msgpack.packb(p.header)) + p.nbytes - 4 * len(idx) == min(
                cost_bp, cost_u16 if n <= 65536 else cost_bp)


@st.composite
def sparsity(draw):
    n = draw(st.one_of(st.integers(1, 70_000), st.integers(65_000, 2_000_000), st.just(65536)))
    kind = draw(st.sampled_from(["uniform", "clusters", "huge_gap", "edges"]))
    seed = draw(st.integers(0, 2**32 - 1))
    g = np.random.default_rng(seed)
    if kind == "uniform":
        idx = g.choice(n, size=min(n, draw(st.integers(1, 3000))), replace=False)
    elif kind == "clusters":
        starts = g.integers(0, n, draw(st.integers(1, 20)))
        idx = np.concatenate([np.arange(s, min(n, s + g.integers(1, 300))) for s in starts])
    elif kind == "huge_gap":
        idx = np.array([0, n - 1] + list(g.integers(0, max(1, n // 1000), 50)))
    else:
        idx = np.array([0, n - 1])
    return n, sorted(set(int(i) for i in idx if 0 <= i < n))


@given(sparsity(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
@settings(max_examples=80, deadline=None)
def test_random_sparsity_roundtrip(case, dtype):
    n, idx = case
    p = _check_roundtrip(idx, n, dtype)
    vb = torch.empty((), dtype=dtype).element_size()
    assert p.nbytes == vb * len(idx) + (2 * len(idx) if p.header["enc"] == "u16"
                                        else wire.packed_nbytes(len(idx) - 1, p.header["bits"]))
    assert wire.index_nbytes_bound(n, len(idx)) >= p.nbytes - vb * len(idx)


@given(st.integers(1, 300_000), st.floats(1e-4, 1.0), st.integers(0, 1000),
       st.sampled_from(["topk", "dgc"]))
@settings(max_examples=40, deadline=None)
def test_wire_nbytes_is_an_upper_bound(n, ratio, seed, name):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if seed % 3 == 0:
        x[: n // 2] = 0  # all mass in one half: one huge gap
    c = get_codec(f"{name}:ratio={ratio}")
    p = c.compress(x, seed=seed, key="w")
    assert p.nbytes <= c.wire_nbytes(n, x.dtype)
    assert torch.equal(decode_payload(p), decode_payload(dataclasses.replace(p, data=bytes(p.data))))


def _bp_payload(n=200_000, k=500):
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    p = get_codec(f"topk:ratio={k / n}").compress(x)
    assert p.header["enc"] == "bp" and p.header["k"] == k
    return p


def test_corrupt_bp_header_and_body_rejected():
    p = _bp_payload()
    bits, k = p.header["bits"], p.header["k"]
    cases = {
        "bits 0": {**p.header, "bits": 0}, "bits 32": {**p.header, "bits": 32},
        "bits float": {**p.header, "bits": 3.0}, "bits bool": {**p.header, "bits": True},
        "bits -1": {**p.header, "bits": bits - 1}, "bits +1": {**p.header, "bits": bits + 1},
        "i0 = n": {**p.header, "i0": p.header["n"]}, "no i0": {a: b for a, b in p.header.items() if a != "i0"},
        "enc u16 n>65536": {**p.header, "enc": "u16"}, "enc i32": {**p.header, "enc": "i32"},
        "enc None": {**p.header, "enc": None}, "no enc": {a: b for a, b in p.header.items() if a != "enc"},
        "k-1": {**p.header, "k": k - 1},
    }
    for what, header in cases.items():
        bad = dataclasses.replace(p, header=header)
        for fn in (decode_payload, unpack_payload, lambda q: accumulate_payload(q, torch.zeros(q.numel))):
            with pytest.raises(CodecError):
                fn(bad)
                pytest.fail(f"accepted {what}")
    raw = bytes(p.data)
    for what, body in {"truncated": raw[:-1], "extended": raw + b"\0", "empty": b"",
                       "values only": raw[:4 * k]}.items():
        with pytest.raises(CodecError):
            unpack_payload(dataclasses.replace(p, data=body))
            pytest.fail(f"accepted {what}")
    # a large gap that runs past n
    body = bytearray(raw)
    body[4 * k:] = b"\xff" * (len(raw) - 4 * k)
    with pytest.raises(CodecError):
        unpack_payload(dataclasses.replace(p, data=bytes(body)))


def test_nonzero_padding_bits_rejected():
    idx = [0, 5, 9]  # 2 gaps at 3 bits: 6 of 8 bits used
    p, _ = _sparse_payload(idx, 70_000)
    assert p.header["enc"] == "bp" and p.header["bits"] == 3
    body = bytearray(p.data)
    body[-1] |= 0x80
    with pytest.raises(CodecError, match="padding"):
        decode_payload(dataclasses.replace(p, data=bytes(body)))


def test_u16_payload_validated():
    p, _ = _sparse_payload([0, 65535], 65536)
    assert p.header["enc"] == "u16"
    with pytest.raises(CodecError, match="u16"):
        decode_payload(dataclasses.replace(p, shape=(65537,), header={**p.header, "n": 65537}))
    body = bytearray(p.data)
    body[-4:] = np.array([7, 7], "<u2").tobytes()
    with pytest.raises(CodecError, match="indices"):
        decode_payload(dataclasses.replace(p, data=bytes(body)))


@pytest.mark.parametrize("n", [16384, 65536, 1 << 20])
def test_topk_bytes_per_kept_element(n):
    """topk 1 %: 4 value bytes + under 2 index bytes per kept element (int32 indices: 8)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    p = get_codec("topk:ratio=0.01").compress(x)
    k = p.header["k"]
    per = p.nbytes / k
    assert p.header["enc"] == "bp" and per < 6.0, (n, p.header, per)
    assert n * 4 / p.nbytes > 66


def test_sparse_codecs_share_decoder():
    assert all(isinstance(get_codec(s), SparseCodec) for s in ("topk", "dgc", "randk"))
    p = _bp_payload()
    dgc_like = dataclasses.replace(p, codec="dgc")
    assert torch.equal(decode_payload(dgc_like), decode_payload(p))


@pytest.mark.parametrize("n,idx", [((1 << 31) - 1, [0, (1 << 31) - 2]), ((1 << 31) - 1, [5, 6, 1 << 30, (1 << 31) - 2]),
                                   (1 << 20, [1 << 19]), (65537, list(range(0, 65537, 2)))])
def test_index_section_extremes(n, idx):
    """Index encoding alone (no n-element tensor): up to 31-bit gaps at the int32 limit."""
    from compression import Payload
    a = np.array(idx, dtype=np.int64)
    hdr, sec = wire.encode_indices(a, n)
    k = len(idx)
    p = Payload("topk", (n,), "float32", b"", {"k": k, "n": n, **hdr})
    enc, bits, i0, nbytes = wire.index_section(p, n, k)
    assert nbytes == sec.size and (enc != "bp" or bits == wire.gap_bits(int(np.diff(a).max(initial=1)) - 1))
    got = wire.decode_indices(p, n, k, enc, bits, i0, torch.from_numpy(sec.copy()))
    assert got.tolist() == idx


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000).flatmap(lambda u: st.tuples(st.just(u), st.sets(st.integers(0, u - 1), max_size=u))))
def test_elias_fano_round_trip_and_size(case):
    universe, chosen = case
    values = np.array(sorted(chosen), dtype=np.int64)
    lows, highs = wire.ef_encode(values, universe)
    k = values.size
    assert [lows.size, highs.size] == [count for _, count in wire.ef_sections(universe, k)]
    assert np.array_equal(wire.ef_decode("t", torch.from_numpy(lows), torch.from_numpy(highs), k, universe), values)
    if k:   # at most 2 + ceil(log2(universe / k)) bits a value, padding aside
        low = wire.ef_low_bits(universe, k)
        assert low * k + wire.ef_high_nbits(universe, k) <= k * (2 + max(0, math.ceil(math.log2(universe / k)))) + 1


@pytest.mark.parametrize("universe", [1, 2, 7, 64, 100, 1000, 4096])
def test_elias_fano_bits_grow_with_the_count(universe):
    """chunktopk's wire_nbytes bounds a payload by its full quota (+1 byte for the sections' rounding)."""
    bits = [wire.ef_low_bits(universe, k) * k + wire.ef_high_nbits(universe, k) for k in range(universe + 1)]
    assert bits == sorted(bits)
