"""Embedding table specs, row ownership, their deterministic initialisation and the row wire format: what
shards and clients of row-sparse embedding tables must agree on (the server's store is ps/embedding/)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from deltaps.errors import EmbeddingError

OPTIMIZERS = ("sgd", "adagrad", "adam")
INITS = ("uniform", "zeros")
STATE_TENSORS = {"sgd": 0, "adagrad": 1, "adam": 2}
MAX_DIM = 1 << 16               # a row of 256 KiB; one row must fit a message with room to spare
MAX_ROWS = (1 << 31) - 1        # a fixed table's row index is dense on every shard; beyond it, a dynamic table


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int
    optimizer: str = "adagrad"
    lr: float = 0.01
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0
    init: str = "uniform"
    init_scale: float = 0.05
    seed: int = 0
    # dynamic: no row count; any id in [0, 2**63) is a row (raw 64-bit feature ids), hashed to shards,
    # allocated on first touch. Only dynamic tables evict (ttl_steps) and filter (min_count).
    dynamic: bool = False
    ttl_steps: int = 0      # evict a row untouched (no pull, no push) for this many table steps; 0 = never
    min_count: int = 0      # frequency filter: allocate a row on its min_count-th pull; 0 or 1 = first pull

    def validate(self) -> None:
        if not self.name:
            raise ValueError("embedding table needs a name")
        if not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"table {self.name}: dim must be in [1, {MAX_DIM}], got {self.dim}")
        if self.dynamic:
            if self.num_rows != 0:
                raise ValueError(f"table {self.name}: a dynamic table has no row count (num_rows must be 0, "
                                 f"not {self.num_rows})")
            if self.ttl_steps < 0 or self.min_count < 0:
                raise ValueError(f"table {self.name}: ttl_steps and min_count must be >= 0 "
                                 f"(got {self.ttl_steps}, {self.min_count})")
        else:
            if not 1 <= self.num_rows <= MAX_ROWS:
                raise ValueError(f"table {self.name}: num_rows must be in [1, {MAX_ROWS}] (or declare the table "
                                 f"dynamic), got {self.num_rows}")
            if self.ttl_steps or self.min_count:
                raise ValueError(f"table {self.name}: ttl_steps and min_count apply to dynamic tables only")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"table {self.name}: unknown optimizer {self.optimizer!r}; use {', '.join(OPTIMIZERS)}")
        if self.init not in INITS:
            raise ValueError(f"table {self.name}: unknown init {self.init!r}; use {', '.join(INITS)}")
        # the row optimizers' own domains (a beta of 1 divides by zero at the first step, a NaN poisons every row)
        if not 0 < self.lr < math.inf:
            raise ValueError(f"table {self.name}: lr must be > 0 and finite, got {self.lr}")
        for name in ("eps", "initial_accumulator", "init_scale"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"table {self.name}: {name} must be >= 0 and finite, got {getattr(self, name)}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"table {self.name}: beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")

    @property
    def bytes_per_row(self) -> int:
        return self.dim * 4 * (1 + STATE_TENSORS[self.optimizer])

    @property
    def nbytes(self) -> int:
        """Values only (what a dense nn.Embedding of this size holds; 0 for a dynamic table)."""
        return self.num_rows * self.dim * 4

    def owner(self, ids: torch.Tensor, num_shards: int) -> torch.Tensor:
        return shard_of(ids, num_shards, self.dynamic)

    def to_proto(self, msg) -> None:
        for k, v in self.__dict__.items():
            setattr(msg, k, v)

    @classmethod
    def from_proto(cls, msg) -> "TableSpec":
        return cls(**{k: getattr(msg, k) for k in cls.__dataclass_fields__})


# ---- deterministic initialisation: a pure function of (seed, row, column) ---------------------------------
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def shard_of(ids: torch.Tensor, num_shards: int, dynamic: bool = False) -> torch.Tensor:
    """The shard holding each row (int64 tensor): id % n for fixed tables (shard-local index id // n);
    splitmix64(id) % n for dynamic ones, so adjacent or strided raw feature ids spread over the shards.
    Servers check ownership and clients route with this one function."""
    ids = ids.to(torch.int64)
    if not dynamic:
        return ids % num_shards
    with np.errstate(over="ignore"):
        h = _mix(ids.cpu().numpy().astype(np.uint64) + _GOLD)   # negative ids wrap: their owner refuses them
    return torch.from_numpy((h % np.uint64(num_shards)).astype(np.int64)).to(ids.device)


def hash_uniform(ids, dim: int, seed: int, scale: float = 1.0, salt: int = 0) -> torch.Tensor:
    """float32 [len(ids), dim], uniform in [-scale, scale), identical for a row wherever it is computed."""
    ids = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        base = _mix(ids * _GOLD + np.uint64((seed * 1_000_003 + salt * 7_919 + 1) & 0xFFFFFFFFFFFFFFFF))
        cols = np.arange(dim, dtype=np.uint64) * _GOLD
        h = _mix(base[:, None] ^ cols[None, :])
    u = (h >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))   # [0, 1)
    return torch.from_numpy((u * np.float32(2 * scale) - np.float32(scale)).astype(np.float32))


def init_rows(spec: TableSpec, ids) -> torch.Tensor:
    if spec.init == "zeros":
        return torch.zeros(len(ids), spec.dim)
    return hash_uniform(ids, spec.dim, spec.seed, spec.init_scale)


def dense_init(spec: TableSpec, block: int = 1 << 16) -> torch.Tensor:
    """The whole table as one dense tensor (what an nn.Embedding in allreduce / ps mode starts from)."""
    if spec.dynamic:
        raise ValueError(f"table {spec.name}: a dynamic table has no dense form")
    out = torch.empty(spec.num_rows, spec.dim)
    for lo in range(0, spec.num_rows, block):
        hi = min(spec.num_rows, lo + block)
        out[lo:hi] = init_rows(spec, np.arange(lo, hi))
    return out


# ---- row wire format ----------------------------------------------------------------------------------------
def ids_to_bytes(ids: torch.Tensor) -> bytes:
    return ids.to(torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes()


def ids_from_bytes(b: bytes) -> torch.Tensor:
    if len(b) % 8:
        raise EmbeddingError("INVALID_ARGUMENT", "row ids must be int64 (length a multiple of 8)")
    return torch.from_numpy(np.frombuffer(b, dtype="<i8").astype(np.int64))


def rows_to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to(torch.float32).contiguous().numpy().tobytes()


def rows_from_bytes(b: bytes, n: int, dim: int) -> torch.Tensor:
    if len(b) != n * dim * 4:
        raise EmbeddingError("INVALID_ARGUMENT", f"row values: {len(b)} bytes for {n} rows x {dim} float32")
    return torch.from_numpy(np.frombuffer(b, dtype=np.float32).copy()).view(n, dim)
