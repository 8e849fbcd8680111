"""The programs deltaps advise times in child processes shaped like the training processes (one torch thread
each, as the workers run), and the one JSON value each prints last for its parent (probes.py, netprobes.py):

    python -m deltaps.tools.torch_probes compute HIDDEN LAYERS BATCH STEPS START
        {"fwd_bwd_s", "bwd_s", "optimizer_s"}: medians per step of the MLP, timed from wall-clock START on
    python -m deltaps.tools.torch_probes ps-cycle ADDR CODEC NUMEL N
        median seconds of one PushPull (push, delta pull) of one tensor against one server, world size 1
    python -m deltaps.tools.torch_probes allreduce RANK WORLD ADDR PORT NBYTES BUCKET N
        median seconds of a gloo allreduce of NBYTES in BUCKET-byte buckets (rank 0 prints)
    python -m deltaps.tools.torch_probes ps-step ADDRS RANK WORLD CODEC TENSORS_JSON N
        median seconds of DistributedOptimizer's PS path of a step (ADDRS comma-separated, TENSORS [[name, numel]])
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from deltaps.tools.children import module_command, run_program

MODULE = "deltaps.tools.torch_probes"
COMPUTE_WARMUP = 3          # steps before timing: first steps allocate the optimizer state
ALLREDUCE_WARMUP = 3        # rounds before timing: gloo sets up its pairs on first use
PS_WARMUP = 5               # steps before timing: channels, codec buffers, malloc's heap


def command(program: str, *args) -> list[str]:
    """argv of one of this module's programs (see the module docstring)."""
    return module_command(MODULE, program, *args)


def _upper_median(a: list[float]) -> float:
    return sorted(a)[len(a) // 2]


def compute_step_times(hidden: int, layers: int, batch: int, steps: int, start: float) -> dict:
    """Forward+backward, backward and Adam step of the MLP, medians over steps; timing begins at wall-clock
    `start` so that concurrent probe processes compete for the cores at the same time."""
    import torch.nn.functional as F

    from worker.workloads.mlp import make_mlp
    m = make_mlp(64, hidden, layers, 10, 0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    for _ in range(COMPUTE_WARMUP):
        F.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    while time.time() < start:
        time.sleep(0.001)
    fwd_bwd, bwd, optimizer = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        fwd_bwd.append(t2 - t0)
        bwd.append(t2 - t1)
        optimizer.append(t3 - t2)
    return {"fwd_bwd_s": _upper_median(fwd_bwd), "bwd_s": _upper_median(bwd), "optimizer_s": _upper_median(optimizer)}


def ps_cycle_seconds(addr: str, codec: str, numel: int, n: int) -> float:
    """Median PushPull cycle (push, delta pull: the training path, one per step) of one tensor of numel floats
    against the server at addr, world size 1, SGD."""
    from deltaps.optimizer_config import OptimizerConfig
    from worker.client import PSClient
    c = PSClient([addr], 0, 1, sync="bsp", optimizer=OptimizerConfig("sgd", lr=1e-6), timeout_s=60.0, codec=codec)
    try:
        t = torch.randn(numel) if codec != "none" else torch.zeros(numel)
        c.setup([("p", t)])
        out = {"p": torch.empty(numel)}
        c.pull(["p"], out=out, delta=True)
        keys, times = c.by_param["p"], []
        for step in range(n + PS_WARMUP):
            t0 = time.perf_counter()
            c.push_pull_keys(0, keys, {"p": t}, step, step + 1, out)
            times.append(time.perf_counter() - t0)
    finally:
        c.close()
    return statistics.median(times[PS_WARMUP:])


def allreduce_seconds(rank: int, world: int, addr: str, port: int, nbytes: int, bucket: int, n: int) -> float:
    """Median seconds of allreducing nbytes of float32 split in DDP's buckets, reduced one after another."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    try:
        flat = torch.randn(max(1, nbytes // 4))
        buckets = flat.split(max(1, bucket // 4))
        times = []
        for _ in range(n + ALLREDUCE_WARMUP):
            dist.barrier()
            t0 = time.perf_counter()
            for b in buckets:
                dist.all_reduce(b)
            times.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    return statistics.median(times[ALLREDUCE_WARMUP:])


def ps_step_seconds(addrs: list[str], rank: int, world: int, codec: str, tensors: list, n: int) -> float:
    """Median seconds of the training step's PS path alone: DistributedOptimizer handed the [name, numel]
    tensors' gradients in backward's order, then step() (bucketed PushPulls, codec, BSP wait, load)."""
    from deltaps.config import TrainConfig
    from worker.optimizer import DistributedOptimizer
    from worker.trainers.base import local_optimizer
    torch.manual_seed(rank)
    named = [(name, torch.nn.Parameter(torch.zeros(numel))) for name, numel in tensors]
    grads = {name: torch.randn(numel) * 1e-3 for name, numel in tensors}
    opt = DistributedOptimizer(local_optimizer(TrainConfig(), [p for _, p in named]), named_parameters=named,
                               servers=addrs, rank=rank, world_size=world, sync="bsp", codec=codec)
    try:
        times = []
        for _ in range(n + PS_WARMUP):
            t0 = time.perf_counter()
            for name, p in reversed(named):          # handed over in backward's order, as the hooks do
                p.grad = grads[name]
                opt.grad_ready(name, p.grad)
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        opt.close()
    return statistics.median(times[PS_WARMUP:])


def _tuned_malloc() -> None:
    from deltaps.malloc import tune_malloc
    tune_malloc()      # as `deltaps worker` runs (without it 4 MiB messages page-fault in anew)


def _compute(hidden, layers, batch, steps, start) -> None:
    print(json.dumps(compute_step_times(int(hidden), int(layers), int(batch), int(steps), float(start))))


def _ps_cycle(addr, codec, numel, n) -> None:
    _tuned_malloc()
    print(json.dumps(ps_cycle_seconds(addr, codec, int(numel), int(n))))


def _allreduce(rank, world, addr, port, nbytes, bucket, n) -> None:
    seconds = allreduce_seconds(int(rank), int(world), addr, int(port), int(nbytes), int(bucket), int(n))
    if int(rank) == 0:
        print(json.dumps(seconds))


def _ps_step(addrs, rank, world, codec, tensors, n) -> None:
    _tuned_malloc()
    print(json.dumps(ps_step_seconds(addrs.split(","), int(rank), int(world), codec, json.loads(tensors), int(n))))


PROGRAMS = {   # name -> (argument names, run)
    "compute": (("hidden", "layers", "batch", "steps", "start"), _compute),
    "ps-cycle": (("addr", "codec", "numel", "n"), _ps_cycle),
    "allreduce": (("rank", "world", "addr", "port", "nbytes", "bucket", "n"), _allreduce),
    "ps-step": (("addrs", "rank", "world", "codec", "tensors_json", "n"), _ps_step),
}


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)        # as the workers run (worker/trainers/)
    return run_program(PROGRAMS, sys.argv[1:] if argv is None else argv, MODULE)


if __name__ == "__main__":
    raise SystemExit(main())
