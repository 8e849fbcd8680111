"""CuPy back end == CPU back end, byte for byte (skipped without cupy and a GPU), plus CPU checks of
the integer definitions the CUDA kernels repeat."""
import pytest
import torch

from compression import decode_payload, get_codec, rng
from compression.codecs.common import det_abs_mean, det_l2norm

GPU_SPECS = ["fp16", "bf16", "int8", "int8:chunk=1000", "qsgd:levels=16", "qsgd:levels=3,chunk=777",
             "sign", "topk:ratio=0.01", "topk:ratio=0.3", "topk:ratio=0.0001", "topk:ratio=1.0",
             "randk:ratio=0.01"]


def _ref_hash32(x):
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * rng.C1) & m
    x ^= x >> 15
    x = (x * rng.C2) & m
    return x ^ (x >> 16)


def test_uniform_matches_uint64_definition():
    key = rng.seed32(12345)
    for start in (0, 1000, (1 << 31) - 50):
        u = rng.uniform(start, 50, key)
        ref = [(_ref_hash32(((start + i) * rng.GOLDEN + key) & 0xFFFFFFFF) >> 8) * 2.0 ** -24 for i in range(50)]
        assert u.tolist() == ref


def test_feistel_matches_definition_and_is_bijective():
    n, seed = 1000, 7
    h, mask = rng.feistel_params(n)

    def ref(x):
        left, right = x >> h, x & mask
        for r in range(rng.FEISTEL_ROUNDS):
            left, right = right, left ^ (_ref_hash32((right ^ rng.seed32(seed, r + 1)) & 0xFFFFFFFF) & mask)
        return (left << h) | right
    dom = torch.arange(1 << (2 * h))
    out = rng.feistel(dom, n, seed)
    assert out.tolist() == [ref(i) for i in range(1 << (2 * h))]
    assert torch.equal(torch.sort(out).values, dom)


def test_fixed_point_reductions_are_order_independent():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1)) * 3
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))
    assert det_abs_mean(x) == det_abs_mean(x[perm])
    assert det_l2norm(x) == det_l2norm(x[perm])
    assert abs(det_abs_mean(x) - float(x.abs().mean())) < 1e-5
    assert abs(det_l2norm(x) / float(x.norm()) - 1) < 1e-5


def _cuda():
    cupy = pytest.importorskip("cupy")
    if not cupy.is_available() or not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS)
@pytest.mark.parametrize("n", [1, 1000, 65536, 65537, 300_001, 1 << 20])
def test_cupy_payload_bytes_equal_cpu(spec, n):
    _cuda()
    from compression import cuda
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 2
    x[:3] = 0.0
    assert cuda.wants(x.cuda())
    c = get_codec(spec)
    pc, pg = c.compress(x, seed=11), c.compress(x.cuda(), seed=11)
    assert (pg.codec, pg.shape, pg.dtype, pg.header) == (pc.codec, pc.shape, pc.dtype, pc.header)
    assert bytes(pg.data) == bytes(pc.data)
    assert torch.equal(decode_payload(pg), decode_payload(pc))


@pytest.mark.gpu
def test_cupy_dgc_steps_equal_cpu():
    _cuda()
    spec = "dgc:ratio=0.01,warmup_steps=4,clip=50"
    cpu, gpu = get_codec(spec), get_codec(spec)
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        x = torch.randn(400_000, generator=g)
        pc, pg = cpu.compress(x, key="w", seed=step), gpu.compress(x.cuda(), key="w", seed=step)
        assert pg.header == pc.header and bytes(pg.data) == bytes(pc.data)
    assert torch.equal(gpu.residual("w").cpu(), cpu.residual("w"))


def _index_patterns():
    g = torch.Generator().manual_seed(9)
    for n in (1, 2, 100, 65535, 65536, 65537, 1 << 20, (1 << 31) - 1):
        yield n, [n - 1]
        yield n, sorted({0, n - 1})
        yield n, list(range(max(0, n - 5000), n))                      # contiguous: bits = 1
        yield n, torch.unique(torch.randint(n, (min(n, 3000),), generator=g)).tolist()
        yield n, sorted({0, n // 3, n - 1} | set(range(n // 2, min(n, n // 2 + 70))))  # huge gaps


@pytest.mark.gpu
def test_cupy_index_encoding_equals_cpu():
    _cuda()
    import numpy as np

    from compression import cuda, wire
    for n, idx in _index_patterns():
        t = torch.tensor(idx, dtype=torch.int64)
        hc, bc = wire.encode_indices(t.numpy(), n)
        hg, bg = cuda.encode_indices(t.cuda(), n)
        assert hg == hc, (n, len(idx))
        assert bg.dtype == torch.uint8 and bytes(bg.cpu().numpy()) == bytes(np.ascontiguousarray(bc)), (n, len(idx))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [1, 7, 8, 13, 16, 21, 31])
def test_cupy_bitpack_kernel_equals_cpu(bits):
    cupy = _cuda()
    import numpy as np

    from compression import cuda, wire
    g = np.random.default_rng(bits)
    for m in (1, 2, 3, 63, 64, 65, 1000, 100_003):
        d = g.integers(0, 1 << bits, m, dtype=np.uint64)
        words = cuda.bitpack_words(cupy.asarray(d), bits, -(-(m * bits) // 64))
        got = cupy.asnumpy(words).view(np.uint8)[:wire.packed_nbytes(m, bits)]
        assert got.tobytes() == wire.bitpack(d, bits).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("spec,ef", [("lowrank:rank=4", True), ("int8", False), ("lowbit:bits=2", True)])
def test_a_gpu_workers_compressor_keeps_its_memory_on_the_gpu(spec, ef):
    """A GPU worker's round codec: the error-feedback residual (lowrank decoded on the CPU) and the energy measure
    (a codec without feedback: what the payload lost) both meet the gradient on its device."""
    _cuda()
    from compression import Compressor
    comp = Compressor(spec, min_bytes=0, error_feedback=ef, measure_energy=True)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(3)).cuda()
    for step in range(3):
        comp.compress("w", x, step=step)
    if ef:
        assert comp._ef.residual("w").device.type == "cuda"
