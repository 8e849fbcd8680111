"""One parameter-server shard: key state, aggregation, sync-mode gating, staleness, idempotency.

Versions are clocks: a key's version is the number of steps whose updates are fully in it. In bsp it
goes up once per step (after all live workers pushed); in asp/ssp it is the minimum, over live workers,
of pushes applied from that worker. Staleness of a push = key version at apply time - version the
worker pulled, so under ssp:S it never exceeds S.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from compression.server import Decoded
from ps.optimizer import KeyOptimizer, OptimizerConfig
from ps.partition import Key
from ps.sync import SyncMode, parse_sync


class ShardError(Exception):
    """A request the shard refuses; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Job:
    world_size: int
    sync: SyncMode
    optimizer: OptimizerConfig
    digest: str
    codec: str


@dataclass
class KeyState:
    spec: Key
    value: torch.Tensor
    cond: threading.Condition = field(default_factory=threading.Condition)
    initialized: bool = False
    version: int = 0
    pushed: dict = field(default_factory=dict)      # worker -> steps pushed (next expected step)
    agg: torch.Tensor | None = None                  # bsp: sum of this step's gradients
    agg_from: set = field(default_factory=set)
    opt: KeyOptimizer | None = None


class Shard:
    def __init__(self, shard_id: int, num_shards: int, wait_timeout_s: float = 300.0):
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.wait_timeout_s = wait_timeout_s
        self.job: Job | None = None
        self.keys: dict[str, KeyState] = {}
        self.live: set[int] = set()
        self.lock = threading.Lock()
        self.codec = "none"
        self.codec_epoch = 0
        self.counters = Counter()
        self.staleness = Counter()
        self._barriers: dict[str, dict] = {}
        self._barrier_cond = threading.Condition()

    # ---- membership -------------------------------------------------------------------------
    def register(self, worker: int, world_size: int, num_shards: int, sync: str, opt: OptimizerConfig,
                 keys: list[Key], digest: str, codec: str) -> bool:
        if num_shards != self.num_shards:
            raise ShardError("FAILED_PRECONDITION",
                             f"worker {worker} expects {num_shards} shards, this server is one of {self.num_shards}")
        if not 0 <= worker < world_size:
            raise ShardError("INVALID_ARGUMENT", f"worker id {worker} outside world size {world_size}")
        try:
            mode = parse_sync(sync)
            opt.validate()
        except ValueError as e:
            raise ShardError("INVALID_ARGUMENT", str(e)) from None
        for k in keys:
            if k.shard != self.shard_id:
                raise ShardError("INVALID_ARGUMENT", f"key {k.key} belongs to shard {k.shard}, not {self.shard_id}")
        with self.lock:
            if self.job is None:
                self.job = Job(world_size, mode, opt, digest, codec)
                self.codec = codec
                self.keys = {k.key: KeyState(k, torch.zeros(k.numel, dtype=torch.float32)) for k in keys}
                self.live = set(range(world_size))
            else:
                self._check_same_job(worker, world_size, mode, opt, digest)
            return all(ks.initialized for ks in self.keys.values())

    def _check_same_job(self, worker, world_size, mode, opt, digest) -> None:
        job = self.job
        for what, mine, theirs in (("world size", job.world_size, world_size), ("sync mode", str(job.sync), str(mode)),
                                   ("optimizer", job.optimizer, opt), ("key layout digest", job.digest, digest)):
            if mine != theirs:
                raise ShardError("FAILED_PRECONDITION",
                                 f"worker {worker} disagrees with the running job on {what}: job has {mine}, worker sent {theirs}")

    def _require_job(self) -> Job:
        if self.job is None:
            raise ShardError("FAILED_PRECONDITION", "no job registered on this shard yet; call Register first")
        return self.job

    def key_state(self, key: str) -> KeyState:
        ks = self.keys.get(key)
        if ks is None:
            raise ShardError("INVALID_ARGUMENT", f"unknown key {key!r} on shard {self.shard_id}")
        return ks

    # ---- init ------------------------------------------------------------------------------
    def init(self, values: list[tuple[str, torch.Tensor]]) -> int:
        job = self._require_job()
        checked = [(self.key_state(k), self._check_numel(k, v)) for k, v in values]
        done = 0
        for ks, v in checked:
            with ks.cond:
                if ks.initialized:
                    continue
                ks.value.copy_(v.view(-1).to(torch.float32))
                ks.opt = KeyOptimizer(ks.value, job.optimizer)
                ks.initialized = True
                done += 1
                ks.cond.notify_all()
        return done

    def _check_numel(self, key: str, t: torch.Tensor) -> torch.Tensor:
        ks = self.key_state(key)
        if t.numel() != ks.spec.numel:
            raise ShardError("INVALID_ARGUMENT",
                             f"key {key!r}: tensor has {t.numel()} elements, layout says {ks.spec.numel}")
        return t

    # ---- push ------------------------------------------------------------------------------
    def push(self, worker: int, step: int, grads: list[tuple[str, "Decoded | torch.Tensor"]],
             pulled_versions: list[int]) -> tuple[list[bool], list[int]]:
        job = self._require_job()
        if worker not in self.live:
            raise ShardError("FAILED_PRECONDITION", f"worker {worker} is not a live member of the job")
        if pulled_versions and len(pulled_versions) != len(grads):
            raise ShardError("INVALID_ARGUMENT", "pulled_versions must have one entry per gradient")
        checked = []
        for i, (key, g) in enumerate(grads):
            ks = self.key_state(key)
            if isinstance(g, torch.Tensor):
                g = Decoded(g.numel(), dense=g)
            if g.numel != ks.spec.numel:
                raise ShardError("INVALID_ARGUMENT",
                                 f"key {key!r}: gradient has {g.numel} elements, layout says {ks.spec.numel}")
            if not ks.initialized:
                raise ShardError("FAILED_PRECONDITION", f"key {key!r} has no value yet; rank 0 must Init first")
            if not g.all_finite():
                raise ShardError("INVALID_ARGUMENT", f"gradient for key {key!r} contains NaN or Inf")
            expected = ks.pushed.get(worker, 0)
            if step > expected:
                raise ShardError("FAILED_PRECONDITION",
                                 f"worker {worker} pushed step {step} for key {key!r} but its next step is {expected}")
            checked.append((ks, g, pulled_versions[i] if pulled_versions else step))
        dup, versions = [], []
        for ks, g, pulled in checked:
            d, v = self._apply(job, ks, worker, step, g, pulled)
            dup.append(d)
            versions.append(v)
        self.counters["pushes"] += 1
        return dup, versions

    def _apply(self, job: Job, ks: KeyState, worker: int, step: int, g: Decoded, pulled: int):
        with ks.cond:
            if step < ks.pushed.get(worker, 0):
                self.counters["duplicates"] += 1
                return True, ks.version
            self.staleness[max(0, ks.version - pulled)] += 1
            ks.pushed[worker] = step + 1
            if job.sync.kind == "bsp":
                if ks.agg is None:
                    ks.agg = torch.zeros_like(ks.value)
                g.add_to(ks.agg)
                ks.agg_from.add(worker)
                self._maybe_complete_step(ks)
            else:
                dense = torch.zeros_like(ks.value)
                g.add_to(dense, 1.0 / len(self.live))
                ks.opt.apply(dense)
                self.counters["grads_applied"] += 1
                ks.version = min(ks.pushed.get(w, 0) for w in self.live)
                ks.cond.notify_all()
            return False, ks.version

    def _maybe_complete_step(self, ks: KeyState) -> None:
        if ks.agg_from and self.live <= ks.agg_from:
            ks.opt.apply(ks.agg / len(ks.agg_from))
            self.counters["grads_applied"] += 1
            ks.agg.zero_()
            ks.agg_from.clear()
            ks.version += 1
            ks.cond.notify_all()

    # ---- pull ------------------------------------------------------------------------------
    def pull(self, keys: list[str], min_version: int, timeout_s: float = 0.0):
        self._require_job()
        states = [self.key_state(k) for k in keys]
        timeout = timeout_s if timeout_s > 0 else self.wait_timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        out = []
        for ks in states:
            with ks.cond:
                while not (ks.initialized and ks.version >= min_version):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ShardError("DEADLINE_EXCEEDED",
                                         f"key {ks.spec.key!r} still at version {ks.version} (want {min_version}, "
                                         f"initialized={ks.initialized}) after {timeout:.1f}s")
                    ks.cond.wait(left)
                out.append((ks.spec.key, ks.value.clone(), ks.version))
        self.counters["pulls"] += 1
        return out, time.monotonic() - t0

    # ---- barrier ---------------------------------------------------------------------------
    def barrier(self, worker: int, name: str, timeout_s: float = 0.0) -> float:
        self._require_job()
        timeout = timeout_s if timeout_s > 0 else self.wait_timeout_s
        t0 = time.monotonic()
        with self._barrier_cond:
            b = self._barriers.setdefault(name, {"gen": 0, "arrived": set()})
            gen = b["gen"]
            b["arrived"].add(worker)
            if self.live <= b["arrived"]:
                b["gen"] += 1
                b["arrived"] = set()
                self._barrier_cond.notify_all()
            while b["gen"] == gen:
                left = t0 + timeout - time.monotonic()
                if left <= 0:
                    b["arrived"].discard(worker)
                    raise ShardError("DEADLINE_EXCEEDED", f"barrier {name!r} timed out after {timeout:.1f}s")
                self._barrier_cond.wait(left)
        return time.monotonic() - t0

    # ---- control ---------------------------------------------------------------------------
    def set_codec(self, spec: str) -> tuple[str, int]:
        with self.lock:
            self.codec = spec
            self.codec_epoch += 1
            return self.codec, self.codec_epoch

    def stats(self) -> dict:
        versions = [ks.version for ks in self.keys.values()] or [0]
        hist = [0] * (max(self.staleness, default=0) + 1)
        for s, n in self.staleness.items():
            hist[s] = n
        return {
            "shard_id": self.shard_id, "num_keys": len(self.keys),
            "min_version": min(versions), "max_version": max(versions),
            "pushes": self.counters["pushes"], "grads_applied": self.counters["grads_applied"],
            "duplicates": self.counters["duplicates"], "pulls": self.counters["pulls"],
            "bytes_received": self.counters["bytes_received"], "bytes_sent": self.counters["bytes_sent"],
            "max_staleness": max(self.staleness, default=0), "staleness_counts": hist,
            "sync": str(self.job.sync) if self.job else "", "live_workers": sorted(self.live),
        }
