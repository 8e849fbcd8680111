"""Row-sparse embedding tables on a shard: lazily allocated rows, row-wise optimizers, BSP per step.

A table of `num_rows` x `dim` float32 rows is sharded by row id: row r lives on shard r % num_shards, at
local index r // num_shards. A shard allocates a row the first time a worker pulls it (its initial value
is a pure function of (seed, row, column), so lazy allocation on n shards gives exactly the values a dense
preallocated table would hold) and keeps its optimizer state next to it. A per-shard memory cap
(`deltaps server --embedding-memory-cap`) bounds values + optimizer state of all tables of the shard: a pull
that would allocate past it is refused with RESOURCE_EXHAUSTED naming table, shard, cap and row counts.

Dynamic tables (`TableSpec(dynamic=True)`, ps/embedding/dynamic.py): no row count, any id in [0, 2**63),
the owner is splitmix64(id) % num_shards (deltaps.embedding.shard_of), rows evicted after `ttl_steps`
untouched steps and admitted by a frequency filter (`min_count` pulls).

Optimizers (row-wise, only rows in the step's gradient are touched, state allocated per row):
  * sgd      p -= lr * g                                 (== torch.optim.SGD, no momentum / weight decay)
  * adagrad  s += g*g; p -= lr * g / (sqrt(s) + eps)      (== torch.optim.Adagrad, sparse or dense)
  * adam     lazy Adam, torch.optim.SparseAdam semantics: per-row m, v; one step counter per table
             (incremented every applied step); bias correction uses it.

Sync: bsp. A worker sends one SparsePush per shard per step (possibly empty: rows it did not touch count
as pushed with zero gradient); once every live worker pushed step t the shard coalesces the rows
(sum over workers of duplicate ids), divides by the number of workers (the mean gradient, as DDP
computes it for a dense table) and applies the optimizer once; the shard's version becomes t + 1.
SparsePull(min_version=t) blocks until then. `asp` applies every push on arrival (scaled by 1/W) and
never blocks pulls, as Persia does for its embedding PS; it is accepted but not what the bench uses.

Reliability as for dense keys (docs/failure-semantics.md): the store's state_dict() is part of the shard's
checkpoint (ps/durability.py) and restore() loads it into the store attach() configured; a silent worker is
evicted (its own reaper, and ps/membership.py's evict), a registering one rejoins at the current version;
a push re-sent after a restart (`replay`) may allocate the rows the restored shard lacks.
"""
from ps.embedding.dynamic import DynamicTable
from ps.embedding.service import attach, handle_pull, handle_push, handle_register, handle_stats, store_of
from ps.embedding.store import EmbeddingStore
from ps.embedding.table import ShardTable, coalesce

__all__ = ["DynamicTable", "EmbeddingStore", "ShardTable", "attach", "coalesce", "handle_pull", "handle_push", "handle_register",
           "handle_stats", "store_of"]
