"""Servicer bodies of the embedding RPCs (ps/server.py keeps thin wrappers)."""
from __future__ import annotations

import json

from deltaps.embedding import TableSpec, ids_from_bytes, rows_from_bytes, rows_to_bytes
from deltaps.errors import EmbeddingError
from ps.embedding.store import EmbeddingStore


def _new_store(shard, memory_cap_bytes: int) -> EmbeddingStore:
    return EmbeddingStore(shard.shard_id, shard.num_shards, memory_cap_bytes, shard.wait_timeout_s,
                          worker_timeout_s=getattr(shard, "worker_timeout_s", 0.0))


def store_of(shard, memory_cap_bytes: int | None = None) -> EmbeddingStore:
    """The shard's EmbeddingStore, created on first use (unlimited unless attach() set a cap)."""
    store = getattr(shard, "embedding", None)
    if store is None:
        store = shard.embedding = _new_store(shard, memory_cap_bytes or 0)
    return store


def attach(shard, memory_cap_bytes: int = 0) -> EmbeddingStore:
    """Give the shard an embedding store with this memory cap (`deltaps server --embedding-memory-cap`); a
    store already there (restored from a checkpoint) keeps its rows and takes the cap."""
    store = getattr(shard, "embedding", None)
    if store is None:
        return store_of(shard, memory_cap_bytes)
    with store.cond:
        store.memory_cap_bytes = int(memory_cap_bytes or 0)
    return store


def _check_server_id(shard, req) -> None:
    """A request addressed to an earlier incarnation of this shard is refused (ABORTED): the client
    re-registers and replays what the restart lost before anything else is applied."""
    if req.server_id and req.server_id != shard.server_id:
        raise EmbeddingError("ABORTED", f"shard {shard.shard_id} restarted (server_id {shard.server_id}, request "
                                        f"for {req.server_id}); RegisterEmbedding again and replay")


def handle_register(shard, req, pb):
    store = store_of(shard)
    version = store.register(req.worker_id, req.world_size, req.num_shards, req.sync or "bsp",
                             [TableSpec.from_proto(t) for t in req.tables])
    return pb.RegisterEmbeddingResponse(shard_id=shard.shard_id, version=version,
                                        memory_cap_bytes=store.memory_cap_bytes, server_id=shard.server_id,
                                        step=store.pushed.get(req.worker_id, 0),
                                        durable_step=shard.durable_step(req.worker_id))


def handle_pull(shard, req, pb, alive=None, max_bytes: int = 0):
    """alive: the RPC's is_active (a waiting pull whose client went away ends); max_bytes: the largest answer the
    server sends — a pull past it is refused before any row is made, touched or gathered."""
    _check_server_id(shard, req)
    store = store_of(shard)
    reqs = [(r.table, ids_from_bytes(r.ids)) for r in req.rows]
    answer = sum(ids.numel() * store.table(name).spec.dim * 4 for name, ids in reqs)
    if max_bytes and answer > max_bytes:
        raise EmbeddingError("RESOURCE_EXHAUSTED", f"a pull of {sum(ids.numel() for _, ids in reqs)} rows is a "
                                                   f"{answer} B answer, over the {max_bytes} B message limit "
                                                   f"(--max-message-bytes); pull fewer rows a request")
    values, version, waited = store.pull(req.worker_id, reqs, req.min_version, req.timeout_s, peek=req.peek,
                                         alive=alive)
    rows = [pb.EmbeddingRows(table=r.table, values=rows_to_bytes(v)) for r, v in zip(req.rows, values)]
    store.counters["bytes_sent"] += sum(len(r.values) for r in rows)
    return pb.SparsePullResponse(rows=rows, version=version, waited_s=waited)


def handle_push(shard, req, pb, alive=None):
    _check_server_id(shard, req)
    store = store_of(shard)
    grads = []
    for r in req.grads:
        ids = ids_from_bytes(r.ids)
        t = store.table(r.table)
        grads.append((r.table, ids, rows_from_bytes(r.values, ids.numel(), t.spec.dim)))
    store.counters["bytes_received"] += sum(len(r.ids) + len(r.values) for r in req.grads)
    dup, version = store.push(req.worker_id, req.step, grads, replay=req.replay, alive=alive)
    return pb.SparsePushResponse(duplicate=dup, version=version, durable_step=shard.durable_step(req.worker_id),
                                 server_id=shard.server_id)


def handle_stats(shard, req, pb):
    return pb.EmbeddingStatsResponse(json=json.dumps(store_of(shard).stats()))
