"""lowrank, the factor-pair round codec: what a payload holds and costs, its dense form, what it refuses, error
feedback losing nothing over rounds, and the shards' sum of decoded factor pairs against a dense reference."""
import pytest
import torch

from compression import CodecError, ErrorFeedback, Payload, accumulate_payload, decode_payload, get_codec
from compression.base import Codec
from compression.codecs.lowrank import LowRankCodec
from deltaps.pull_codec import matrix_codec, resolve_pull_codec, resolve_pull_residual


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def low_rank_matrix(m: int, n: int, rank: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, rank, generator=gen(seed)) @ torch.randn(rank, n, generator=gen(seed + 1))


def test_a_matrix_of_lower_rank_comes_back_to_its_quantization():
    x = low_rank_matrix(200, 120, 3)
    for bits, tolerance in ((8, 0.02), (4, 0.25)):
        d = decode_payload(LowRankCodec(rank=4, bits=bits).compress(x, seed=1))
        assert d.shape == x.shape
        assert float((d - x).norm() / x.norm()) < tolerance


def test_the_picture_has_the_rank_asked_for_and_the_best_rank_r_energy():
    x = torch.randn(300, 200, generator=gen(2))
    d = decode_payload(LowRankCodec(rank=8, bits=8).compress(x))
    assert int(torch.linalg.matrix_rank(d)) == 8
    s = torch.linalg.svdvals(x)
    best = float(s[:8].square().sum() / s.square().sum())
    # the randomized range finder's picture holds nearly the truncated SVD's share (2 power iterations)
    kept = 1 - float((x - d).square().sum() / x.square().sum())
    assert 0.85 * best < kept <= best + 0.01


def test_bytes_are_two_factors_of_codes_and_a_scale_per_column():
    p = LowRankCodec(rank=16, bits=4).compress(torch.randn(768, 768))    # the clf model's big weight
    assert p.header == {"form": "factors", "rank": 16, "bits": 4}
    assert p.nbytes == (768 + 768) * 16 // 2 + 2 * 16 * 4 == 12_416      # 0.53 % of fp32
    q = LowRankCodec(rank=16, bits=8).compress(torch.randn(768, 64))
    assert q.nbytes == (768 + 64) * 16 + 2 * 16 * 4


@pytest.mark.parametrize("shape", [(768,), (10, 12), (3, 1000), (0,), (5, 0), (2, 3, 4)])
def test_vectors_and_matrices_factors_would_not_shrink_go_dense(shape):
    """1-D (a bias), a matrix with (m + n) r >= m n, an empty one, a 3-D tensor the layout did not flatten: the
    values' codes on per-block scales."""
    c = LowRankCodec(rank=16, bits=8)
    x = torch.randn(shape, generator=gen(5))
    p = c.compress(x)
    assert p.header["form"] == "dense" and p.header["rank"] == 0
    d = decode_payload(p)
    assert d.shape == x.shape
    if x.numel():
        assert float((d - x).abs().max()) <= float(x.abs().max()) / 255 + 1e-6


def test_a_zero_matrix_decodes_to_zeros_and_encodes_deterministically():
    c = LowRankCodec(rank=4, bits=4)
    assert torch.count_nonzero(decode_payload(c.compress(torch.zeros(64, 64)))) == 0
    x = torch.randn(64, 48, generator=gen(7))
    assert bytes(c.compress(x, seed=3).data) == bytes(c.compress(x, seed=3).data)


def test_the_error_feedback_update_is_the_generic_one_without_parsing():
    c = LowRankCodec(rank=6, bits=4)
    for x in (torch.randn(96, 80, generator=gen(3)), torch.randn(5000, generator=gen(4))):
        fast, generic = x.reshape(-1).clone(), x.reshape(-1).clone()
        p = c.compress_leaving(x, fast, seed=9)
        q = Codec.compress_leaving(c, x, generic, seed=9)
        assert bytes(p.data) == bytes(q.data) and p.header == q.header
        assert torch.allclose(fast, generic, atol=1e-6)


def test_error_feedback_loses_nothing_over_rounds():
    ef = ErrorFeedback(get_codec("lowrank:rank=4,bits=4"))
    total = torch.zeros(128 * 96, dtype=torch.float64)
    sent = torch.zeros_like(total)
    for r in range(20):
        g = torch.randn(128, 96, generator=gen(r))
        total += g.double().view(-1)
        sent += decode_payload(ef.compress(g, key="w", seed=r)).double().view(-1)
    assert (total - sent - ef.residual("w").double()).abs().max() < 1e-4     # sent + carried == every delta


def test_the_shards_sum_of_factor_pairs_equals_the_dense_sum():
    c = get_codec("lowrank:rank=5")
    payloads = [c.compress(torch.randn(100, 70, generator=gen(w)), seed=w) for w in range(4)]
    acc = torch.zeros(100 * 70)
    for p in payloads:
        accumulate_payload(p, acc)                     # what a shard does with each worker's push (a flat key)
    dense = sum(decode_payload(p).view(-1) for p in payloads)
    assert torch.allclose(acc, dense, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_by_name(bad):
    for x in (torch.randn(40, 30), torch.randn(100)):
        x.view(-1)[17] = bad
        with pytest.raises(CodecError, match="lowrank: the tensor holds NaN or Inf"):
            get_codec("lowrank").compress(x)


@pytest.mark.parametrize("spec,match", [("lowrank:rank=0", "rank must be an int"),
                                        ("lowrank:rank=2000", "rank must be an int"),
                                        ("lowrank:bits=2", "bits must be an int, one of"),
                                        ("lowrank:bits=4.0", "bits must be an int"),
                                        ("lowrank:iters=9", "iters must be an int"),
                                        ("lowrank:keys=rows", "keys must be one of")])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(CodecError, match=match):
        get_codec(spec)


def test_corrupt_payloads_are_codec_errors():
    p = LowRankCodec(rank=4, bits=4).compress(torch.randn(40, 30, generator=gen(1)))
    body = bytearray(bytes(p.data))
    body[0:4] = torch.tensor([float("nan")]).numpy().tobytes()              # the first column scale of P
    cases = [(Payload(p.codec, p.shape, p.dtype, bytes(body), p.header), "scale in the payload"),
             (Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, "form": "svd"}), "form='svd'"),
             (Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, "rank": 31}), "'rank'=31"),
             (Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, "rank": 5}), "expected"),
             (Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, "bits": 5}), "bits=5"),
             (Payload(p.codec, (1200,), p.dtype, p.data, p.header), "factors need a matrix"),
             (Payload(p.codec, p.shape, p.dtype, bytes(p.data)[:-1], p.header), "truncated or corrupt")]
    body[0:4] = torch.tensor([-1.0]).numpy().tobytes()
    cases.append((Payload(p.codec, p.shape, p.dtype, bytes(body), p.header), "negative"))
    for payload, match in cases:
        with pytest.raises(CodecError, match=match):
            decode_payload(payload)


def test_a_round_codec_that_wants_matrix_keys():
    assert resolve_pull_codec("auto", "lowrank:rank=8") == "lowrank:rank=8,bits=4,iters=2,keys=whole"
    assert resolve_pull_residual("auto", "lowrank:rank=8,bits=4,iters=2") == "carry"     # measured: carry pays here
    assert matrix_codec("lowrank", "auto").matrix_keys == "whole" == matrix_codec("int8", "lowrank:rank=4").matrix_keys
    assert matrix_codec("int8", "lowrank:rank=4").spec().startswith("lowrank:rank=4,")     # the pull codec's way
    assert matrix_codec("lowrank:keys=balanced", "auto").matrix_keys == "balanced"
    assert matrix_codec("chunktopk", "auto") is None is matrix_codec("none", "none")


def test_a_matrix_key_costs_what_the_codec_sends():
    """The layout balances a keys=balanced job's shards by Codec.shaped_wire_nbytes: it must be the body compress()
    produces, factors or dense codes."""
    c = LowRankCodec(rank=32)
    for shape in [(192, 768), (768, 64), (10, 768), (768,), (10,), (5, 3)]:
        body = c.compress(torch.randn(*shape)).data
        assert c.shaped_wire_nbytes(shape) == len(body), shape
    assert c.shaped_wire_nbytes((192, 768)) < c.shaped_wire_nbytes((192 * 768,))     # factors beat the dense codes


def test_the_codec_bench_measures_a_matrix_codec_on_a_matrix():
    """`deltaps bench codecs` (and `deltaps advise`'s codec probe, which runs it): a 1-D buffer would send lowrank
    down its dense form and report a vector's ratio."""
    from deltaps.tools.bench_codecs import run_codec_bench
    res = run_codec_bench(1 << 20, ["lowrank:rank=16,bits=4", "int8"], repeats=1)["codecs"]
    assert res["lowrank:rank=16,bits=4"]["shape"] == [512, 512] and res["int8"]["shape"] == [262_144]
    assert res["lowrank:rank=16,bits=4"]["wire_bytes"] == (512 + 512) * 16 // 2 + 2 * 16 * 4
    assert res["lowrank:rank=16,bits=4"]["compression_ratio"] > 100 > res["int8"]["compression_ratio"]
