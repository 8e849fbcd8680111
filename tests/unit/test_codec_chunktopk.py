"""chunktopk, the local-update round codec: its layout's edge cases, what it refuses, error feedback losing
nothing over rounds, and the shards' sum of sparse contributions against a dense reference."""
import math

import numpy as np
import pytest
import torch

from compression import CodecError, ErrorFeedback, Payload, decode_payload, get_codec
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


@pytest.mark.parametrize("n", [100, 4097])
def test_ties_at_the_threshold_still_send_exactly_the_quota(n):
    c = ChunkTopKCodec(density=0.1, chunk=64)
    x = torch.ones(n)
    x[::3] = -1.0
    x[5] = 0.0                                         # a zero is never sent, even among ties
    p = c.compress(x)
    assert sent_per_chunk(p, 64) == [math.ceil(0.1 * min(64, n - i)) for i in range(0, n, 64)]
    d = decode_payload(p).view(-1)
    assert d[5] == 0 and torch.equal(d[d != 0], x[d != 0])       # every tie sent exactly (levels +-scale)


@pytest.mark.parametrize("density,bits", [(1 / 64, 2), (0.25, 4), (0.1, 2)])
def test_the_error_feedback_update_is_the_generic_one_without_parsing(density, bits):
    """compress_leaving subtracts the values the encoder knows; the base Codec's way decodes the payload: the same
    residual to the bit, so the shards add exactly what the worker's error feedback took out."""
    from compression.base import Codec
    c = ChunkTopKCodec(density=density, chunk=256, bits=bits)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    fast, generic = x.clone(), x.clone()
    p = c.compress_leaving(x, fast)
    q = Codec.compress_leaving(c, x, generic)
    assert bytes(p.data) == bytes(q.data) and p.header == q.header
    assert torch.equal(fast, generic)


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


def test_defaults_cost_about_half_a_percent_of_fp32():
    p = get_codec("chunktopk").compress(torch.randn(1 << 20))
    # 16,384 sent: Elias-Fano 6 low bits + 2 high bits each, 2-bit codes, a float32 scale per 4096 chunk
    assert p.nbytes == 16384 * (6 + 2 + 2) // 8 + 256 * 4, p.nbytes
    assert p.nbytes / (4 << 20) < 0.0052


@pytest.mark.parametrize("density,bits_per_sent", [(1 / 64, 8 + 2), (1 / 8, 5 + 2), (1 / 4, 4 + 2)])
def test_positions_cost_two_plus_log2_inverse_density_bits(density, bits_per_sent):
    n = 144 * 4096                                     # the clf model's 768 x 768 weight
    p = ChunkTopKCodec(density=density).compress(torch.randn(n) + 0.01)
    sent = p.header["sent"]
    assert sent == 144 * math.ceil(density * 4096)
    assert p.nbytes == sent * bits_per_sent // 8 + 144 * 4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_by_name(bad):
    x = torch.randn(100)
    x[37] = bad
    with pytest.raises(CodecError, match="chunktopk: the tensor holds NaN or Inf"):
        get_codec("chunktopk").compress(x)


@pytest.mark.parametrize("spec,match", [("chunktopk:density=0", "density must be in"),
                                        ("chunktopk:chunk=1", "chunk must be an int"),
                                        ("chunktopk:chunk=32768", "chunk must be an int"),
                                        ("chunktopk:bits=3", "bits must be an int, one of"),
                                        ("chunktopk:bits=2.0", "bits must be an int")])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(CodecError, match=match):
        get_codec(spec)


def _tampered(p: Payload, offset: int, value: bytes) -> Payload:
    body = bytearray(bytes(p.data))
    body[offset:offset + len(value)] = value
    return Payload(p.codec, p.shape, p.dtype, bytes(body), p.header)


def _with_high_bits(p: Payload, offset: int, nbits: int, edit) -> Payload:
    """p with its Elias-Fano high-bit vector (nbits at byte offset) passed through edit(bit array)."""
    nbytes = -(-nbits // 8)
    high = np.unpackbits(np.frombuffer(bytes(p.data)[offset:offset + nbytes], np.uint8), count=nbits,
                         bitorder="little")
    edit(high)
    return _tampered(p, offset, np.packbits(high, bitorder="little").tobytes())


def test_corrupt_positions_and_headers_are_codec_errors():
    c = ChunkTopKCodec(density=0.1, chunk=64)
    x = torch.zeros(100)
    x[[0, 3, 9, 20, 33, 40, 63, 64, 70, 71, 99]] = torch.arange(1.0, 12.0)    # chunks of 64 and 36: 7 + 4 sent
    p = c.compress(x)
    # sections: 2 float32 scales | 11 x 3 low bits (floor(log2(100 / 11))) = 5 B | 11 + 12 + 1 = 24 high bits | codes
    assert p.header["sent"] == 11 and p.nbytes == 8 + 5 + 3 + 3
    low, high = 8, 13

    def set_spare(bits):                               # one set bit more than the header's count
        bits[np.flatnonzero(bits == 0)[0]] = 1

    def clear_first(bits):
        bits[np.flatnonzero(bits)[0]] = 0

    def last_past_the_end(bits):                       # the last high part 13: positions from 104 on
        bits[np.flatnonzero(bits)[-1]] = 0
        bits[-1] = 1

    with pytest.raises(CodecError, match="holds 12 set bits, the header says 11"):
        decode_payload(_with_high_bits(p, high, 24, set_spare))
    with pytest.raises(CodecError, match="holds 10 set bits"):
        decode_payload(_with_high_bits(p, high, 24, clear_first))
    with pytest.raises(CodecError, match="out of range"):
        decode_payload(_with_high_bits(p, high, 24, last_past_the_end))
    with pytest.raises(CodecError, match="not strictly ascending"):   # every low part 7: 0 and 3 collide
        decode_payload(_tampered(p, low, b"\xff" * 4 + b"\x01"))       # the 33 bits; the 7 padding bits stay 0
    with pytest.raises(CodecError, match="nonzero padding bits in the positions' low bits"):
        decode_payload(_tampered(p, low, b"\xff" * 5))
    for scale in (-1.0, np.nan, np.inf):        # a negative scale would flip its chunk's signs, silently
        with pytest.raises(CodecError, match="chunktopk: a scale in the payload is negative, NaN or Inf"):
            decode_payload(_tampered(p, 0, np.float32(scale).tobytes()))
    for header, match in (({"bits": 3}, "bits=3"), ({"n": 99}, "does not match shape"), ({"chunk": 1}, "chunk"),
                          ({"sent": 101}, "'sent'=101"), ({"sent": 12}, "expected")):
        with pytest.raises(CodecError, match=match):
            decode_payload(Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, **header}))
    with pytest.raises(CodecError, match="truncated or corrupt"):
        decode_payload(Payload(p.codec, p.shape, p.dtype, bytes(p.data)[:-1], p.header))
    older = {k: v for k, v in p.header.items() if k != "sent"}      # an older sender's header: no "sent"
    with pytest.raises(CodecError, match="format before Elias-Fano positions"):
        decode_payload(Payload(p.codec, p.shape, p.dtype, p.data, older))


def test_error_feedback_loses_nothing_over_rounds():
    ef = ErrorFeedback(get_codec("chunktopk:density=0.02,chunk=1024,bits=2"))
    total = torch.zeros(50_000, dtype=torch.float64)
    sent = torch.zeros_like(total)
    for r in range(25):
        g = torch.randn(50_000, generator=torch.Generator().manual_seed(r))
        total += g.double()
        sent += decode_payload(ef.compress(g, key="w")).double()
    assert (total - sent - ef.residual("w").double()).abs().max() < 1e-4     # sent + carried == every delta


def test_a_round_codec_pulls_as_it_pushes():
    assert resolve_pull_codec("auto", "chunktopk:density=0.02") == "chunktopk:density=0.02,chunk=4096,bits=2"
    assert resolve_pull_codec("int8", "chunktopk") == "int8"
