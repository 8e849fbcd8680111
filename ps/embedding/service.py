"""Servicer bodies of the embedding RPCs (ps/server.py keeps thin wrappers)."""
from __future__ import annotations

import json

from deltaps.embedding import TableSpec, ids_from_bytes, rows_from_bytes, rows_to_bytes
from ps.embedding.store import EmbeddingStore


def store_of(shard, memory_cap_bytes: int | None = None) -> EmbeddingStore:
    """The shard's EmbeddingStore, created on first use (unlimited unless attach() set a cap)."""
    store = getattr(shard, "embedding", None)
    if store is None:
        store = EmbeddingStore(shard.shard_id, shard.num_shards, memory_cap_bytes or 0, shard.wait_timeout_s)
        shard.embedding = store
    return store


def attach(shard, memory_cap_bytes: int = 0) -> EmbeddingStore:
    shard.embedding = EmbeddingStore(shard.shard_id, shard.num_shards, memory_cap_bytes, shard.wait_timeout_s)
    return shard.embedding


def handle_register(shard, req, pb):
    store = store_of(shard)
    version = store.register(req.worker_id, req.world_size, req.num_shards, req.sync or "bsp",
                             [TableSpec.from_proto(t) for t in req.tables])
    return pb.RegisterEmbeddingResponse(shard_id=shard.shard_id, version=version,
                                        memory_cap_bytes=store.memory_cap_bytes, server_id=shard.server_id)


def handle_pull(shard, req, pb):
    store = store_of(shard)
    reqs = [(r.table, ids_from_bytes(r.ids)) for r in req.rows]
    values, version, waited = store.pull(req.worker_id, reqs, req.min_version, req.timeout_s)
    rows = [pb.EmbeddingRows(table=r.table, values=rows_to_bytes(v)) for r, v in zip(req.rows, values)]
    store.counters["bytes_sent"] += sum(len(r.values) for r in rows)
    return pb.SparsePullResponse(rows=rows, version=version, waited_s=waited)


def handle_push(shard, req, pb):
    store = store_of(shard)
    grads = []
    for r in req.grads:
        ids = ids_from_bytes(r.ids)
        t = store.table(r.table)
        grads.append((r.table, ids, rows_from_bytes(r.values, ids.numel(), t.spec.dim)))
    store.counters["bytes_received"] += sum(len(r.ids) + len(r.values) for r in req.grads)
    dup, version = store.push(req.worker_id, req.step, grads)
    return pb.SparsePushResponse(duplicate=dup, version=version)


def handle_stats(shard, req, pb):
    return pb.EmbeddingStatsResponse(json=json.dumps(store_of(shard).stats()))
