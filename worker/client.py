"""PSClient: push/pull by parameter name across all shards in parallel (one channel per shard)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np
import torch

from compression.base import NoneCodec, Payload, dtype_name
from deltaps.errors import PSError, call
from deltaps.layout import (
    DEFAULT_CHUNK_BYTES,
    Key,
    build_layout,
    check_message_limits,
    fused_message_bytes,
    layout_digest,
    matrix_cols,
    message_batches,
    role_for_buffers,
)
from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import DELTA, FULL, matrix_codec, offered_digests
from deltaps.sync import parse_sync
from deltaps.transport import DEFAULT_MAX_MESSAGE_BYTES, client_channels
from deltaps.wire import accumulate_payload_into, chunk_from_tensor, fill_chunk, read_chunk
from protos import PROTOCOL_VERSION, pb, rpc
from worker.comm_stats import CommStats
from worker.session import SessionPolicy, ShardSession

log = logging.getLogger("deltaps.client")


class PSClient:
    def __init__(self, servers: list[str], worker_id: int, world_size: int, *, sync: str = "bsp",
                 optimizer: OptimizerConfig | None = None, codec: str = "none", compressor=None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 timeout_s: float = 300.0, pull_codec: str = "auto", security=None,
                 reconnect_deadline_s: float = 60.0, replay_steps: int = 256, min_workers: int = 0,
                 max_workers: int = 0, local_steps: int = 0, heartbeat_s: float = 0.0):
        if not servers:
            raise ValueError("at least one server address is needed")
        if replay_steps < 1:        # before any channel or thread exists: a refused client leaks none
            raise ValueError(f"replay_steps must be >= 1, got {replay_steps}")
        check_message_limits(chunk_bytes, max_message_bytes)
        self.servers = list(servers)
        self.worker_id, self.world_size = worker_id, world_size
        self.min_workers, self.max_workers = min_workers, max_workers   # elastic job bounds (0 = world_size)
        self.live_workers: list[int] = list(range(world_size))          # as the shards last reported it
        self.quorum_paces: dict[int, float] = {}     # shard -> its quorum rounds' recent open-to-quorum span (pulls)
        self.job_stop: dict | None = None     # a worker stopped the job (--sync quorum): its step and time_s
        self.sync = parse_sync(sync)
        self.local_steps = local_steps    # > 0: a local-update job (pushes are deltas, the optimizer is the outer one)
        self.optimizer = optimizer or OptimizerConfig()
        self.codec, self.codec_epoch = codec, 0
        from compression import Compressor
        self.compressor = compressor or Compressor(codec)
        self._raw = NoneCodec()
        self.chunk_bytes = chunk_bytes
        # raw data per PushPull message: its request and its answer (even a full-value one) stay below the limit
        self.fused_bytes = fused_message_bytes(chunk_bytes, max_message_bytes)
        self.timeout_s = timeout_s
        # security: a deltaps.security.Security (token, TLS); None = token from $DELTAPS_TOKEN if set, plaintext
        from deltaps.security import Security
        self.security = security if security is not None else Security.from_env()
        self.channels = client_channels(self.security, self.servers, max_message_bytes)
        self.stubs = [rpc.ParameterServerStub(ch) for ch in self.channels]
        self.pool = ThreadPoolExecutor(max_workers=max(8, 4 * len(servers)), thread_name_prefix="ps-client")
        self.stats = CommStats()
        self.layout: list[Key] = []
        self.by_param: dict[str, list[Key]] = {}
        self.versions: dict[str, int] = {}
        self.view_versions: dict[str, int] = {}   # version of the shared pull view held, per key
        self.pull_codec = pull_codec
        self._seq, self._seq_lock, self.closed = 0, threading.Lock(), threading.Event()
        # failure handling (worker/session.py): reconnect deadline, per-shard replay buffers
        policy = SessionPolicy(worker_id, timeout_s, reconnect_deadline_s, replay_steps)
        self.sessions = [ShardSession(self.stubs[i], addr, i, policy, self.closed, self.on_shard_restart)
                         for i, addr in enumerate(self.servers)]
        self.start_step = 0        # min over shards of RegisterResponse.step: where a (re)joining worker starts
        self.heartbeat_s = heartbeat_s   # > 0: a thread tells every shard this worker is alive (ps/membership.py)
        self._beats: threading.Thread | None = None
        self._attendance: list = [None] * len(self.servers)   # per shard: the open Attend stream (heartbeat_s > 0)

    # ---- setup -----------------------------------------------------------------------------
    def setup(self, named: list[tuple[str, torch.Tensor]], buffers: list[tuple[str, torch.Tensor]] = (),
              buffer_sync: str = "broadcast", pull: bool = True) -> dict[str, torch.Tensor] | None:
        """Register with every shard, let rank 0 initialise the keys, then pull the server's values (pull=False:
        the caller pulls them itself — one model download, not two, on a slow link).
        buffers: model buffers the shards keep in sync as buffer_sync says (broadcast | average | local:
        left out of the layout; see ps/buffers.py); they are pushed and pulled by name like parameters."""
        params = [(n, t.numel(), dtype_name(t.dtype)) for n, t in named]
        role = role_for_buffers(buffer_sync)
        bufs = [(n, t.numel()) for n, t in buffers] if role else []
        cutter = matrix_codec(self.codec, self.pull_codec)
        cols = {n: matrix_cols(tuple(t.shape)) for n, t in named} if cutter else None
        balanced = cutter is not None and cutter.matrix_keys == "balanced"
        self.layout = build_layout(params, len(self.servers), self.chunk_bytes, bufs, role, cols,
                                   cutter.shaped_wire_nbytes if balanced else None)
        self.by_param = defaultdict(list)
        for k in self.layout:
            self.by_param[k.param].append(k)
        digest = layout_digest(self.layout, len(self.servers))
        opt_msg = pb.OptimizerConfig()
        self.optimizer.to_proto(opt_msg)

        def register(shard):
            keys = [pb.KeySpec(key=k.key, param=k.param, offset=k.offset, numel=k.numel, dtype=k.dtype, shard=k.shard,
                               role=k.role, cols=k.cols) for k in self.layout if k.shard == shard]
            req = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id,
                                     world_size=self.world_size, num_shards=len(self.servers), sync=str(self.sync),
                                     optimizer=opt_msg, keys=keys, layout_digest=digest, codec=self.codec,
                                     pull_codec=self.pull_codec, min_workers=self.min_workers,
                                     max_workers=self.max_workers, local_steps=self.local_steps,
                                     heartbeat_s=self.heartbeat_s)
            return self.sessions[shard].register(req)

        replies = list(self.pool.map(register, range(len(self.servers))))
        if self.heartbeat_s > 0 and self._beats is None:
            self._attend()
            self._beats = threading.Thread(target=self._heartbeats, name="ps-heartbeat", daemon=True)
            self._beats.start()
        if replies:
            self._note_codec(replies[0].codec, replies[0].codec_epoch)
            self.start_step = min(rep.step for rep in replies)
            self.live_workers = list(replies[0].live_workers) or self.live_workers
        if self.worker_id == 0:
            values = dict(named) | {n: t.detach().to(torch.float32) for n, t in buffers}
            # every shard at once: each builds its optimizers on its first Init
            fresh = [shard for shard, rep in enumerate(replies) if not rep.initialized]
            list(self.pool.map(lambda shard: self._init_shard(shard, values), fresh))
        return self.pull(min_version=0) if pull else None

    def _init_shard(self, shard: int, values: dict[str, torch.Tensor]) -> None:
        for batch in message_batches([k for k in self.layout if k.shard == shard], self.chunk_bytes):
            chunks = [chunk_from_tensor(k.key, self._slice(values[k.param], k)) for k in batch]
            req = pb.InitRequest(worker_id=self.worker_id, values=chunks)
            self.sessions[shard].call("Init", lambda req=req: req, self.timeout_s)

    @staticmethod
    def _slice(t: torch.Tensor, k: Key) -> torch.Tensor:
        return t.detach().reshape(-1)[k.offset:k.offset + k.numel]

    def keys_by_shard(self, names) -> dict[int, list[Key]]:
        groups = defaultdict(list)
        for n in names:
            if n not in self.by_param:
                raise KeyError(f"unknown parameter {n!r}")
            for k in self.by_param[n]:
                groups[k.shard].append(k)
        return groups

    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def _note_codec(self, codec: str, epoch: int) -> None:
        if codec and epoch >= self.codec_epoch:
            self.codec, self.codec_epoch = codec, epoch

    # ---- push ------------------------------------------------------------------------------
    def _encode(self, k: Key, t: torch.Tensor, step: int) -> Payload:
        if k.is_buffer:     # buffer values are assigned on the shard: never compressed, always float32
            return self._raw.compress(t.to(torch.float32))
        t = t.view(-1, k.cols) if k.cols else t      # a matrix key: the codec sees its (rows, cols) view (lowrank)
        return self.compressor.compress(k.key, t, step=step, seed=zlib.crc32(f"{k.key}/{step}/{self.worker_id}".encode()))

    def _fill_push(self, req, batch: list[Key], grads: dict[str, torch.Tensor], step: int,
                   inner_steps: int = 0) -> tuple[int, int]:
        """Fill PushRequest req in place with one batch of keys, gradients encoded by the codec in force (inner_steps:
        a local-update delta's, PushRequest.inner_steps); returns (raw bytes, wire bytes)."""
        raw = wire = 0
        for k in batch:
            g = self._slice(grads[k.param], k)
            wire += fill_chunk(req.grads.add(), k.key, self._encode(k, g, step))
            raw += g.numel() * g.element_size()
        req.worker_id, req.step, req.seq, req.inner_steps = self.worker_id, step, self._next_seq(), inner_steps
        req.pulled_versions.extend(self.versions.get(k.key, 0) for k in batch)
        return raw, wire

    def push_keys(self, shard: int, keys: list[Key], grads: dict[str, torch.Tensor], step: int) -> None:
        """Blocking push of some keys to one shard (split into messages of about chunk_bytes)."""
        for batch in message_batches(keys, self.chunk_bytes):
            req = pb.PushRequest()
            raw, wire = self._fill_push(req, batch, grads, step)
            t0 = time.perf_counter()
            self.sessions[shard].push(req, self.timeout_s)
            self.stats.add(push_rpcs=1, push_s=time.perf_counter() - t0, bytes_pushed_raw=raw, bytes_pushed_wire=wire)

    def push_pull_keys(self, shard: int, keys: list[Key], grads: dict[str, torch.Tensor], step: int,
                       min_version: int, out: dict[str, torch.Tensor], inner_steps: int = 0) -> float:
        """Push some keys to one shard and pull their next values (delta pulls into `out`, the shared
        view) in one PushPull round trip per message; returns the server-side wait. Messages hold up to
        fused_bytes (2 x chunk_bytes, less when max_message_bytes is tight) of raw data, so a step
        of a model a few chunks large costs about one RPC per shard instead of a push and a pull per
        parameter."""
        waited = 0.0
        for batch in message_batches(keys, self.fused_bytes):
            req = pb.PushPullRequest()      # the push half is filled in place (no merge copy of its bodies)
            raw, wire = self._fill_push(req.push, batch, grads, step, inner_steps)
            t0 = time.perf_counter()
            rep = self.sessions[shard].push_pull(req, lambda b=batch: self._pull_request(b, min_version, True, out),
                                                 self.timeout_s + 10)
            dt = time.perf_counter() - t0
            self.stats.add(push_pull_rpcs=1, push_rpcs=1, push_pull_s=dt, bytes_pushed_raw=raw, bytes_pushed_wire=wire)
            waited = max(waited, self._take_pull(shard, batch, rep.pull, out, True))
        return waited

    def push(self, grads: dict[str, torch.Tensor], step: int) -> None:
        for f in self.push_async(grads, step):
            f.result()

    def push_async(self, grads: dict[str, torch.Tensor], step: int) -> list[Future]:
        return [self.pool.submit(self.push_keys, s, ks, grads, step) for s, ks in self.keys_by_shard(grads).items()]

    # ---- pull ------------------------------------------------------------------------------
    def pull_keys(self, shard: int, keys: list[Key], min_version: int, out: dict[str, torch.Tensor],
                  delta: bool = False) -> float:
        """Blocking pull into out[param] (flat float32 buffers); returns the server-side wait.

        delta=True: `out` is this client's persistent copy of the shared view; the server sends only
        compressed deltas (or nothing) for keys it already holds (see deltaps/pull_codec.py)."""
        waited = 0.0
        for batch in message_batches(keys, self.chunk_bytes):
            t0 = time.perf_counter()
            rep = self.sessions[shard].call("Pull", lambda b=batch: self._pull_request(b, min_version, delta, out),
                                            self.timeout_s + 10)
            self.stats.add(pull_s=time.perf_counter() - t0)
            waited = max(waited, self._take_pull(shard, batch, rep, out, delta))
        return waited

    def _pull_request(self, batch: list[Key], min_version: int, delta: bool, out: dict[str, torch.Tensor]):
        # rebuilt per attempt: a restarted shard needs full values again — unless they are what `out` holds
        have = [self.view_versions.get(k.key, -1) for k in batch] if delta else []
        held = [self._slice(out[k.param], k) if v < 0 else None for k, v in zip(batch, have)]
        return pb.PullRequest(worker_id=self.worker_id, keys=[k.key for k in batch], min_version=min_version,
                              timeout_s=self.timeout_s, have_versions=have, have_digests=offered_digests(held))

    def _take_pull(self, shard: int, batch: list[Key], rep, out: dict[str, torch.Tensor], delta: bool) -> float:
        """Check one PullResponse against the keys asked for and write it into out; returns its wait."""
        kinds = list(rep.kinds) or [FULL] * len(rep.values)
        if len(rep.values) != len(batch) or len(kinds) != len(batch):
            raise PSError(None, f"shard {shard} answered {len(rep.values)} values for {len(batch)} keys")
        nbytes = 0
        for k, c, v, kind in zip(batch, rep.values, rep.versions, kinds):
            if c.key != k.key:
                raise PSError(None, f"server returned {c.key!r} for {k.key!r}")
            dst = out[k.param].view(-1)[k.offset:k.offset + k.numel]
            if kind in (FULL, DELTA):
                p, n = read_chunk(c)
                nbytes += n
                if kind == FULL:
                    if len(p.data) != k.numel * 4:
                        raise PSError(None, f"server returned {len(p.data)} bytes for {k.key!r} ({k.numel} floats)")
                    np.copyto(dst.numpy(), np.frombuffer(p.data, dtype=np.float32))
                else:
                    accumulate_payload_into(k.key, p, dst)
            self.versions[k.key] = v
            if delta:
                self.view_versions[k.key] = v
        self.stats.add(pull_rpcs=1, bytes_pulled_wire=nbytes)
        self._note_codec(rep.codec, rep.codec_epoch)
        if rep.live_workers:
            self.live_workers = list(rep.live_workers)
            if self.min_workers or self.max_workers:    # elastic: a restored shard re-bases the job on the count
                self.sessions[shard].register_req.world_size = max(max(self.live_workers) + 1, self.min_workers)
        self.quorum_paces[shard] = rep.quorum_pace_s
        if rep.HasField("stopped") and self.job_stop is None:
            self._note_stop(rep.stopped)
        return rep.waited_s

    def pull(self, names=None, min_version: int = 0, out: dict[str, torch.Tensor] | None = None,
             delta: bool = False):
        """Pull parameters (all by default) once every key reaches min_version. Returns name -> tensor.
        Plain pulls get exact values; delta=True see pull_keys."""
        names = list(self.by_param) if names is None else list(names)
        if out is None:
            out = {n: torch.empty(sum(k.numel for k in self.by_param[n]), dtype=torch.float32) for n in names}
        futs = [self.pool.submit(self.pull_keys, s, ks, min_version, out, delta)
                for s, ks in self.keys_by_shard(names).items()]
        for f in futs:
            f.result()
        return out

    # ---- codec switch (rollback) ----------------------------------------------------------
    def apply_codec_switch(self) -> bool:
        """Adopt the codec the servers announced (call between steps). True if it changed."""
        if self.codec != self.compressor.spec:
            self.compressor.set_spec(self.codec)
            return True
        return False

    def set_codec(self, spec: str) -> int:
        """Switch the job's codec on every shard (via its session: a restarting one is waited for); workers follow."""
        epochs = [s.call("SetCodec", lambda: pb.SetCodecRequest(codec=spec), 10.0).codec_epoch for s in self.sessions]
        self._note_codec(spec, max(epochs))
        return max(epochs)

    # ---- misc ------------------------------------------------------------------------------
    def barrier(self, name: str, timeout_s: float | None = None) -> float:
        t = timeout_s or self.timeout_s
        req = pb.BarrierRequest(worker_id=self.worker_id, name=name, timeout_s=t)
        futs = [self.pool.submit(sess.call, "Barrier", lambda: req, t + 10) for sess in self.sessions]
        return max(f.result().waited_s for f in futs)

    def _heartbeats(self) -> None:
        """Every heartbeat_s until close(): one Heartbeat per shard. A missed beat is not an error (the shard may
        evict this worker after 4; its next push then re-registers); a stop it carries is taken as a pull's."""
        req = pb.HeartbeatRequest(worker_id=self.worker_id)
        while not self.closed.wait(self.heartbeat_s):
            self._attend()
            for stub in self.stubs:
                if self.closed.is_set():        # close() may not wait out a slow beat: no call on closed channels
                    return
                try:
                    rep = stub.Heartbeat(req, timeout=max(1.0, 2 * self.heartbeat_s))
                except (grpc.RpcError, ValueError):     # ValueError: the channel closed under the call
                    continue
                if rep.HasField("stopped") and self.job_stop is None:
                    self._note_stop(rep.stopped)

    def _attend(self) -> None:
        """Hold an Attend stream open on every shard (one whose stream ended, e.g. it restarted, gets a new one):
        when this process dies its kernel closes the connection and the shards evict it at once. A shard that
        does not serve Attend (an older server) is left to the heartbeats."""
        req = pb.HeartbeatRequest(worker_id=self.worker_id)
        for shard, stub in enumerate(self.stubs):
            stream = self._attendance[shard]
            if stream is False or (stream is not None and not stream.done()):
                continue
            if stream is not None and stream.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._attendance[shard] = False
                continue
            self._attendance[shard] = stub.Attend(req)      # never read: it only has to stay open

    def _note_stop(self, st) -> None:
        self.job_stop = {"worker_id": st.worker_id, "step": st.step, "time_s": st.time_s, "reason": st.reason}

    def stop(self, step: int, time_s: float, reason: str) -> bool:
        """Stop the job on every shard (--sync quorum: this worker's evaluation reached the target); the other
        workers learn it from their next pull. True if this was the job's first stop."""
        req = pb.StopRequest(worker_id=self.worker_id, step=step, time_s=time_s, reason=reason)
        futs = [self.pool.submit(sess.call, "Stop", lambda: req, 10.0) for sess in self.sessions]
        first = all([f.result().first for f in futs])
        if first and self.job_stop is None:      # else the standing stop arrives with the next pull
            self.job_stop = {"worker_id": self.worker_id, "step": step, "time_s": time_s, "reason": reason}
        return first

    def server_stats(self) -> list[dict]:
        out = []
        for stub in self.stubs:
            msg = call(stub.Stats, pb.StatsRequest(), 10.0)
            out.append({f.name: (list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name))
                        for f in msg.DESCRIPTOR.fields})
        return out

    def on_shard_restart(self, shard: int, rep) -> None:
        """A shard came back from a checkpoint (`rep`: its RegisterResponse): forget the pull views held for its
        keys (full values next); a codec switch made after that checkpoint is sent to it again, at its epoch."""
        for k in self.layout:
            if k.shard == shard:
                self.view_versions.pop(k.key, None)
        if rep.codec_epoch < self.codec_epoch:
            req = pb.SetCodecRequest(codec=self.codec, epoch=self.codec_epoch)
            try:
                call(self.stubs[shard].SetCodec, req, 10.0)
            except PSError as e:   # pushes name their codec per chunk: a lagging shard is no reason to fail the job
                log.warning("worker %d: shard %d came back at codec epoch %d (job: %d, %r); sending the switch "
                            "again failed: %s", self.worker_id, shard, rep.codec_epoch, self.codec_epoch, self.codec, e)

    def close(self) -> None:
        self.closed.set()
        if self._beats is not None:
            self._beats.join(timeout=2 * self.heartbeat_s + 1.0)
        leaving = pb.HeartbeatRequest(worker_id=self.worker_id, leaving=True)
        for stub, stream in zip(self.stubs, self._attendance):   # a departure: the streams' end is not a death
            if stream:
                with contextlib.suppress(grpc.RpcError):
                    stub.Heartbeat(leaving, timeout=2.0)
                stream.cancel()
        for ch in self.channels:    # cancels RPCs still in flight (a round a failed step left open): the pool's
            ch.close()              # threads end now with CANCELLED instead of waiting out --timeout-s
        self.pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
