"""Where a worker trains (`--device`), and the rules that come with it: one home.

* cpu — the CPU.
* cuda — this worker's GPU: $LOCAL_RANK when the launcher sets it (torchrun, Kubernetes), else the rank modulo
  the GPUs torch sees. The ranks of a PS job may share a GPU (each one only computes and compresses on it);
  NCCL ranks may not (NCCL refuses two ranks on one device), so an NCCL job checks it first and says so.
* auto — cuda when torch sees a GPU, else cpu.
A GPU worker compresses on the GPU (compression/cuda.py's CuPy kernels, when cupy imports) and moves only the
payloads to the host; the parameter servers stay on the CPU.
"""
from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from deltaps.config import DEVICES


def resolve_device(requested: str, rank: int) -> torch.device:
    """The torch device a worker of `rank` trains on (and makes current); ValueError when cuda is asked for and
    torch sees no GPU."""
    if requested not in DEVICES:
        raise ValueError(f"unknown --device {requested!r}; use one of {', '.join(DEVICES)}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU (built for CUDA "
                         f"{torch.version.cuda}); use --device cpu or auto")
    index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_for(device: torch.device, backend: str = "auto") -> str:
    """The process group's backend for a worker on `device`: auto = nccl on a GPU, gloo on the CPU."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs GPU workers (--device cuda or auto on a machine with GPUs): NCCL "
                         "reduces GPU tensors only")
    return backend


def check_gpus_not_shared(device: torch.device, world_size: int, timeout_s: float = 60.0) -> None:
    """NCCL refuses two ranks on one GPU, deep in its first collective; say it first, on every rank, naming the
    GPU. Uses the job's rendezvous store (the process group must be initialised; no collective runs)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"deltaps/gpu/{socket.gethostname()}/{device.index}"
    store.add(key, 1)
    store.add("deltaps/gpu/checked", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("deltaps/gpu/checked", 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached the GPU check within {timeout_s:.0f} s")
        time.sleep(0.01)
    sharing = store.add(key, 0)
    if sharing > 1:
        raise ValueError(f"{sharing} ranks on {socket.gethostname()} would share {device} (torch sees "
                         f"{torch.cuda.device_count()} GPU(s)): NCCL needs one GPU per rank; run at most that many "
                         f"workers per host, or --backend gloo")
