"""One embedding table's rows on one shard: lazily allocated rows and row-wise optimizers."""
from __future__ import annotations

import math
from dataclasses import asdict

import torch

from deltaps.embedding import STATE_TENSORS, TableSpec, init_rows, shard_of
from deltaps.errors import EmbeddingError


class ShardTable:
    def __init__(self, spec: TableSpec, shard_id: int, num_shards: int):
        self.spec, self.shard_id, self.num_shards = spec, shard_id, num_shards
        self.local_rows = max(0, -(-(spec.num_rows - shard_id) // num_shards))
        self.slot_of = torch.full((self.local_rows,), -1, dtype=torch.int64)   # local index -> slot
        self.rows = 0                                   # allocated slots
        self.values = torch.empty(0, spec.dim)
        self.state = [torch.empty(0, spec.dim) for _ in range(STATE_TENSORS[spec.optimizer])]
        self.opt_steps = 0                              # adam: SparseAdam's per-parameter step counter
        self.rows_applied = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.spec.bytes_per_row

    # -- state (checkpoints: ps/durability.py) --
    def state_dict(self) -> dict:
        """Plain types + tensors (copies): the spec, the global ids of the allocated rows in slot order,
        their values and optimizer state, the optimizer step counter."""
        local = (self.slot_of >= 0).nonzero().flatten()
        ids = torch.empty(self.rows, dtype=torch.int64)
        ids[self.slot_of[local]] = local * self.num_shards + self.shard_id
        return {"spec": asdict(self.spec), "ids": ids, "values": self.values[:self.rows].clone(),
                "state": [s[:self.rows].clone() for s in self.state], "opt_steps": self.opt_steps,
                "rows_applied": self.rows_applied}

    @classmethod
    def from_state_dict(cls, d: dict, shard_id: int, num_shards: int) -> "ShardTable":
        t = cls(TableSpec(**d["spec"]), shard_id, num_shards)
        ids = d["ids"].to(torch.int64)
        n = ids.numel()
        if d["values"].shape != (n, t.spec.dim) or len(d["state"]) != len(t.state):
            raise ValueError(f"table {t.spec.name}: checkpointed rows do not match its spec")
        t.check_ids(ids)
        t.rows = n
        t.values = d["values"].clone()
        t.state = [s.clone() for s in d["state"]]
        t.slot_of[ids // num_shards] = torch.arange(n)
        t.opt_steps, t.rows_applied = int(d["opt_steps"]), int(d["rows_applied"])
        return t

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.num_rows:
            raise EmbeddingError("INVALID_ARGUMENT", f"table {self.spec.name}: row id out of range "
                                                     f"[0, {self.spec.num_rows}): min {lo}, max {hi}")
        if bool((shard_of(ids, self.num_shards) != self.shard_id).any()):
            raise EmbeddingError("INVALID_ARGUMENT", f"table {self.spec.name}: row ids not owned by shard "
                                                     f"{self.shard_id} (owner = id % {self.num_shards})")

    def missing(self, ids: torch.Tensor) -> torch.Tensor:
        """Unique ids among `ids` not allocated yet."""
        local = ids // self.num_shards
        return torch.unique(ids[self.slot_of[local] < 0])

    def allocate(self, new_ids: torch.Tensor) -> None:
        n = new_ids.numel()
        if n == 0:
            return
        need = self.rows + n
        if need > self.values.shape[0]:
            cap = max(need, min(self.local_rows, max(1024, self.values.shape[0] * 2)))
            self.values = _grow(self.values, cap)
            self.state = [_grow(s, cap) for s in self.state]
        slots = torch.arange(self.rows, need)
        self.values[self.rows:need] = init_rows(self.spec, new_ids.numpy())
        if self.spec.optimizer == "adagrad":
            self.state[0][self.rows:need] = self.spec.initial_accumulator
        else:
            for s in self.state:
                s[self.rows:need] = 0.0
        self.slot_of[new_ids // self.num_shards] = slots
        self.rows = need

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slot_of[ids // self.num_shards]

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return self.values.index_select(0, self.slots(ids))

    def peek(self, ids: torch.Tensor) -> torch.Tensor:
        """Values of `ids` without making rows: a row not held yet reads as its init value."""
        return peek_rows(self.spec, self.values, self.slots(ids), ids)

    @torch.no_grad()
    def apply(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on the rows `ids` (unique, allocated) with gradient rows `grad`."""
        sp = self.spec
        if sp.optimizer == "adam":
            self.opt_steps += 1       # SparseAdam counts steps per table, even if this shard got no rows
        if ids.numel() == 0:
            return
        slots = self.slots(ids)
        p = self.values.index_select(0, slots)
        if sp.optimizer == "sgd":
            p.add_(grad, alpha=-sp.lr)
        elif sp.optimizer == "adagrad":
            s = self.state[0].index_select(0, slots).addcmul_(grad, grad)
            self.state[0].index_copy_(0, slots, s)
            p.addcdiv_(grad, s.sqrt().add_(sp.eps), value=-sp.lr)
        else:   # torch.optim.SparseAdam, operation for operation
            m_old, v_old = self.state[0].index_select(0, slots), self.state[1].index_select(0, slots)
            m_upd = grad.sub(m_old).mul_(1 - sp.beta1)
            v_upd = grad.pow(2).sub_(v_old).mul_(1 - sp.beta2)
            m = m_upd.add_(m_old)
            v = v_upd.add_(v_old)
            self.state[0].index_copy_(0, slots, m)
            self.state[1].index_copy_(0, slots, v)
            denom = v.sqrt().add_(sp.eps)
            step_size = sp.lr * math.sqrt(1 - sp.beta2 ** self.opt_steps) / (1 - sp.beta1 ** self.opt_steps)
            p.add_(m.div(denom).mul_(-step_size))
        self.values.index_copy_(0, slots, p)
        self.rows_applied += ids.numel()

    def stats(self) -> dict:
        return {"rows_held": self.rows, "rows_owned": self.local_rows, "bytes": self.nbytes,
                "optimizer": self.spec.optimizer, "rows_applied": self.rows_applied}


def peek_rows(spec: TableSpec, values: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """values[slots], with init_rows where a slot is -1 (the row is not held)."""
    held = slots >= 0
    if bool(held.all()):
        return values.index_select(0, slots)
    out = torch.empty(ids.numel(), spec.dim)
    out[held] = values.index_select(0, slots[held])
    out[~held] = init_rows(spec, ids[~held].numpy())
    return out


def _grow(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.empty(rows, t.shape[1])
    out[:t.shape[0]] = t
    return out


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted) and the sum of their gradient rows."""
    if ids.numel() == 0:
        return ids, grads
    uniq, inv = torch.unique(ids, return_inverse=True)
    out = torch.zeros(uniq.numel(), grads.shape[1])
    out.index_add_(0, inv, grads)
    return uniq, out
