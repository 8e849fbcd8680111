"""chunktopk, the local-update round codec: its layout's edge cases, what it refuses, error feedback losing
nothing over rounds, and the shards' sum of sparse contributions against a dense reference."""
import math

import pytest
import torch

from compression import CodecError, ErrorFeedback, Payload, accumulate_payload, decode_payload, get_codec
from compression.codecs.chunktopk import ChunkTopKCodec
from deltaps.pull_codec import resolve_pull_codec


def sent_per_chunk(payload: Payload, chunk: int) -> list[int]:
    n = payload.header["n"]
    idx = torch.nonzero(decode_payload(payload).view(-1)).view(-1)
    return torch.bincount(idx // chunk, minlength=-(-n // chunk)).tolist()


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("bits", [2, 4])
def test_quota_per_chunk_tail_included_and_the_chunk_max_exact(n, bits):
    c = ChunkTopKCodec(density=0.1, chunk=64, bits=bits)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) + 0.01   # no exact zeros
    p = c.compress(x)
    d = decode_payload(p).view(-1)
    want = [math.ceil(0.1 * min(64, n - i)) for i in range(0, n, 64)]
    assert sent_per_chunk(p, 64) == want
    for i in range(0, n, 64):                       # the largest |x| of each chunk is its scale: sent exactly
        j = i + int(x[i:i + 64].abs().argmax())
        assert d[j] == x[j]
    assert p.nbytes <= c.wire_nbytes(n, torch.float32)


def test_zeros_are_never_sent_and_a_zero_chunk_costs_its_header_only():
    c = ChunkTopKCodec(density=0.25, chunk=16)
    x = torch.zeros(48)
    x[20], x[40:43] = 3.0, torch.tensor([-1.0, 2.0, 0.5])
    p = c.compress(x)
    assert sent_per_chunk(p, 16) == [0, 1, 3]
    d = decode_payload(p)
    assert d[20] == 3.0 and torch.count_nonzero(d) == 4 and d[:16].abs().sum() == 0


def test_levels_are_odd_multiples_of_the_scale_over_L():
    x = torch.tensor([3.0, -3.0, 1.0, -1.0, 2.1, -0.1])
    d = decode_payload(ChunkTopKCodec(density=1.0, chunk=8, bits=2).compress(x))
    assert d.tolist() == [3.0, -3.0, 1.0, -1.0, 3.0, -1.0]      # levels +-1, +-3 of scale 3 / 3
    d4 = decode_payload(ChunkTopKCodec(density=1.0, chunk=8, bits=4).compress(x))
    assert ((d4 - x).abs() <= 3.0 / 15 + 1e-6).all()


def test_defaults_cost_under_one_percent_of_fp32():
    p = get_codec("chunktopk").compress(torch.randn(1 << 20))
    assert 0.0070 < p.nbytes / (4 << 20) < 0.0074, p.nbytes          # 64 of 4096 x (12 + 2) bits + 6 B per chunk


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_by_name(bad):
    x = torch.randn(100)
    x[37] = bad
    with pytest.raises(CodecError, match="chunktopk: the tensor holds NaN or Inf"):
        get_codec("chunktopk").compress(x)


@pytest.mark.parametrize("spec,match", [("chunktopk:density=0", "density must be in"),
                                        ("chunktopk:chunk=1", "chunk must be an int"),
                                        ("chunktopk:chunk=32768", "chunk must be an int"),
                                        ("chunktopk:bits=3", "bits must be one of")])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(CodecError, match=match):
        get_codec(spec)


def _tampered(p: Payload, offset: int, value: bytes) -> Payload:
    body = bytearray(bytes(p.data))
    body[offset:offset + len(value)] = value
    return Payload(p.codec, p.shape, p.dtype, bytes(body), p.header)


def test_corrupt_counts_positions_and_headers_are_codec_errors():
    c = ChunkTopKCodec(density=0.1, chunk=64)
    p = c.compress(torch.randn(100) + 0.01)            # chunks of 64 and 36; counts at bytes 8..11
    with pytest.raises(CodecError, match="count is negative or exceeds"):
        decode_payload(_tampered(p, 8, (65).to_bytes(2, "little")))
    with pytest.raises(CodecError, match="count is negative or exceeds"):
        decode_payload(_tampered(p, 10, (37).to_bytes(2, "little")))
    # positions start at byte 12, 6 bits each: entries 0-6 are the first chunk's, 7-10 the 36-element tail's
    with pytest.raises(CodecError, match="position lies outside its chunk"):
        decode_payload(_tampered(p, 12 + 6, b"\xff" * 3))         # entries 8-10 -> position 63
    with pytest.raises(CodecError, match="not strictly ascending"):        # entry 1 = entry 0's position
        decode_payload(_tampered(p, 12, bytes(2)))
    for header, match in (({"bits": 3}, "bits=3"), ({"n": 99}, "does not match shape"), ({"chunk": 1}, "chunk")):
        with pytest.raises(CodecError, match=match):
            decode_payload(Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, **header}))
    with pytest.raises(CodecError, match="truncated or corrupt"):
        decode_payload(Payload(p.codec, p.shape, p.dtype, bytes(p.data)[:-1], p.header))


def test_error_feedback_loses_nothing_over_rounds():
    ef = ErrorFeedback(get_codec("chunktopk:density=0.02,chunk=1024,bits=2"))
    total = torch.zeros(50_000, dtype=torch.float64)
    sent = torch.zeros_like(total)
    for r in range(25):
        g = torch.randn(50_000, generator=torch.Generator().manual_seed(r))
        total += g.double()
        sent += decode_payload(ef.compress(g, key="w")).double()
    assert (total - sent - ef.residual("w").double()).abs().max() < 1e-4     # sent + carried == every delta


def test_the_shards_sum_of_sparse_contributions_equals_the_dense_sum():
    c = get_codec("chunktopk:density=0.03,chunk=256")
    payloads = [c.compress(torch.randn(10_000, generator=torch.Generator().manual_seed(w))) for w in range(4)]
    acc = torch.zeros(10_000)
    for p in payloads:
        accumulate_payload(p, acc)                     # what a shard does with each worker's push
    dense = torch.zeros(10_000)
    for p in payloads:
        dense += decode_payload(p).view(-1)
    assert torch.equal(acc, dense)


def test_a_round_codec_pulls_as_it_pushes():
    assert resolve_pull_codec("auto", "chunktopk:density=0.02") == "chunktopk:density=0.02,chunk=4096,bits=2"
    assert resolve_pull_codec("int8", "chunktopk") == "int8"
