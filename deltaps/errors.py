"""Errors of both ends and their gRPC mapping (a leaf module: imports nothing of deltaps).

A shard refuses a request with a ShardError; the servicer turns it into a gRPC status and, when the
refusal has a machine-readable reason, a `deltaps-reason` trailing-metadata entry. Clients see a PSError
carrying the status code and that reason, so no caller ever matches on message text.
"""
from __future__ import annotations

import grpc

REASON_KEY = "deltaps-reason"   # trailing-metadata key of a refusal's reason

# Machine-readable refusal reasons (values travel on the wire: never rename one).
NOT_LIVE_MEMBER = "not-live-member"     # the worker was evicted (or never registered): Register to rejoin
PAUSED = "paused"                       # an elastic job has fewer live workers than --min-workers: retry


class ShardError(Exception):
    """A request the shard refuses; `code` is a grpc.StatusCode name, `reason` one of the constants above."""

    def __init__(self, code: str, message: str, reason: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason

    @property
    def status(self) -> grpc.StatusCode:
        return getattr(grpc.StatusCode, self.code)


class EmbeddingError(ShardError):
    """Refusal by an embedding table or store (a ShardError, so the servicer maps it to a status)."""


class PSError(RuntimeError):
    """A server refused a request or could not be reached; carries the gRPC status code and reason."""

    def __init__(self, code, message: str, reason: str | None = None):
        super().__init__(f"{code.name if code else 'UNKNOWN'}: {message}")
        self.code, self.message, self.reason = code, message, reason


class JobFailed(RuntimeError):
    """A launcher (`deltaps launch`, `bench compare`) saw a job's worker or server exit with an error; the message
    names them and holds their logs' tails. The CLI prints it as one error line, not a traceback."""


def abort(context: grpc.ServicerContext, err: ShardError) -> None:
    """End the RPC with err's status; its reason (if any) goes into the trailing metadata."""
    if err.reason:
        context.set_trailing_metadata(((REASON_KEY, err.reason),))
    context.abort(err.status, err.message)


def reason_of(err: grpc.RpcError) -> str | None:
    try:
        meta = err.trailing_metadata() or ()
    except Exception:   # noqa: BLE001 - a locally generated RpcError has no metadata to read
        return None
    return next((v for k, v in meta if k == REASON_KEY), None)


def from_rpc_error(err: grpc.RpcError) -> PSError:
    return PSError(err.code(), err.details(), reason_of(err))


def call(fn, request, timeout: float):
    """fn(request) with a deadline; a gRPC failure becomes a PSError."""
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
