"""lowbit: dense 2/4-bit codes with per-chunk absmax scales and error feedback (compression/codecs/lowbit.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import CodecError, ErrorFeedback, Payload, accumulate_payload, decode_payload, get_codec
from compression.codecs.lowbit import pack_codes, unpack_codes
from compression.wire import bitpack
from deltaps.pull_codec import resolve_pull_codec


def rand(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 4]), st.integers(0, 300))
def test_packing_is_wire_bitpacks_stream_and_round_trips(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_codes(codes, bits)
    assert np.array_equal(packed.numpy(), bitpack(codes.numpy().astype(np.uint64), bits))
    assert torch.equal(unpack_codes(packed, n, bits), codes)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (1000, 128), (5, 1)])
def test_error_within_scale_over_levels_and_the_tail_chunk_has_its_own_scale(bits, n, chunk):
    x = rand(n, seed=n)
    x[-1] = 50.0 if n > chunk else x[-1]          # a huge value in the tail chunk must not coarsen the others
    codec = get_codec(f"lowbit:bits={bits},chunk={chunk}")
    p = codec.compress(x)
    assert p.nbytes == codec.wire_nbytes(n, torch.float32) == 4 * -(-n // chunk) + -(-n * bits // 8)
    y = decode_payload(p)
    levels = (1 << bits) - 1
    for a in range(0, n, chunk):
        scale = x[a:a + chunk].abs().max()
        assert (x[a:a + chunk] - y[a:a + chunk]).abs().max() <= scale / levels * (1 + 1e-6)


def test_levels_are_odd_multiples_of_the_scale_and_a_zero_chunk_decodes_to_zeros():
    codec = get_codec("lowbit:bits=2,chunk=4")
    x = torch.tensor([3.0, -3.0, 1.0, 0.2, 0.0, 0.0, 0.0, 0.0])
    y = decode_payload(codec.compress(x))
    assert torch.allclose(y[:4], torch.tensor([3.0, -3.0, 1.0, 1.0]))       # +-s/3, +-s: no zero level
    assert torch.equal(y[4:].abs(), torch.zeros(4))


def test_four_bits_cost_an_eighth_of_fp32_and_two_bits_a_sixteenth():
    n = 648_202
    for bits, fraction in ((4, 1 / 8), (2, 1 / 16)):
        got = get_codec(f"lowbit:bits={bits}").wire_nbytes(n, torch.float32) / (4 * n)
        assert fraction < got < fraction * 1.07      # + one float32 scale per 512 values


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_by_name(bad):
    x = rand(100)
    x[37] = bad
    with pytest.raises(CodecError, match="lowbit: the tensor holds NaN or Inf"):
        get_codec("lowbit").compress(x)


@pytest.mark.parametrize("spec,match", [("lowbit:bits=3", "bits must be an int, one of"), ("lowbit:bits=8", "bits must be"),
                                        ("lowbit:bits=4.0", "bits must be an int"),     # (1 << 4.0) fails later
                                        ("lowbit:chunk=0", "chunk must be an int in"),
                                        ("lowbit:chunk=65537", "chunk must be an int in"),
                                        ("lowbit:chunk=1.5", "chunk must be")])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(CodecError, match=match):
        get_codec(spec)


def test_corrupt_headers_and_scales_are_codec_errors():
    p = get_codec("lowbit:chunk=8").compress(rand(40))
    for header, match in (({**p.header, "bits": 3}, "bits=3"), ({**p.header, "bits": 8}, "bits"),
                          ({**p.header, "chunk": 0}, "chunk"), ({**p.header, "chunk": 1 << 33}, "chunk")):
        with pytest.raises(CodecError, match=match):
            decode_payload(Payload(p.codec, p.shape, p.dtype, p.data, header))
    body = bytearray(p.data)
    body[0:4] = np.float32(np.nan).tobytes()
    with pytest.raises(CodecError, match="scale in the payload is negative, NaN or Inf"):
        decode_payload(Payload(p.codec, p.shape, p.dtype, bytes(body), p.header))
    with pytest.raises(CodecError, match="40 elements, out has 39"):
        accumulate_payload(p, torch.zeros(39))


def test_error_feedback_loses_nothing_over_rounds():
    ef = ErrorFeedback(get_codec("lowbit:bits=2,chunk=256"))
    total = torch.zeros(20_000, dtype=torch.float64)
    sent = torch.zeros_like(total)
    for r in range(25):
        g = rand(20_000, seed=r)
        total += g.double()
        sent += decode_payload(ef.compress(g, key="w")).double()
    assert (total - sent - ef.residual("w").double()).abs().max() < 1e-4     # sent + carried == every delta
    assert ef.residual("w").abs().max() < 2.0       # carried, not piling up


@pytest.mark.parametrize("spec", ["lowbit", "lowbit:bits=2,chunk=100"])
def test_the_sender_subtracts_exactly_what_the_receiver_decodes(spec):
    x, residual = rand(1234, seed=3), rand(1234, seed=4)
    want = residual - decode_payload(get_codec(spec).compress(x)).view(-1)
    get_codec(spec).compress_leaving(x, residual)
    assert torch.equal(residual, want)


def test_it_pulls_as_it_pushes():
    assert resolve_pull_codec("auto", "lowbit") == "lowbit:bits=4,chunk=512"
    assert resolve_pull_codec("auto", "lowbit:bits=2,chunk=64") == "lowbit:bits=2,chunk=64"


def test_deltaps_advise_learns_its_cost():
    """The calibration measures lowbit like any codec, and the cost model prices a lowbit round at its bytes."""
    from deltaps.tools import costmodel as cm
    from deltaps.tools.advise.probes import probe_codecs
    pushes = ["lowbit:bits=2", "int8"]      # + the pull codecs they resolve to, as `deltaps advise --calibrate` does
    speeds = probe_codecs(4 * 65_536, sorted(set(pushes) | {cm.pull_codec_for(c) for c in pushes}), repeats=2)
    assert 15 < speeds["lowbit:bits=2"]["ratio"] < 16 and 3.9 < speeds["int8"]["ratio"] < 4
    cal = cm.Calibration(bandwidth_Bps=1.25e7, alpha_s=1e-4, rpc_s=1e-4, grpc_Bps=float("inf"), fwd_bwd_s={1: 0.01},
                         bwd_fraction=0.0, optimizer_s={},
                         codecs={c: cm.CodecSpeed(s["compress_Bps"], s["decompress_Bps"], s["ratio"])
                                 for c, s in speeds.items()})
    job = cm.Job(tensors=[("w", 1 << 20)], workers=4, shards=4)
    two_bit, int8 = (cm.predict(cal, job, f"ps-local32:{c}") for c in ("lowbit:bits=2", "int8"))
    assert two_bit["push_ratio"] == speeds["lowbit:bits=2"]["ratio"]
    assert two_bit["pull_ratio"] == speeds["lowbit:bits=2,chunk=512"]["ratio"]       # pulls as it pushes
    assert two_bit["step_s"] < int8["step_s"]       # 100 Mbit/s: a quarter of int8's bytes per round
