"""Horovod-style wrapper: gradients go to the parameter servers bucket by bucket while backward runs.

    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, servers=[...],
                               rank=r, world_size=w)
    ... loss.backward(); opt.step()   # step() waits for pushes, pulls fresh parameters

The wrapped optimizer's hyper-parameters configure the server-side optimizer; it never steps locally.

Model buffers (BatchNorm running statistics, any registered buffer) are kept in sync through the shards
as DDP's broadcast_buffers does: `buffers="broadcast"` (default) gives every worker rank 0's buffers at
each step(), "average" the mean of the workers' buffers, "local" leaves them alone. DDP broadcasts rank
0's buffers at the start of the forward that follows a synchronised backward; step() does it right after
that backward, so every forward sees the same buffers as under DDP, and after the last step every
worker holds rank 0's (the model DDP's rank 0 would save).

Local updates (`local_steps=H`, DiLoCo-style; worker/local_updates.py): the wrapped optimizer is the
*inner* optimizer and steps locally; every H steps the worker pushes its parameter delta and the shards
apply `outer` (a deltaps.optimizer_config.OptimizerConfig, default: Nesterov lr 0.9, momentum 0.8). What
changes for a user: step() runs the wrapped optimizer; gradients never leave the worker; between rounds
the workers' models differ (evaluate inside `global_model()`, the shards' model, where `synced`); call
flush() after the last step (the trainers do) so the final inner steps reach the shards.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from deltaps.layout import DEFAULT_BUCKET_BYTES, make_buckets, role_for_buffers
from deltaps.optimizer_config import DEFAULT_OUTER, OptimizerConfig, outer_optimizer_config
from deltaps.pull_codec import own_view
from worker.client import PSClient
from worker.local_updates import LocalUpdates


class DistributedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                 named_parameters=None, client: PSClient | None = None, servers=None, rank: int = 0,
                 world_size: int = 1, sync: str = "bsp", backward_passes_per_step: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, buffers: str = "broadcast", named_buffers=None,
                 local_steps: int = 0, stream_fragments: int = 1, outer: OptimizerConfig | None = None,
                 overlap_steps: int | None = None, **client_kw):
        self.optimizer = optimizer
        named = list(named_parameters if named_parameters is not None else model.named_parameters())
        self.named = [(n, p) for n, p in named if p.requires_grad]
        if not self.named:
            raise ValueError("no trainable parameters to distribute")
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        self.buffer_sync = buffers
        self._buffer_model = model if named_buffers is None else None   # re-read each step, as DDP does
        if named_buffers is None:
            named_buffers = model.named_buffers() if model is not None else []
        self.named_buffers = list(named_buffers) if role_for_buffers(buffers) else []   # [] for "local"
        if local_steps < 0 or (stream_fragments > 1 and not local_steps):
            raise ValueError(f"want local_steps >= 0 and stream_fragments 1 unless local_steps > 0, got "
                             f"{local_steps} and {stream_fragments}")
        # the shards run the outer optimizer of a local-update job, else the wrapped one
        server_opt = (outer or outer_optimizer_config(*DEFAULT_OUTER)) if local_steps else OptimizerConfig.from_torch(optimizer)
        self.client = client or PSClient(servers, rank, world_size, sync=sync, optimizer=server_opt,
                                         local_steps=local_steps, **client_kw)
        self.backward_passes_per_step = backward_passes_per_step
        self.clock = 0                      # steps completed
        self.round = 0                      # server steps pushed (= clock unless local_steps)
        self.codec_switches: list[tuple[int, str]] = []   # (first step using it, codec)
        self.timing = {"wait_s": 0.0, "blocked_s": 0.0, "steps": 0}
        self.staging = own_view(self.named + self.named_buffers)
        # Fusion (DDP buckets / Horovod tensor fusion): a bucket goes out once all its gradients exist,
        # as one PushPull RPC per shard it touches (split only past the client's fused_bytes).
        self.buckets = make_buckets([(n, p.numel() * 4) for n, p in self.named], bucket_bytes)
        self._bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b}
        self._ready: dict[int, dict[str, torch.Tensor]] = {}   # bucket -> gradients produced so far
        self._pending: dict[int, list[Future]] = {}            # bucket -> its PushPull futures
        self._passes: dict[str, int] = {}
        self.client.setup([(n, p.detach()) for n, p in self.named], [(n, b.detach()) for n, b in self.named_buffers],
                          buffers, pull=False)       # the delta pull below is the first download (it waits for init)
        self.round = self.client.start_step    # a worker (re)joining a running job starts at its current step
        self.clock = self.round * max(1, local_steps)
        self.load(self.client.pull(out=self.staging, delta=True))
        self.local = LocalUpdates(self, local_steps, stream_fragments, overlap_steps) if local_steps else None
        self._hooks = [] if self.local else [p.register_post_accumulate_grad_hook(self._make_hook(n))
                                             for n, p in self.named]

    # ---- hooks -----------------------------------------------------------------------------
    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            self._passes[name] = self._passes.get(name, 0) + 1
            if self._passes[name] > self.backward_passes_per_step:
                raise RuntimeError(f"gradient of {name!r} computed {self._passes[name]} times before step(); "
                                   f"set backward_passes_per_step={self._passes[name]} to accumulate")
            if self._passes[name] == self.backward_passes_per_step:
                self.grad_ready(name, param.grad)
        return hook

    def grad_ready(self, name: str, grad: torch.Tensor) -> None:
        """Hand this parameter's gradient to its bucket; a complete bucket is pushed (and its next values
        pulled) in the background."""
        # no copy: step() waits for the pushes before autograd can touch p.grad again, and zero_grad
        # without set_to_none synchronises first
        grad = grad.detach() / self.backward_passes_per_step if self.backward_passes_per_step > 1 else grad.detach()
        b = self._bucket_of[name]
        ready = self._ready.setdefault(b, {})
        ready[name] = grad
        if len(ready) == len(self.buckets[b]):
            self._launch(b)

    def _launch(self, b: int) -> None:
        self._pending[b] = self.push_pull(self._ready.pop(b), self.buckets[b], self.round)

    def push_pull(self, values: dict[str, torch.Tensor], names, step: int, inner_steps: int = 0) -> list[Future]:
        """One PushPull per shard the named values touch (keys in the order of `names`), in the background:
        push them as server step `step` and pull the next step's values into the staging buffers (inner_steps: a
        local-update round's delta covers that many inner steps; 0: all of them)."""
        min_v = self.client.sync.pull_min_version(step + 1)
        return [self.client.pool.submit(self.client.push_pull_keys, shard, keys, values, step, min_v, self.staging,
                                        inner_steps)
                for shard, keys in self.client.keys_by_shard(names).items()]

    # ---- torch.optim surface ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if self.local:
            return self._local_step(closure)
        loss = closure() if closure is not None else None
        for name, p in self.named:       # parameters backward did not reach still take part
            b = self._bucket_of[name]
            if b not in self._pending and name not in self._ready.get(b, {}):
                self.grad_ready(name, p.grad if p.grad is not None else torch.zeros_like(p))
        self._pending[-1] = self.sync_buffers(self.round)
        t0 = time.perf_counter()
        waited = max((f.result() for fs in self._pending.values() for f in fs), default=0.0)
        self.note_blocked(time.perf_counter() - t0, waited)
        self.load(self.staging)
        self._pending.clear()
        self._passes.clear()
        self.round += 1
        self._end_step()
        return loss

    def _local_step(self, closure):
        with torch.enable_grad():
            loss = self.optimizer.step(closure)
        self.local.after_inner_step()
        self._end_step()
        return loss

    def _end_step(self) -> None:
        # a switch waits while a streamed exchange is still encoding (its codec and error feedback are the old
        # ones: swapped under it, the residual it folds in could be dropped); the next step takes it
        if self.synced and self.client.apply_codec_switch():
            self.codec_switches.append((self.clock + 1, self.client.codec))
        self.clock += 1
        self.timing["steps"] += 1

    def note_blocked(self, blocked: float, waited: float) -> None:
        """A step was blocked on communication for `blocked` s, the server having waited `waited` s of it."""
        self.timing["blocked_s"] += blocked
        self.timing["wait_s"] += min(waited, blocked)

    @property
    def synced(self) -> bool:
        """`global_model()` is the same on every worker now: always, except while a local-update exchange is
        in flight (its pull is being written)."""
        return self.local is None or not self.local.inflight

    @contextmanager
    def global_model(self):
        """Inside the block the model holds the global parameters and buffers as this worker last pulled them
        (the shards' model; a local-update worker's own model differs between rounds), then its own again.
        Evaluate here, where `synced`."""
        if self.local is None:
            yield
            return
        named = self.named + self.named_buffers
        own = [t.detach().clone() for _, t in named]
        self.load(self.staging)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, t), v in zip(named, own):
                    t.copy_(v)

    def flush(self) -> None:
        """After the last step: a local-update job's unsynced inner steps take a last round (a no-op otherwise)."""
        if self.local:
            self.local.flush()

    def sync_buffers(self, step: int) -> list[Future]:
        """Push this worker's buffers as they are after this step's forward passes and pull the values the
        shards assign (rank 0's or the mean), like a bucket's PushPull; [] when buffers stay local."""
        if not self.named_buffers:
            return []
        if self._buffer_model is not None:     # a module may have re-assigned a buffer since the last step
            now = dict(self._buffer_model.named_buffers())
            self.named_buffers = [(n, now[n]) for n, _ in self.named_buffers]
        values = {n: b.detach().to("cpu", torch.float32).reshape(-1) for n, b in self.named_buffers}
        return self.push_pull(values, values, step)

    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Copy pulled values (flat float32, by name) into the parameters and the synchronised buffers
        (integer buffers rounded)."""
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(values[n].view_as(p))
        self.load_buffers(values)

    def load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Copy pulled buffer values into the synchronised buffers (integer buffers rounded)."""
        with torch.no_grad():
            for n, b in self.named_buffers:
                v = values[n].view(b.shape)
                b.copy_(v if b.is_floating_point() else v.round())

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none and self.local is None:   # in-place zeroing must not race a push reading the gradient
            self.synchronize()                          # (local-update pushes read deltas, never gradients)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def synchronize(self) -> None:
        """Wait for any in-flight push/pull (e.g. before evaluation)."""
        if self.local:
            self.local.finish_inflight()
        for fs in self._pending.values():
            for f in fs:
                f.result()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.client.close()
