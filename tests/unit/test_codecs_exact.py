"""Codec payloads a shard must refuse (negative scales, codes the encoder never writes, set padding bits), and error
feedback that loses nothing: a NaN step leaves the memory whole, DGC keeps its rounding, 16-bit gradients decode in
float32 on both sides. No processes."""
import pytest
import torch

from compression import CodecError, Payload, decode_payload, get_codec


@pytest.mark.parametrize("name,bound", [("int8", 127), ("qsgd", 16)])
def test_int8_and_qsgd_refuse_a_negative_scale_or_a_code_past_their_bound(name, bound):
    """A negative scale flips a chunk's signs and passes every finiteness check; a code the encoder never writes
    (int8's -128, qsgd's past its levels) decodes past the chunk's max. A NaN scale is a NaN gradient, not a
    corrupt payload: it decodes to NaN for the shard's --nonfinite policy."""
    from compression.wire import read_body
    codec = get_codec(name)
    x = torch.randn(300)
    for damage in ("scale", "code"):
        p = codec.compress(x)
        scale, q = read_body(p, codec._sections(300, codec.chunk))     # views into the payload's body
        if damage == "scale":
            scale[0] = -scale[0]
        else:
            q[7] = -bound - 1
        with pytest.raises(CodecError, match="corrupt payload"):
            codec.decompress(p)
        with pytest.raises(CodecError, match="corrupt payload"):
            codec.accumulate(p, torch.zeros(300))
    x[3] = float("nan")
    assert torch.isnan(codec.decompress(codec.compress(x))).all()


@pytest.mark.parametrize("spec", ["chunktopk:density=0.1", "topk:ratio=0.1", "int8"])
def test_a_non_finite_step_leaves_the_error_feedback_memory_as_it_was(spec):
    """chunktopk refuses a NaN step, int8 sends it (the shard's --nonfinite policy judges it): either way the
    residual of the rounds before stays whole, not lost (refused) or poisoned (NaN folded in)."""
    from compression import Compressor
    comp = Compressor(spec, min_bytes=0, error_feedback=True)
    for step in range(3):
        comp.compress("w", torch.randn(4096, generator=torch.Generator().manual_seed(step)), step=step)
    before = comp._ef.residual("w").clone()
    bad = torch.randn(4096)
    bad[5] = float("nan")
    try:
        comp.compress("w", bad, step=3)
    except CodecError:
        pass
    assert torch.equal(comp._ef.residual("w"), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dgc_keeps_the_rounding_of_what_it_sent(dtype):
    """DGC sends v rounded to the gradient's dtype: the rounding stays in v (momentum 0: what was due = what the
    receivers got + what v holds, to float32 accuracy)."""
    codec = get_codec("dgc:ratio=0.05,momentum=0")
    due, got = torch.zeros(2048), torch.zeros(2048)
    for step in range(20):
        g = torch.randn(2048, generator=torch.Generator().manual_seed(step)).to(dtype)
        due += g.float()
        got += decode_payload(codec.compress(g, key="w")).float()
    assert (due - got - codec.residual("w")).abs().max() < 1e-4


def test_sign_decodes_a_non_finite_gradient_as_such_and_refuses_a_negative_scale():
    """A NaN gradient's mean |g| is NaN: it decodes to NaN for the shard's --nonfinite policy (it used to be refused
    as a corrupt payload, past --nonfinite skip); a negative scale is corrupt."""
    codec = get_codec("sign")
    x = torch.randn(64)
    x[9] = float("nan")
    assert torch.isnan(decode_payload(codec.compress(x))).all()
    p = codec.compress(torch.randn(64))
    bad = Payload(p.codec, p.shape, p.dtype, p.data, {**p.header, "scale": -1.0})
    with pytest.raises(CodecError, match="scale"):
        decode_payload(bad)


@pytest.mark.parametrize("spec", ["lowbit:bits=4,chunk=512", "int8", "qsgd", "lowrank:rank=8", "sign",
                                  "chunktopk:density=0.125,chunk=512", "topk:ratio=0.1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_error_feedback_loses_nothing_on_16_bit_gradients(spec, dtype):
    """What was due = what the shard's float32 sum got (ps/server.py: unpack_payload -> add_to) + the residual: a
    16-bit payload is decoded in float32 on both sides (it was rounded to its dtype on the shard: ~0.03 per element
    and round lost)."""
    from compression import Compressor, unpack_payload
    comp = Compressor(spec, min_bytes=0, error_feedback=True)
    due, shard = torch.zeros(256 * 64, dtype=torch.float64), torch.zeros(256 * 64)
    for step in range(10):
        g = torch.randn(256, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
        due += g.double().reshape(-1)
        unpack_payload(comp.compress("w", g, step=step)).add_to(shard)
    assert (due - comp.residual("w").double() - shard.double()).abs().max() < 1e-4


@pytest.mark.parametrize("spec,n", [("sign", 13), ("lowbit:bits=2", 13), ("lowbit:bits=4", 13),
                                    ("chunktopk:density=0.5,chunk=8,bits=2", 5), ("lowrank:rank=1", 13)])
def test_a_set_padding_bit_is_a_corrupt_payload(spec, n):
    """The encoders write zeros past a packed section's last value; a payload with a padding bit set is refused
    (it decoded as if the bit were not there: two encodings of one gradient, a flipped bit unnoticed)."""
    p = get_codec(spec).compress(torch.randn(n))
    data = bytearray(p.data)
    data[-1] |= 0x80                     # the last byte of the last packed section: past its last value
    with pytest.raises(CodecError, match="padding"):
        decode_payload(Payload(p.codec, p.shape, p.dtype, bytes(data), p.header))
    decode_payload(p)                    # the untouched payload decodes
