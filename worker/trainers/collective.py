"""torch.distributed plumbing shared by the trainers that run a process group (allreduce, hybrid, pipeline):
rendezvous, process-group start and bounded teardown, the timed DDP allreduce hook (optionally running one of torch's
comm hooks, worker/trainers/ddp_hooks.py, inside it), the ring byte model, the server_stats barrier.

Timing with the hook: a DDP communication hook timestamps each gradient bucket when autograd hands it over
(`AllreduceHookState.last_ready`); backward() returns only after every bucket's allreduce finished, so
`exposed_comm_s` (backward return - last ready, clipped to the backward call) is the time a rank was
blocked on the allreduce rather than computing (worker/trainers/allreduce.py describes the full split).
"""
from __future__ import annotations

import datetime
import logging
import threading
import time

import torch.distributed as dist

from deltaps.strategies import HALF_HOOKS
from worker.trainers.ddp_hooks import PeerHook, build_hook, parse_ddp_hook

log = logging.getLogger("deltaps.worker")
TEARDOWN_S = 10.0       # how long a worker waits for its process group's teardown


def ring_bytes(grad_bytes: int, world_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring allreduce of grad_bytes."""
    return int(2 * (world_size - 1) * grad_bytes // world_size) if world_size > 1 else 0


def init_process_group(cfg, rank: int, world_size: int, master_addr: str, master_port: int,
                       backend: str = "gloo") -> None:
    """The job's process group over TCP rendezvous; collectives time out after 4 x --timeout-s."""
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s * 4))


def destroy_process_group_within(seconds: float = TEARDOWN_S, destroy=None) -> bool:
    """dist.destroy_process_group(), waited for at most `seconds`: gloo's teardown can hang once the other ranks
    have gone (pytorch/pytorch#75097, open; seen here once: a 2-rank DDP job of a fresh-clone `make test`), or fail
    for the same reason ("Connection closed by peer"). The job's result does not depend on it: a teardown past the
    wait, or one that fails, is logged and the worker goes on to write its result and exit (os._exit,
    deltaps/cli/worker.py), leaving a hung teardown's thread behind. True if the teardown finished cleanly."""
    done, failed = threading.Event(), []

    def teardown():
        try:
            (destroy or dist.destroy_process_group)()
        except Exception as e:  # noqa: BLE001 - reported by the caller's thread
            failed.append(e)
        finally:
            done.set()
    threading.Thread(target=teardown, name="process-group-teardown", daemon=True).start()
    if not done.wait(seconds):
        log.warning("the process group's teardown did not finish in %g s (gloo, pytorch/pytorch#75097); "
                    "leaving it to the process exit", seconds)
        return False
    if failed:
        log.warning("the process group's teardown failed (%s: %s); the job's result stands",
                    type(failed[0]).__name__, failed[0])
        return False
    return True


class AllreduceHookState:
    """Per-step state of timed_allreduce_hook; reset it (`new_step`) before each forward.

    By default the hook is DDP's averaging allreduce; `wrap(hook, state, payload)` makes it run another DDP
    comm hook (torch's fp16/bf16/PowerSGD/post-local-SGD hooks, worker/trainers/ddp_hooks.py) under the same
    timing: ready = when DDP hands the bucket to the hook, done = when the hook's future completes (backward()
    returns only after every bucket's future is done)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.last_ready = 0.0       # wall clock (time.time) of the latest bucket handed over this step
        self.bucket_bytes = 0       # gradient bytes handed to the hook this step
        self.payload_bytes = 0      # bytes the hook allreduced this step (= bucket_bytes for the default)
        self.inner = self.inner_state = self.payload = None

    def wrap(self, hook, state, payload) -> None:
        """Run hook(state, bucket) instead of the default allreduce; payload(bucket) -> the bytes it allreduces
        for that bucket (called just before the hook)."""
        self.inner, self.inner_state, self.payload = hook, state, payload

    def new_step(self) -> None:
        self.last_ready, self.bucket_bytes, self.payload_bytes = 0.0, 0, 0

    def ready_wall(self, bwd_end_wall: float) -> float:
        """When this rank's own backward compute ended: the last bucket's ready time (no bucket: backward's end)."""
        return self.last_ready or bwd_end_wall

    def exposed_comm_s(self, bwd_end_wall: float, limit_s: float) -> float:
        """Time backward() spent blocked on the allreduce: its return (wall clock) - the last bucket's ready
        time, clipped to [0, limit_s] (the caller's timed span around backward)."""
        return max(0.0, min(bwd_end_wall - self.ready_wall(bwd_end_wall), limit_s))


def timed_allreduce_hook(state: AllreduceHookState, bucket):
    """Same as DDP's default allreduce hook (average), or the wrapped hook, plus a ready timestamp and byte counts."""
    state.last_ready = max(state.last_ready, time.time())
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    state.bucket_bytes += nbytes
    if state.inner is not None:
        state.payload_bytes += state.payload(bucket)
        return state.inner(state.inner_state, bucket)
    state.payload_bytes += nbytes
    buf.div_(state.world_size)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class SparseHookState(AllreduceHookState):
    """AllreduceHookState + the bytes of the sparse buckets (nn.Embedding(sparse=True) gradients) this step."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.sparse_sent = 0

    def new_step(self) -> None:
        super().new_step()
        self.sparse_sent = 0


def sparse_aware_hook(state: SparseHookState, bucket):
    """timed_allreduce_hook for dense buckets. A sparse bucket (DDP gives a sparse gradient a bucket of its own)
    is divided by the world size and allreduced by gloo's sparse allreduce, an allgather of each rank's coalesced
    (row index int64, values) pairs: a rank sends (W-1) x its own pairs' bytes in the ring (exact on average)."""
    buf = bucket.buffer()
    if not buf.is_sparse:
        return timed_allreduce_hook(state, bucket)
    state.last_ready = max(state.last_ready, time.time())
    buf = buf.coalesce()
    vals = buf.values()
    state.sparse_sent += (state.world_size - 1) * (buf.indices().numel() * 8 + vals.numel() * vals.element_size())
    fut = dist.all_reduce(buf.div_(state.world_size), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_hook(state: AllreduceHookState, ddp_hook: str = "none", backend: str = "gloo") -> PeerHook:
    """Make timed_allreduce_hook(state, ...) run the DDP comm hook `ddp_hook` names (--ddp-hook, parsed by
    check_ddp_hook; worker/trainers/ddp_hooks.py); `none` keeps DDP's fp32 average. Collective: every rank calls it."""
    peer = build_hook(parse_ddp_hook(ddp_hook), backend)
    if peer.inner is not None:
        state.wrap(peer.inner, peer.inner_state, peer.payload)
    return peer


def register_timed_hook(ddp, state: AllreduceHookState, ddp_hook: str = "none", backend: str = "gloo") -> PeerHook:
    """Register timed_allreduce_hook on ddp, running the hook `ddp_hook` names inside it (wrap_hook)."""
    peer = wrap_hook(state, ddp_hook, backend)
    ddp.register_comm_hook(state, timed_allreduce_hook)
    return peer


def check_ddp_hook(ddp_hook: str) -> str:
    """The canonical form of a --ddp-hook spec; ValueError naming the accepted specs if it is not one."""
    return str(parse_ddp_hook(ddp_hook))


def check_table_model_hook(ddp_hook: str, workload_name: str) -> None:
    """The dense buckets of a model with embedding tables (ddp:sparse, hybrid) take torch's fp16 / bf16 hook or
    none: the rows go their own way (gloo's sparse allreduce, the shards)."""
    if check_ddp_hook(ddp_hook).split(":")[0] not in ("none", *HALF_HOOKS):
        raise ValueError(f"--ddp-hook {ddp_hook}: the {workload_name} model's dense buckets take fp16 or bf16 "
                         f"(the embedding rows go their own way)")


def server_stats_when_done(client, rank: int) -> list | None:
    """Once every rank is done with the shards, rank 0 reads their counters (None elsewhere); nobody closes
    before that (a barrier on each side)."""
    dist.barrier()
    stats = client.server_stats() if rank == 0 else None
    dist.barrier()
    return stats
