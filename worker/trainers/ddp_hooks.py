"""The peers users really run instead of deltaps: DDP with torch's one-line communication hooks
(`--mode allreduce --ddp-hook ...`, bench compare's `ddp:<hook>` modes), run by torch itself on the same model,
data, seed and optimizer as every other mode.

Hook specs (`HookSpec`, `parse_ddp_hook`: their grammar lives in deltaps/hook_specs.py, embedded in the mode specs
that name them, and is re-exported here): none, fp16 | bf16 (torch's fp16_compress_hook / bf16_compress_hook),
powersgd:rank=R[:start=S][:impl=auto|torch|deltaps] (PowerSGD: error feedback, warm start, min compression rate 2;
impl=torch is torch's powerSGD_hook; impl=deltaps (`powersgd_hook` below) the same math with the collectives
chained without blocking waits inside future callbacks — torch's hook deadlocks or mismatches collectives on gloo
(docs/compare.md); auto = torch on nccl, ours on gloo), localsgd:period=H[:start=S] (torch's post_localSGD_hook,
gradient allreduce before step S, none after, + PeriodicModelAverager(period=H, warmup_steps=S)).
bench compare's `ddp:sparse` is no hook (deltaps.strategies.parse_mode_spec): DDP's default allreduce with the
model's nn.Embedding tables sparse=True (--sparse-embeddings, the ctr workload); `--ddp-hook sparse` is refused.

Bytes: each hook's payload per bucket is what it hands to allreduce (`payload_fn`); the allreduce strategy turns
payload bytes into the ring figure 2(p-1)/p x payload, as for plain DDP.

The loops never import this module: collective.register_timed_hook builds the hook here and runs it inside
its timing hook (this module imports nothing of worker.trainers).
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from deltaps.hook_specs import HookSpec, parse_ddp_hook

__all__ = ["HookSpec", "parse_ddp_hook", "build_hook", "PeerHook", "PowerSGDState",
           "powersgd_hook", "orthogonalize"]

MIN_COMPRESSION_RATE = 2.0
ORTHO_EPS = 1e-8         # torch's advice when a column may be all zeros (dead ReLU units)


# ---- bytes each hook hands to allreduce ----------------------------------------------------------------
def _matrix_plan(grads, rank: int, min_rate: float = MIN_COMPRESSION_RATE):
    """(matrices to compress as (n, m) views, their ranks, uncompressed tensors) for one bucket, with
    torch's rule: compress when (n + m) * r * min_rate < n * m, r = min(n, m, rank)."""
    mats, ranks, vecs = [], [], []
    for g in grads:
        if g.dim() >= 2:
            m = g.view(g.shape[0], -1)
            r = min(m.shape[0], m.shape[1], rank)
            if (m.shape[0] + m.shape[1]) * r * min_rate < m.numel():
                mats.append(m)
                ranks.append(r)
                continue
        vecs.append(g)
    groups: dict = {}            # torch's order: tensors grouped by shape, groups in order of first appearance
    for m, r in zip(mats, ranks):
        groups.setdefault(tuple(m.shape), []).append((m, r))
    ordered = [x for g in groups.values() for x in g]
    return [m for m, _ in ordered], [r for _, r in ordered], vecs


def payload_fn(spec: HookSpec, state):
    """bucket -> bytes the hook allreduces for it this step (called just before the hook runs)."""
    def full(bucket):
        buf = bucket.buffer()
        return buf.numel() * buf.element_size()
    if spec.kind in ("fp16", "bf16"):
        return lambda bucket: bucket.buffer().numel() * 2
    if spec.kind == "localsgd":     # gradients allreduced before start_localSGD_iter, nothing after
        return lambda bucket: full(bucket) if state.iter < state.start_localSGD_iter else 0
    if spec.kind == "powersgd":
        def powersgd(bucket):
            start = getattr(state, "start_powerSGD_iter", getattr(state, "start_iter", 0))
            if state.iter < start:
                return full(bucket)
            mats, ranks, vecs = _matrix_plan(bucket.gradients(), spec.rank)
            elems = sum(v.numel() for v in vecs) + sum((m.shape[0] + m.shape[1]) * r for m, r in zip(mats, ranks))
            return elems * bucket.buffer().element_size()
        return powersgd
    return full


# ---- PowerSGD without blocking waits in callbacks --------------------------------------------------------
def orthogonalize(m: torch.Tensor, eps: float = ORTHO_EPS) -> None:
    """Orthonormalize the columns of m (n x r) in place, as torch's _orthogonalize: Gram-Schmidt for r <= 2,
    reduced QR above."""
    if m.shape[1] > 2:
        m.copy_(torch.linalg.qr(m).Q)
        return
    for i in range(m.shape[1]):
        col = m[:, i:i + 1]
        col /= torch.norm(col) + eps
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


class PowerSGDState:
    """State of powersgd_hook: per-bucket error feedback and warm-start Q, the step counter, and the in-order
    launcher of the second (Q) allreduces.

    group: where the first allreduce of each bucket ([uncompressed | P]) runs, from the hook itself, i.e. in
    bucket order on every rank; q_group: a process group of its own for the Q allreduces, launched from future
    callbacks (gloo worker threads) but strictly in bucket order (`_launch_in_order`), so both groups see the
    same sequence of collectives on every rank and no callback ever blocks a worker thread."""

    def __init__(self, group, q_group, matrix_rank: int, start_iter: int, seed: int = 0, eps: float = ORTHO_EPS):
        import numpy as np
        self.group, self.q_group = group, q_group
        self.world_size = dist.get_world_size(group)
        self.matrix_rank, self.start_iter, self.eps = matrix_rank, start_iter, eps
        self.rng = np.random.RandomState(seed)      # same draws as torch's PowerSGDState(random_seed=seed)
        self.iter = 0
        self.error: dict[int, torch.Tensor] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._ready: dict[int, tuple] = {}
        self._next = 0

    def _launch_in_order(self, index: int, last: bool, tensor: torch.Tensor, then) -> None:
        with self._lock:
            self._ready[index] = (tensor, last, then)
            while self._next in self._ready:
                t, is_last, cb = self._ready.pop(self._next)
                self._next = 0 if is_last else self._next + 1
                if t.numel():
                    dist.all_reduce(t, group=self.q_group, async_op=True).get_future().then(cb)
                else:           # a bucket with nothing to compress: no second allreduce (on any rank)
                    done: torch.futures.Future = torch.futures.Future()
                    done.set_result([t])
                    cb(done)


def _mean_allreduce(buf: torch.Tensor, group) -> torch.futures.Future:
    buf.div_(dist.get_world_size(group))
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future:
    """torch's powerSGD_hook math: M += error; P = M Q (Q warm-started, orthogonalized); allreduce
    [uncompressed | P]; orthogonalize P; Q = M^T P; allreduce Q; Q /= p; M = P Q^T; error = M_in - M."""
    buf, index, last = bucket.buffer(), bucket.index(), bucket.is_last()
    if state.iter < state.start_iter:
        state.iter += last
        return _mean_allreduce(buf, state.group)
    state.iter += last
    world = state.world_size
    if index not in state.error:
        state.error[index] = torch.zeros_like(buf)
    buf.add_(state.error[index])
    before = buf.clone()
    mats, ranks, vecs = _matrix_plan(bucket.gradients(), state.matrix_rank)
    qs = state.qs.get(index)
    if qs is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            qs = [torch.randn(m.shape[1], r, dtype=buf.dtype).to(buf.device) for m, r in zip(mats, ranks)]
        state.qs[index] = qs
    for q in qs:
        orthogonalize(q, state.eps)
    first = torch.cat([v.reshape(-1) for v in vecs] + [(m @ q).reshape(-1) for m, q in zip(mats, qs)])
    out: torch.futures.Future = torch.futures.Future()
    ps: list[torch.Tensor] = []      # the allreduced, orthogonalized P of each matrix (filled by `second`)

    def finish(fut):
        try:
            flat, off = fut.value()[0].div_(world), 0
            for q in qs:
                q.copy_(flat[off:off + q.numel()].view_as(q))
                off += q.numel()
            for m, p, q in zip(mats, ps, qs):
                m.copy_(p @ q.t())
            state.error[index] = before - buf
            out.set_result(buf)
        except Exception as e:  # noqa: BLE001 - handed to DDP, which raises it in backward()
            out.set_exception(e)

    def second(fut):
        try:
            flat, off = fut.value()[0], 0
            for v in vecs:
                v.copy_(flat[off:off + v.numel()].view_as(v)).div_(world)
                off += v.numel()
            for m, r, q in zip(mats, ranks, qs):
                p = flat[off:off + m.shape[0] * r].view(m.shape[0], r)
                off += p.numel()
                orthogonalize(p, state.eps)
                ps.append(p)
                torch.matmul(m.t(), p, out=q)
            qflat = torch.cat([q.reshape(-1) for q in qs]) if qs else buf.new_zeros(0)   # Q = M^T P, all matrices
            state._launch_in_order(index, last, qflat, finish)
        except Exception as e:  # noqa: BLE001
            out.set_exception(e)

    dist.all_reduce(first, group=state.group, async_op=True).get_future().then(second)
    return out


# ---- installing a hook on a DDP model --------------------------------------------------------------------
class PeerHook:
    """A built hook: `inner(inner_state, bucket)` with `payload(bucket)` -> bytes it allreduces (inner None: DDP's
    default averaging allreduce), `after_step()` (local SGD's model average: (blocked s, start wall time, bytes
    averaged) or None) and `extras` for the result."""

    def __init__(self, spec: HookSpec, impl: str, inner=None, inner_state=None, averager=None):
        self.spec, self.impl, self.inner, self.inner_state, self.averager = spec, impl, inner, inner_state, averager
        self.payload = payload_fn(spec, inner_state) if inner is not None else None

    def after_step(self, params) -> tuple[float, float, int] | None:
        a = self.averager
        if a is None:
            return None
        params = list(params)
        due = a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0
        t_wall, t0 = time.time(), time.perf_counter()
        a.average_parameters(params)
        if not due:
            return None
        return time.perf_counter() - t0, t_wall, sum(p.numel() * p.element_size() for p in params)

    @property
    def extras(self) -> dict:
        return {"ddp_hook": str(self.spec), "ddp_hook_impl": self.impl}


def build_hook(spec: HookSpec, backend: str) -> PeerHook:
    """spec's hook, ready to run inside a timing hook (collective.register_timed_hook). Collective: every rank
    calls it (PowerSGD creates a process group of its own)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
    if spec.kind == "none":
        return PeerHook(spec, "ddp default allreduce (timed copy)")
    if spec.kind in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if spec.kind == "fp16" else default_hooks.bf16_compress_hook
        return PeerHook(spec, f"torch default_hooks.{hook.__name__}", hook, None)
    if spec.kind == "localsgd":
        import warnings

        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None,
                                                     start_localSGD_iter=spec.start,
                                                     post_local_gradient_allreduce=False)
        with warnings.catch_warnings():     # period 1 is allowed (it is the equivalence check with plain DDP)
            warnings.simplefilter("ignore")
            averager = PeriodicModelAverager(period=spec.period, warmup_steps=spec.start)
        return PeerHook(spec, "torch post_localSGD_hook + PeriodicModelAverager", post_localSGD_hook.post_localSGD_hook,
                        state, averager)
    impl = spec.impl if spec.impl != "auto" else ("torch" if backend == "nccl" else "deltaps")
    if impl == "torch":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=spec.rank,
                                            start_powerSGD_iter=spec.start, min_compression_rate=MIN_COMPRESSION_RATE,
                                            use_error_feedback=True, warm_start=True,
                                            orthogonalization_epsilon=ORTHO_EPS, random_seed=0)
        return PeerHook(spec, "torch powerSGD_hook", powerSGD_hook.powerSGD_hook, state)
    state = PowerSGDState(dist.group.WORLD, dist.new_group(backend=backend), spec.rank, spec.start)
    return PeerHook(spec, "deltaps powersgd_hook (torch's PowerSGD math, non-blocking callbacks, own group for Q)",
                    powersgd_hook, state)
