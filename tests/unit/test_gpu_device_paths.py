"""GPU worker paths against the CPU ones (skipped without cupy and a GPU; `make gpu-check` runs them):
decoding and scatter-adding on the device, error feedback kept on the device, a local-update job's round
payloads, and the worker's device rules. The CPU-only rules at the end run everywhere."""
import pytest
import torch

from compression import Compressor, ErrorFeedback, decode_payload, get_codec
from tests.unit.test_codecs_gpu import GPU_SPECS

LOSSY_EF = ["int8", "qsgd:levels=4", "sign", "topk:ratio=0.01", "randk:ratio=0.01", "fp16", "bf16"]


def _gpu():
    cupy = pytest.importorskip("cupy")
    if not cupy.is_available() or not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device("cuda")


def _grad(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2
    x[:3] = 0.0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS)
@pytest.mark.parametrize("n", [1, 65537, 1 << 20])
def test_decode_and_scatter_add_on_the_device_equal_cpu(spec, n):
    dev = _gpu()
    c = get_codec(spec)
    p = c.compress(_grad(n, n), seed=5)
    on_gpu = c.decompress_on(p, dev)
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), c.decompress(p))
    base = _grad(n, n + 1)
    cpu_acc, gpu_acc = base.clone(), base.to(dev)
    for alpha in (1.0, -1.0):
        c.accumulate(p, cpu_acc, alpha=alpha)
        c.accumulate(p, gpu_acc, alpha=alpha)
    assert torch.equal(gpu_acc.cpu(), cpu_acc)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", LOSSY_EF)
def test_error_feedback_state_lives_on_the_device_and_equals_cpu(spec):
    dev = _gpu()
    cpu_ef, gpu_ef = ErrorFeedback(get_codec(spec)), ErrorFeedback(get_codec(spec))
    for step in range(5):
        g = _grad(300_001, 100 + step)
        pc, pg = cpu_ef.compress(g, key="w", seed=step), gpu_ef.compress(g.to(dev), key="w", seed=step)
        assert pg.header == pc.header and bytes(pg.data) == bytes(pc.data), step
    assert gpu_ef.residual("w").device.type == "cuda"
    assert torch.equal(gpu_ef.residual("w").cpu(), cpu_ef.residual("w"))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int8", "topk:ratio=0.02", "qsgd:levels=4", "sign"])
def test_local_update_round_payloads_equal_cpu(spec):
    """A ps-local worker's rounds: delta = anchor - local model, through the client's Compressor (error feedback
    on), per key; the GPU worker's payloads are the CPU worker's, round after round."""
    dev = _gpu()
    cpu, gpu = (Compressor(spec, min_bytes=0, error_feedback=True) for _ in range(2))
    anchor = _grad(200_000, 1)
    model = anchor.clone()
    for rnd in range(4):
        model -= 0.01 * _grad(200_000, 10 + rnd)          # H inner steps, folded
        delta = anchor - model
        d_gpu = anchor.to(dev) - model.to(dev)
        assert torch.equal(d_gpu.cpu(), delta)
        pc, pg = cpu.compress("layer.weight/0", delta, step=rnd, seed=rnd), gpu.compress("layer.weight/0", d_gpu,
                                                                                           step=rnd, seed=rnd)
        assert (pg.codec, pg.header) == (pc.codec, pc.header) and bytes(pg.data) == bytes(pc.data), rnd
        anchor = anchor - decode_payload(pc).view(-1)     # the shards' outer step (SGD lr 1, one worker)
        model = anchor.clone()
    assert torch.equal(gpu.residual("layer.weight/0").cpu(), cpu.residual("layer.weight/0"))


@pytest.mark.gpu
def test_resolve_device_gives_this_ranks_gpu():
    _gpu()
    from worker.trainers.devices import backend_for, resolve_device
    d = resolve_device("cuda", rank=3)
    assert d.type == "cuda" and d.index == 3 % torch.cuda.device_count()
    assert resolve_device("auto", rank=0).type == "cuda"
    assert backend_for(d) == "nccl"


def test_device_rules_on_a_cpu_machine(monkeypatch):
    from worker.trainers.devices import backend_for, resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 0) == torch.device("cpu")
    assert resolve_device("cpu", 0) == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda: torch .* sees no CUDA GPU"):
        resolve_device("cuda", 0)
    with pytest.raises(ValueError, match="unknown --device 'tpu'"):
        resolve_device("tpu", 0)
    assert backend_for(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="--backend nccl needs GPU workers"):
        backend_for(torch.device("cpu"), "nccl")


def test_device_flag_rules():
    from worker.trainers.strategy import load_job
    with pytest.raises(ValueError, match="unknown --device 'gpu'"):
        load_job(None, {"device": "gpu"})
    with pytest.raises(ValueError, match="--device cuda applies to --mode ps / allreduce; --mode pipeline"):
        load_job(None, {"device": "cuda", "mode": "pipeline", "workers": 2})
    with pytest.raises(ValueError, match="tables train on the CPU in --mode allreduce"):
        load_job(None, {"device": "cuda", "mode": "allreduce", "workload": "ctr"})
    assert load_job(None, {"device": "cuda", "mode": "ps"}).device == "cuda"   # resolved by the worker, not here
