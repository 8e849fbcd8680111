"""The servicer's RPCs registered with deltaps parsing the request bytes itself.

grpc's generated registration parses requests in its own path: bytes that are not a valid message come
back as INTERNAL (the server's fault, says the status) and write a full traceback to the log per request.
Here each method receives the raw bytes; an undecodable body is refused with INVALID_ARGUMENT naming the
RPC and the problem; it is counted (`on_refusal`) and logged at most once per peer per 10 s, without a traceback.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from deltaps.ratelimit import RefusalLog
from protos import pb

SERVICE = "deltaps.ParameterServer"
REFUSALS = RefusalLog(logging.getLogger("deltaps.server"))   # one line per (peer, reason) per 10 s


def _methods():
    """The service's method descriptors, from the compiled protos."""
    return pb.DESCRIPTOR.services_by_name[SERVICE.split(".")[-1]].methods


def method_types() -> dict[str, tuple[type, type]]:
    """RPC name -> (request class, response class)."""
    return {m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)) for m in _methods()}


def streaming_rpcs() -> frozenset[str]:
    """The RPCs that answer with a stream (Attend)."""
    return frozenset(m.name for m in _methods() if m.server_streaming)


STREAMING = streaming_rpcs()


def parsed(rpc: str, request_type: type, call: Callable, on_refusal: Callable[[str, str], None] | None):
    """A raw-bytes behaviour: parse, refuse undecodable bytes with INVALID_ARGUMENT, else call(request, ctx)."""
    def behaviour(raw: bytes, context: grpc.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except (DecodeError, ValueError, RuntimeError) as e:   # upb raises DecodeError; a few paths others
            message = (f"{rpc}: the request body ({len(raw)} bytes) is not a valid {request_type.__name__} "
                       f"message ({e or 'truncated or malformed'})")
            if on_refusal is not None:
                on_refusal(rpc, "INVALID_ARGUMENT")
            REFUSALS.refused(context.peer(), "undecodable request", f"refused from {context.peer()}: {message}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return call(request, context)
    behaviour.__name__ = rpc
    return behaviour


def add_servicer(server: grpc.Server, servicer, on_refusal: Callable[[str, str], None] | None = None) -> None:
    """Register every RPC of the ParameterServer service; methods are looked up on the servicer at call
    time, so wrappers installed later (metrics) still see every call."""
    handlers = {}
    for rpc, (req_t, rep_t) in method_types().items():
        def call(request, context, rpc=rpc):
            return getattr(servicer, rpc)(request, context)
        kind = grpc.unary_stream_rpc_method_handler if rpc in STREAMING else grpc.unary_unary_rpc_method_handler
        handlers[rpc] = kind(parsed(rpc, req_t, call, on_refusal), request_deserializer=None,
                             response_serializer=rep_t.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
