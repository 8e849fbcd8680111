"""Error feedback and the sender-side Compressor policy."""
import pytest
import torch

from compression import Compressor, ErrorFeedback, decode_payload, get_codec
from compression.base import CodecError

EF_SPECS = ["sign", "topk:ratio=0.02", "randk:ratio=0.05", "int8:chunk=32", "qsgd:levels=4,chunk=32", "bf16"]


def grads(steps, shape=(50, 20), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_conserves_sum(spec):
    ef = ErrorFeedback(get_codec(spec))
    gs = grads(50)
    sent = torch.zeros(gs[0].shape, dtype=torch.float64)
    for t, g in enumerate(gs):
        sent += decode_payload(ef.compress(g, seed=t, key="w")).double()
    total = sum(g.double() for g in gs)
    residual = ef.residual("w").double().view(total.shape)
    assert torch.allclose(sent + residual, total, atol=1e-4)
    assert ef.residual("other") is None


def test_error_feedback_keys_are_independent():
    ef = ErrorFeedback(get_codec("topk:ratio=0.1"))
    a, b = grads(2)
    ef.compress(a, key="a")
    ef.compress(b, key="b")
    assert not torch.equal(ef.residual("a"), ef.residual("b"))


def test_default_error_feedback_flags():
    on = {n: get_codec(n).default_error_feedback for n in ["sign", "topk", "randk", "dgc", "int8", "fp16", "none"]}
    assert on == {"sign": True, "topk": True, "randk": True, "dgc": True, "int8": False, "fp16": False, "none": False}


def test_small_tensors_pass_through():
    c = Compressor("topk:ratio=0.01", min_bytes=4096)
    small = torch.randn(100)  # 400 bytes
    p = c.compress("b", small, step=5)
    assert p.codec == "none" and torch.equal(decode_payload(p), small)
    big = torch.randn(10_000)
    assert c.compress("w", big, step=5).codec == "topk"
    s = c.stats()
    assert s["pushes"] == 2 and s["raw_bytes"] == 400 + 40_000 and s["by_codec"] == {"none": 1, "topk": 1}
    assert s["compression_ratio"] > 1


def test_codec_that_would_not_shrink_passes_through():
    c = Compressor("topk:ratio=0.9", min_bytes=0)  # 4 + worst-case index bytes per kept element
    assert c.compress("w", torch.randn(1000)).codec == "none"
    c = Compressor("fp16", min_bytes=0)
    assert c.compress("h", torch.randn(1000).half()).codec == "none"


def test_warmup_steps():
    c = Compressor("int8", min_bytes=0, warmup_steps=3)
    x = torch.randn(5000)
    assert [c.compress("w", x, step=s).codec for s in range(5)] == ["none"] * 3 + ["int8"] * 2


@pytest.mark.parametrize("new_spec", ["int8", "none", "dgc:ratio=0.01", "randk:ratio=0.05"])
@pytest.mark.parametrize("old_spec", ["topk:ratio=0.01", "dgc:ratio=0.01"])
def test_set_spec_keeps_residual(old_spec, new_spec):
    c = Compressor(old_spec, min_bytes=0)
    gs = grads(6, shape=(4000,))
    sent = torch.zeros(4000, dtype=torch.float64)
    for t, g in enumerate(gs[:3]):
        sent += decode_payload(c.compress("w", g, step=t, seed=t)).double()
    pending = c.residual("w").double().clone()
    assert pending.abs().sum() > 0
    c.set_spec(new_spec)
    p = c.compress("w", gs[3], step=3, seed=3)
    got = decode_payload(p).double()
    sent += got
    left = c.residual("w")
    left = torch.zeros(4000, dtype=torch.float64) if left is None else left.double()
    total = sum(g.double() for g in gs[:4])
    if old_spec.startswith("topk"):
        # everything not yet sent is in this push or still in memory; int8 runs without EF, so
        # only its own quantisation error (<= scale/2) is lost
        assert torch.allclose(sent + left, total, atol=0.05 if new_spec == "int8" else 1e-3)
        assert (new_spec == "int8") == (c.residual("w") is None and new_spec != "none")
    if new_spec == "none":
        assert torch.allclose(got, gs[3].double() + pending, atol=1e-5) and c.residual("w") is None


def test_set_spec_bad_spec_keeps_old():
    c = Compressor("int8")
    with pytest.raises(CodecError, match="unknown codec"):
        c.set_spec("bogus:x=1")
    assert c.spec == "int8"


def test_error_feedback_override():
    c = Compressor("topk:ratio=0.01", min_bytes=0, error_feedback=False)
    c.compress("w", torch.randn(5000))
    assert c.residual("w") is None
    c = Compressor("int8", min_bytes=0, error_feedback=True)
    c.compress("w", torch.randn(5000))
    assert c.residual("w") is not None


def _sq(t):
    return float(t.double().square().sum())


def test_payload_energy_share_is_what_the_payload_carried_of_what_was_due():
    c = Compressor("chunktopk", min_bytes=0, measure_energy=True)
    g1, g2 = grads(2, shape=(64, 256))
    c.compress("w", g1)
    r1 = c.residual("w").clone()
    s = c.stats()
    assert s["energy_due"] == pytest.approx(_sq(g1), rel=1e-5) and s["energy_left"] == pytest.approx(_sq(r1), rel=1e-5)
    c.compress("w", g2)     # due: the new tensor plus the residual it carries
    s = c.stats()
    assert s["energy_due"] == pytest.approx(_sq(g1) + _sq(g2.reshape(-1) + r1), rel=1e-5)
    assert s["energy_left"] == pytest.approx(_sq(r1) + _sq(c.residual("w")), rel=1e-5)
    assert 0.01 < s["payload_energy_share"] < 0.5     # 1/64 of a Gaussian's entries, the largest ones
    assert Compressor("chunktopk", min_bytes=0).stats()["payload_energy_share"] is None     # not measured


def test_payload_energy_share_of_lossless_lossy_and_dropping_pushes():
    x = torch.randn(5000)
    raw = Compressor("none", min_bytes=0, measure_energy=True)
    raw.compress("w", x)
    assert raw.stats()["payload_energy_share"] == 1.0
    ef = Compressor("int8", min_bytes=0, error_feedback=True, measure_energy=True)
    ef.compress("w", x)
    assert 0.999 < ef.stats()["payload_energy_share"] < 1.0
    dropped = Compressor("int8", min_bytes=0, measure_energy=True)     # no error feedback: the error is gone
    p = dropped.compress("w", x)
    s = dropped.stats()
    assert s["energy_left"] == pytest.approx(_sq(x - decode_payload(p)), rel=1e-5) and s["energy_left"] > 0


def test_a_payload_larger_than_raw_sends_what_was_due_and_keeps_no_residual():
    """A codec without a size estimate whose payload came out larger than raw: the raw tensor sent must carry the
    residual too, and leave none behind — the sum of what was sent plus the residual stays the sum pushed."""
    c = Compressor("topk:ratio=0.95", min_bytes=0, measure_energy=True)
    c.codec.wire_nbytes = lambda numel, dtype: None        # as a plugin codec with no estimate
    gs = grads(2, shape=(1000,))
    sent = sum(decode_payload(c.compress("w", g)).double() for g in gs)
    r = c.residual("w")
    total = sent + (r.double() if r is not None else 0)
    assert c.stats()["by_codec"] == {"none": 2}
    assert torch.allclose(total, sum(g.double() for g in gs), atol=1e-5)
    assert c.stats()["payload_energy_share"] == 1.0
