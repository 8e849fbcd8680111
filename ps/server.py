"""gRPC front end of a shard: validates requests, maps ShardError/CodecError to status codes."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc

from compression.base import CodecError
from deltaps.errors import ShardError, abort
from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import DELTA, FULL
from deltaps.security import Security
from deltaps.transport import DEFAULT_MAX_MESSAGE_BYTES, grpc_options
from deltaps.wire import decode_chunk, fill_chunk, fill_chunk_from_tensor, unpack_chunk
from protos import PROTOCOL_VERSION, pb, rpc
from ps.buffers import key_from_spec
from ps.handlers import REFUSALS, add_servicer
from ps.optimizer import warm_up
from ps.pull_views import check_offers
from ps.request_checks import check_chunk_shapes, request_keys
from ps.shard import Shard

log = logging.getLogger("deltaps.server")
ATTEND_CHECK_S = 1.0    # an Attend stream re-checks its RPC this often, should the end-of-RPC callback never come
ANSWER_MARGIN_S = 1.0   # a held push is answered (PAUSED) this long before its caller's deadline


def _guard(fn):
    """Turn refusals into gRPC statuses; never let a bad request take the server down. Anything else a handler
    raises is the shard's fault: INTERNAL naming the RPC and the error (gRPC's own answer would be UNKNOWN,
    "Exception calling application"), its traceback logged once per (RPC, error type), then rate-limited lines."""
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except ShardError as e:
            abort(context, e)
        except CodecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad payload: {e}")
        except Exception as e:
            if context.code() is not None:    # an abort already on its way out (it raises a bare Exception)
                raise
            _internal(context, fn.__name__, self.shard.shard_id, e)
    wrapper.__name__ = fn.__name__
    return wrapper


_TRACED: set[tuple[str, str]] = set()   # (RPC, error type) whose traceback the log already has


def _internal(context, rpc_name: str, shard_id: int, err: Exception) -> None:
    kind = type(err).__name__
    message = f"{rpc_name}: internal error on shard {shard_id} ({kind}: {err}); the shard's log has the traceback"
    if (rpc_name, kind) not in _TRACED:
        _TRACED.add((rpc_name, kind))
        log.exception(message)
    else:
        REFUSALS.refused(context.peer(), f"internal {rpc_name} {kind}", message)
    context.abort(grpc.StatusCode.INTERNAL, message)


class ParameterServerServicer(rpc.ParameterServerServicer):
    def __init__(self, shard: Shard, max_streams: int = 32, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        """max_streams: Attend streams held at once (each holds a server thread: keep it under the pool's size);
        max_message_bytes: the largest answer gRPC will send (an embedding pull past it is refused up front)."""
        self.shard, self.max_message_bytes = shard, max_message_bytes
        self.max_streams, self.streams, self._streams_lock = max_streams, 0, threading.Lock()

    @_guard
    def Register(self, req, context):
        if req.protocol_version != PROTOCOL_VERSION:
            raise ShardError("FAILED_PRECONDITION",
                             f"protocol version mismatch: worker speaks {req.protocol_version}, server {PROTOCOL_VERSION}")
        keys = [key_from_spec(k) for k in req.keys]
        initialized = self.shard.register(req.worker_id, req.world_size, req.num_shards, req.sync,
                                          OptimizerConfig.from_proto(req.optimizer), keys, req.layout_digest,
                                          req.codec or "none", req.pull_codec or "auto", req.min_workers,
                                          req.max_workers, local_steps=req.local_steps,
                                          heartbeat_s=req.heartbeat_s)
        log.info("worker %d registered (world %d, sync %s, %d keys)", req.worker_id, req.world_size, req.sync,
                 len(keys))
        return pb.RegisterResponse(shard_id=self.shard.shard_id, initialized=initialized,
                                   codec=self.shard.codec, codec_epoch=self.shard.codec_epoch,
                                   server_id=self.shard.server_id, step=self.shard.worker_step(req.worker_id),
                                   durable_step=self.shard.durable_step(req.worker_id),
                                   live_workers=sorted(self.shard.live))

    def _check_server_id(self, req) -> None:
        """A request addressed to an earlier incarnation of this shard is refused (ABORTED) so the client
        re-registers and replays what the restart lost before anything else is applied."""
        if req.server_id and req.server_id != self.shard.server_id:
            raise ShardError("ABORTED", f"shard {self.shard.shard_id} restarted (server_id {self.shard.server_id}, "
                                        f"request for {req.server_id}); Register again and replay")

    @_guard
    def Init(self, req, context):
        check_chunk_shapes(self.shard, req.values)
        n = self.shard.init([(c.key, decode_chunk(c)) for c in req.values])
        return pb.InitResponse(initialized=n)

    @_guard
    def Push(self, req, context):
        rep = pb.PushResponse()
        self._push(req, rep, context)
        return rep

    @_guard
    def Pull(self, req, context):
        rep = pb.PullResponse()
        self._pull(req, context, rep)
        return rep

    @_guard
    def PushPull(self, req, context):
        if not req.HasField("push") or not req.HasField("pull"):
            raise ShardError("INVALID_ARGUMENT", "PushPull needs both a push and a pull")
        push, pull = req.push, req.pull
        if pull.worker_id != push.worker_id or pull.server_id != push.server_id:
            raise ShardError("INVALID_ARGUMENT", "PushPull: the pull's worker_id/server_id differ from the push's")
        # refused before the push is applied: a bad offer, an unknown or repeated key
        check_offers(len(pull.keys), pull.have_versions, pull.have_digests)
        request_keys(self.shard, list(pull.keys), "the pull")
        rep = pb.PushPullResponse()      # filled in place: no merge copies of the bodies
        realign = self._push(push, rep.push, context)
        if not set(pull.keys) <= {c.key for c in push.grads}:   # the push says nothing of the other keys' rounds
            realign = 0
        self._pull(pull, context, rep.pull, max(pull.min_version, realign))
        return rep

    def _push(self, req, rep, context) -> int:
        """Apply a push into `rep`; returns the version a PushPull's pull waits for beyond its own (0: none)."""
        self._check_server_id(req)
        check_chunk_shapes(self.shard, req.grads)
        grads, nbytes = [], 0
        for c in req.grads:
            g, n = unpack_chunk(c)
            grads.append((c.key, g))
            nbytes += n
        self.shard.counters.add("bytes_received", nbytes)
        left = context.time_remaining()        # None: the caller set no deadline
        dup, versions, realign = self.shard.push(req.worker_id, req.step, grads, list(req.pulled_versions),
                                                 req.inner_steps, None if left is None else max(0.0, left - ANSWER_MARGIN_S))
        rep.duplicate.extend(dup)
        rep.versions.extend(versions)
        rep.server_id, rep.durable_step = self.shard.server_id, self.shard.durable_step(req.worker_id)
        return realign

    def _pull(self, req, context, rep, min_version: int | None = None) -> None:
        self._check_server_id(req)
        min_version = req.min_version if min_version is None else min_version
        items, waited = self.shard.pull(list(req.keys), min_version, req.timeout_s,
                                        list(req.have_versions) or None, worker=req.worker_id,
                                        alive=context.is_active, have_digests=list(req.have_digests) or None)
        nbytes = 0
        for k, kind, obj, _ in items:
            c = rep.values.add()
            if kind == FULL:
                nbytes += fill_chunk_from_tensor(c, k, obj)
            elif kind == DELTA:
                nbytes += fill_chunk(c, k, obj)
            else:
                c.key = k
        self.shard.counters.add("bytes_sent", nbytes)
        rep.versions.extend(v for *_, v in items)
        rep.kinds.extend(i[1] for i in items)
        rep.waited_s, rep.server_id = waited, self.shard.server_id
        rep.codec, rep.codec_epoch = self.shard.codec, self.shard.codec_epoch
        rep.live_workers.extend(sorted(self.shard.live))
        if self.shard.rounds is not None:     # quorum rounds: the pace a slow worker fits its round to
            rep.quorum_pace_s = max((self.shard.rounds.pace_s(k) for k in req.keys), default=0.0)
        if self.shard.stopped is not None:
            rep.stopped.CopyFrom(pb.StopRequest(**self.shard.stopped))

    @_guard
    def Barrier(self, req, context):
        return pb.BarrierResponse(waited_s=self.shard.barrier(req.worker_id, req.name, req.timeout_s,
                                                              alive=context.is_active))

    @_guard
    def SetCodec(self, req, context):
        from compression import get_codec
        get_codec(req.codec)  # validates the spec (CodecError -> INVALID_ARGUMENT)
        if req.epoch < 0:
            raise ShardError("INVALID_ARGUMENT", f"SetCodec: epoch {req.epoch} is negative")
        before = self.shard.codec_epoch
        spec, epoch = self.shard.set_codec(req.codec, req.epoch)
        if epoch != before:
            log.warning("codec switched to %r (epoch %d%s)", spec, epoch, ", caught up" if req.epoch else "")
        return pb.SetCodecResponse(codec=spec, codec_epoch=epoch)

    @_guard
    def Stop(self, req, context):
        return pb.StopResponse(first=self.shard.stop(req.worker_id, req.step, req.time_s, req.reason))

    @_guard
    def Heartbeat(self, req, context):
        rep = pb.HeartbeatResponse(live=self.shard.heartbeat(req.worker_id, leaving=req.leaving))
        if self.shard.stopped is not None:
            rep.stopped.CopyFrom(pb.StopRequest(**self.shard.stopped))
        return rep

    @_guard
    def Attend(self, req, context):
        with self._streams_lock:      # past the cap a worker is watched by its heartbeats alone (one that holds a
            # stream may replace it: the old one ends within ATTEND_CHECK_S)
            if self.streams >= self.max_streams and req.worker_id not in self.shard.attending:
                raise ShardError("RESOURCE_EXHAUSTED", f"{self.streams} Attend streams held, the most this shard's "
                                                       f"threads allow; heartbeats still watch worker {req.worker_id}")
            self.streams += 1
        try:
            token = self.shard.attend(req.worker_id)      # refusals (no job, not a worker of it) before the stream
        except BaseException:
            self._stream_ended()
            raise
        ended = threading.Event()

        def on_end():       # once, whenever the RPC ends (even before its stream was first read)
            ended.set()
            self._stream_ended()
        if not context.add_callback(on_end):        # the RPC has already terminated
            on_end()
        return self._attendance(req.worker_id, token, context, ended)

    def _attendance(self, worker: int, token: int, context, ended: threading.Event):
        """The Attend stream: one answer, then held (one server thread) until the RPC ends for any reason, or the
        worker opens a newer one (its thread is not kept for a stream nobody's eviction depends on)."""
        try:
            yield pb.HeartbeatResponse(live=worker in self.shard.live)
            while not ended.wait(ATTEND_CHECK_S) and context.is_active() and self.shard.attending.get(worker) == token:
                pass
        finally:
            self.shard.unattend(worker, token)

    def _stream_ended(self) -> None:
        with self._streams_lock:
            self.streams -= 1

    @_guard
    def Stats(self, req, context):
        return pb.StatsResponse(**self.shard.stats())

    # ---- row-sparse embedding tables: bodies in ps/embedding/service.py ----
    @_guard
    def RegisterEmbedding(self, req, context):
        from ps import embedding
        if req.protocol_version != PROTOCOL_VERSION:
            raise ShardError("FAILED_PRECONDITION", f"protocol version mismatch: worker speaks "
                                                    f"{req.protocol_version}, server {PROTOCOL_VERSION}")
        return embedding.handle_register(self.shard, req, pb)

    @_guard
    def SparsePull(self, req, context):
        from ps import embedding
        return embedding.handle_pull(self.shard, req, pb, alive=context.is_active, max_bytes=self.max_message_bytes)

    @_guard
    def SparsePush(self, req, context):
        from ps import embedding
        return embedding.handle_push(self.shard, req, pb, alive=context.is_active)

    @_guard
    def EmbeddingStats(self, req, context):
        from ps import embedding
        return embedding.handle_stats(self.shard, req, pb)


HEALTH_SERVICES = ("", "deltaps.ParameterServer")


def add_health_service(server):
    """grpc.health.v1.Health (Kubernetes `grpc:` probes, grpc_health_probe): SERVING for "" and
    deltaps.ParameterServer while the server runs, NOT_SERVING once it starts shutting down."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:  # grpcio-health-checking is a dependency; degrade rather than refuse to serve
        log.warning("grpcio-health-checking not installed: no grpc.health.v1 service")
        return None
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in HEALTH_SERVICES:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def start_server(shard: Shard, host: str = "127.0.0.1", port: int = 0, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_workers: int = 64, metrics=None,
                 security=None):
    """Start serving; returns (grpc.Server, bound port). Port 0 picks a free port.

    metrics: an optional ps.metrics.ServerMetrics whose hooks wrap the servicer's RPCs.
    security: an optional deltaps.security.Security (token auth on every RPC, TLS/mTLS); None = plaintext, no auth."""
    security = security or Security()
    for warning in security.exposure_warnings(host):
        log.warning("%s", warning)
    on_refusal = metrics.count_refusal if metrics is not None else None   # every refusal is counted
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps"),
                         options=grpc_options(max_message_bytes),
                         interceptors=security.server_interceptors(on_refusal=on_refusal))
    servicer = ParameterServerServicer(shard, max_streams=max_workers // 2, max_message_bytes=max_message_bytes)
    if metrics is not None:
        metrics.instrument(servicer)
    add_servicer(server, servicer, on_refusal=on_refusal)
    server.deltaps_health = add_health_service(server)
    server.deltaps_servicer = servicer         # its held Attend streams (tests/rpc/test_attend.py)
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    shard.start_reaper()     # evicts silent workers when the shard has a worker timeout
    return server, bound


def serve_forever(shard: Shard, host: str, port: int, port_file: str | None = None, checkpointer=None,
                  **kw) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully (in-flight RPCs get a grace period) and, with a
    checkpointer (ps.durability.Checkpointer), write a final checkpoint."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):      # before anyone can learn our port: a stop is always graceful
        signal.signal(sig, lambda *_: stop.set())
    server, bound = start_server(shard, host, port, **kw)
    # beside serving, while the workers start up: an Init that comes first waits on the import lock
    threading.Thread(target=warm_up, name="optimizer-warm-up", daemon=True).start()
    if checkpointer is not None:
        checkpointer.start()
    log.info("shard %d/%d listening on %s:%d (%s)", shard.shard_id, shard.num_shards, host, bound,
             (kw.get("security") or Security()).describe("server"))
    print(f"deltaps server shard={shard.shard_id} listening on {host}:{bound}", flush=True)
    if port_file:
        from deltaps.exporter import write_port_file
        write_port_file(port_file, bound)
    stop.wait()
    log.info("shard %d shutting down", shard.shard_id)
    shard.shutting_down = True      # the Attend streams the stop cancels are not workers gone
    if getattr(server, "deltaps_health", None) is not None:
        server.deltaps_health.enter_graceful_shutdown()
    server.stop(grace=5).wait()
    if checkpointer is not None:
        path = checkpointer.stop(final=True)
        log.warning("shard %d: final checkpoint %s", shard.shard_id, path)
