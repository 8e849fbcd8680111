"""EmbeddingClient: sparse pull/push of embedding rows across all shards in parallel (one channel per shard).

Rows live on shard id % num_shards, or splitmix64(id) % num_shards for a dynamic table (one rule for both
sides: deltaps.embedding.shard_of; ps/embedding/ applies the row-wise optimizer there). Shard restarts
(from a checkpoint) and evictions are handled per shard by worker/embedding/session.py: reconnect, replay,
rejoin. The nn.Module side (PSEmbedding, replace_embeddings) is worker/embedding/modules.py.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from deltaps.embedding import TableSpec, ids_to_bytes, rows_from_bytes, rows_to_bytes
from deltaps.errors import call
from deltaps.transport import DEFAULT_MAX_MESSAGE_BYTES, client_channels
from protos import PROTOCOL_VERSION, pb, rpc
from worker.comm_stats import CommStats
from worker.embedding.session import EmbeddingSession
from worker.session import SessionPolicy


class PendingPull:
    """An EmbeddingClient pull in flight: result() -> (values per table, the servers' longest BSP wait)."""

    def __init__(self, out: dict[str, torch.Tensor], futures: list):
        self.out, self.futures = out, futures

    def result(self) -> tuple[dict[str, torch.Tensor], float]:
        return self.out, max((f.result() for f in self.futures), default=0.0)


class EmbeddingClient:
    """Sparse pull/push of embedding rows across all shards, in parallel (one channel per shard)."""

    def __init__(self, servers: list[str], worker_id: int, world_size: int, tables: list[TableSpec], *,
                 sync: str = "bsp", timeout_s: float = 300.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = 4 << 20, security=None, reconnect_deadline_s: float = 60.0,
                 replay_steps: int = 256):
        if not servers:
            raise ValueError("at least one server address is needed")
        from deltaps.security import Security
        self.security = security if security is not None else Security.from_env()
        self.servers, self.worker_id, self.world_size = list(servers), worker_id, world_size
        self.n = len(self.servers)
        self.tables = {t.name: t for t in tables}
        self.sync, self.timeout_s, self.chunk_bytes = sync, timeout_s, chunk_bytes
        self.channels = client_channels(self.security, self.servers, max_message_bytes)
        self.stubs = [rpc.ParameterServerStub(ch) for ch in self.channels]
        self.closed = threading.Event()
        policy = SessionPolicy(worker_id, timeout_s + 30, reconnect_deadline_s, replay_steps)
        self.sessions = [EmbeddingSession(stub, ch, addr, i, policy, self.closed)
                         for i, (stub, ch, addr) in enumerate(zip(self.stubs, self.channels, self.servers))]
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * self.n), thread_name_prefix="emb-client")
        self.stats = CommStats()
        self.versions = [0] * self.n
        self.memory_caps = [0] * self.n

    def register(self) -> int:
        """Register the tables with every shard (waits up to the reconnect deadline for shards to come up);
        returns the min version."""
        req = pb.RegisterEmbeddingRequest(protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id,
                                          world_size=self.world_size, num_shards=self.n, sync=self.sync)
        for t in self.tables.values():
            t.to_proto(req.tables.add())
        reps = list(self.pool.map(lambda shard: self.sessions[shard].register(req), range(self.n)))
        for s, r in enumerate(reps):
            self.versions[s], self.memory_caps[s] = r.version, r.memory_cap_bytes
        return min(self.versions)

    # ---- routing -------------------------------------------------------------------------
    def _split(self, table: str, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per shard: (positions in ids, ids)."""
        owner = self.tables[table].owner(ids, self.n)
        out = []
        for s in range(self.n):
            pos = (owner == s).nonzero().flatten()
            out.append((pos, ids[pos]))
        return out

    def _rows_per_request(self, table: str) -> int:
        return max(1, self.chunk_bytes // (self.tables[table].dim * 4))

    # ---- pull ----------------------------------------------------------------------------
    def pull_rows(self, ids_by_table: dict[str, torch.Tensor], min_version: int = 0,
                  peek: bool = False) -> tuple[dict, float]:
        """Values [len(ids), dim] per table for the given (unique) ids, from shards at >= min_version.
        Returns (values, seconds the servers held the pull waiting for other workers). peek: an evaluation's
        pull, which leaves the tables as they are (no rows made, touched or counted)."""
        return self.pull_rows_async(ids_by_table, min_version, peek).result()

    def pull_rows_async(self, ids_by_table: dict[str, torch.Tensor], min_version: int = 0,
                        peek: bool = False) -> PendingPull:
        """pull_rows started on the client's threads (one per shard); .result() gives what pull_rows returns."""
        per_shard = {s: [] for s in range(self.n)}       # shard -> [(table, positions, ids)]
        out = {}
        for name, ids in ids_by_table.items():
            ids = ids.to(torch.int64).flatten()
            out[name] = torch.empty(ids.numel(), self.tables[name].dim)
            for s, (pos, sid) in enumerate(self._split(name, ids)):
                per_shard[s].append((name, pos, sid))

        def one(shard):
            waited = 0.0
            # requests of at most chunk_bytes of values each; always at least one (the BSP gate)
            batches, cur, cur_rows = [], [], 0
            for name, pos, sid in per_shard[shard]:
                per = self._rows_per_request(name)
                for lo in range(0, max(1, sid.numel()), per):
                    part = (name, pos[lo:lo + per], sid[lo:lo + per])
                    if cur and cur_rows + part[2].numel() > per:
                        batches.append(cur)
                        cur, cur_rows = [], 0
                    cur.append(part)
                    cur_rows += part[2].numel()
            batches.append(cur)
            for batch in batches:
                req = pb.SparsePullRequest(worker_id=self.worker_id, min_version=min_version, timeout_s=self.timeout_s,
                                           peek=peek, rows=[pb.EmbeddingRows(table=n, ids=ids_to_bytes(i)) for n, _, i in batch])
                t0 = time.perf_counter()
                rep = self.sessions[shard].pull(req, self.timeout_s + 30)
                self.stats.add(pull_rpcs=1, pull_s=time.perf_counter() - t0,
                               bytes_pulled_wire=sum(len(r.values) for r in rep.rows),
                               bytes_pull_req=sum(len(r.ids) for r in req.rows))
                waited = max(waited, rep.waited_s)
                self.versions[shard] = rep.version
                for (name, pos, sid), r in zip(batch, rep.rows):
                    out[name][pos] = rows_from_bytes(r.values, sid.numel(), self.tables[name].dim)
            return waited
        return PendingPull(out, [self.pool.submit(one, s) for s in range(self.n)])

    # ---- push ----------------------------------------------------------------------------
    def push_rows_async(self, step: int, grads: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """Start pushing (ids, grad rows) per table for `step`: one request per shard, even an empty one
        (rows a worker did not touch count as pushed with zero gradient). Returns the futures."""
        per_shard = {s: [] for s in range(self.n)}
        for name, (ids, g) in grads.items():
            ids = ids.to(torch.int64).flatten()
            g = g.detach().reshape(ids.numel(), self.tables[name].dim)
            for s, (pos, sid) in enumerate(self._split(name, ids)):
                if sid.numel():
                    per_shard[s].append(pb.EmbeddingRows(table=name, ids=ids_to_bytes(sid),
                                                         values=rows_to_bytes(g.index_select(0, pos))))

        def one(shard):
            req = pb.SparsePushRequest(worker_id=self.worker_id, step=step, grads=per_shard[shard])
            t0 = time.perf_counter()
            rep = self.sessions[shard].push(req, self.timeout_s + 30)
            wire = sum(len(r.ids) + len(r.values) for r in req.grads)
            self.stats.add(push_rpcs=1, push_s=time.perf_counter() - t0, bytes_pushed_wire=wire,
                           bytes_pushed_raw=wire, rows_pushed=sum(len(r.ids) // 8 for r in req.grads))
            return rep
        return [self.pool.submit(one, s) for s in range(self.n)]

    def push_rows(self, step: int, grads: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for f in self.push_rows_async(step, grads):
            f.result()

    def server_stats(self) -> list[dict]:
        import json
        return [json.loads(call(s.EmbeddingStats, pb.EmbeddingStatsRequest(), 30).json) for s in self.stubs]

    @property
    def restarts(self) -> int:
        """Shard restarts this client recovered from (re-registered and replayed)."""
        return sum(s.restarts for s in self.sessions)

    def close(self) -> None:
        self.closed.set()
        for s in self.sessions:
            s.close()
        self.pool.shutdown(wait=False)
        # each session's Channel.subscribe started grpc's connectivity poller, which wakes every 0.2 s: a channel
        # closed under it raises "Cannot monitor channel state: Channel closed!" in that thread (a traceback on
        # stderr, seen once in `make test`), so let it see the unsubscribe first (grpc's own state; absent: no wait)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
                getattr(getattr(ch, "_connectivity_state", None), "polling", False) for ch in self.channels):
            time.sleep(0.01)
        for ch in self.channels:
            ch.close()
