"""Request bodies that are not valid protobuf (random, truncated; one oversized), sent to every RPC through a raw
channel (no generated stub):
INVALID_ARGUMENT naming the RPC, never INTERNAL/UNKNOWN, no traceback in the log, every refusal counted
in deltaps_server_rejected_requests_total, and the server still serves a valid request afterwards."""
from __future__ import annotations

import logging
import random

import grpc

from deltaps.exporter import start_exporter, stop_exporter
from protos import pb, rpc
from ps.handlers import method_types
from ps.metrics import ServerMetrics
from ps.server import start_server
from ps.shard import Shard

PER_RPC = 40


RPCS = 15     # methods of deltaps.ParameterServer (protos/deltaps.proto): a new one must be fuzzed here too

def _bodies(rng: random.Random, valid: bytes) -> list[bytes]:
    """Random bytes, truncations of a valid message, and bytes with a broken length prefix."""
    out = [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))) for _ in range(PER_RPC - 10)]
    out += [b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x80", b"\xff" * 9, b"\x0b", b"\x0a\x05ab"]
    long = valid + b"\x0a\x7f" + b"x" * 3
    out += [long[: max(1, len(long) - k)] for k in (1, 2, 3, 4, 5)]
    return out


def _rejected_total(registry) -> float:
    return sum(s.value for fam in registry.collect() if fam.name == "deltaps_server_rejected_requests"
               for s in fam.samples if s.name.endswith("_total"))


def test_undecodable_requests_are_invalid_argument_without_tracebacks(caplog):
    shard = Shard(0, 1)
    metrics = ServerMetrics(shard)
    server, port = start_server(shard, "127.0.0.1", 0, metrics=metrics, max_message_bytes=1 << 20)
    httpd, _ = start_exporter(metrics.registry, 0)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    rng = random.Random(7)
    statuses: dict[str, int] = {}
    refused = 0
    valid = pb.PullRequest(worker_id=1, keys=["w#0", "b#0"], min_version=3).SerializeToString()
    try:
        with caplog.at_level(logging.DEBUG):
            types = method_types()
            assert len(types) == RPCS
            for name in types:
                call = ch.unary_unary(f"/deltaps.ParameterServer/{name}")   # bytes in, bytes out
                for body in _bodies(rng, valid):
                    try:
                        call(body, timeout=5)
                        statuses["OK"] = statuses.get("OK", 0) + 1
                    except grpc.RpcError as e:
                        code = e.code()
                        statuses[code.name] = statuses.get(code.name, 0) + 1
                        refused += 1
                        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (name, body, e.details())
                        if code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in e.details():
                            assert e.details().startswith(f"{name}: ") and types[name][0].__name__ in e.details()
        text = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
        assert "Traceback" not in text and "Exception deserializing" not in text
        refusal_lines = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(refusal_lines) <= 2                        # one peer: one line per 10 s, not 469
        assert statuses.get("INVALID_ARGUMENT", 0) >= RPCS * 10      # most of them are undecodable
        assert _rejected_total(metrics.registry) == refused
        # oversized: gRPC itself refuses a body above --max-message-bytes before any handler runs
        big = ch.unary_unary("/deltaps.ParameterServer/Push")
        try:
            big(b"\x0a" + b"\x00" * (1 << 20), timeout=10)
            raise AssertionError("an oversized body was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        stub = rpc.ParameterServerStub(ch)
        assert stub.Stats(pb.StatsRequest(), timeout=5).shard_id == 0      # still serving
        print(f"\nbad-bytes fuzz: {RPCS * PER_RPC} requests, statuses {statuses}, {len(caplog.records)} log records, "
              f"{len(refusal_lines)} refusal lines, rejected counter {_rejected_total(metrics.registry):.0f}")
    finally:
        stop_exporter(httpd)
        ch.close()
        server.stop(grace=None)


def test_token_refusals_are_counted_and_garbage_with_a_token_is_invalid_argument(caplog):
    from deltaps.security import Security
    token = "t" * 40
    shard = Shard(0, 1)
    metrics = ServerMetrics(shard)
    server, port = start_server(shard, "127.0.0.1", 0, metrics=metrics, security=Security(token=token))
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    codes: dict[str, int] = {}
    try:
        with caplog.at_level(logging.DEBUG):
            for name in list(method_types()) + ["NoSuchMethod"]:
                call = ch.unary_unary(f"/deltaps.ParameterServer/{name}")
                for body, meta in ((b"\xff\x01", None), (b"\x0a\x05ab", (("authorization", "Bearer wrong"),)),
                                   (b"\x0a\x05ab", (("authorization", f"Bearer {token}"),))):
                    try:
                        call(body, timeout=5, metadata=meta)
                        codes["OK"] = codes.get("OK", 0) + 1
                    except grpc.RpcError as e:
                        codes[e.code().name] = codes.get(e.code().name, 0) + 1
                        assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (name, e.details())
        assert codes["UNAUTHENTICATED"] == 2 * (RPCS + 1)                 # no token / wrong token, every method
        assert codes["INVALID_ARGUMENT"] == RPCS                    # right token, undecodable body
        assert codes["UNIMPLEMENTED"] == 1                        # right token, unknown method
        assert _rejected_total(metrics.registry) == 2 * (RPCS + 1) + RPCS   # UNIMPLEMENTED is grpc's, not a refusal
        text = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
        # one line per (peer, reason): missing token, invalid token, undecodable body
        assert "Traceback" not in text and len([r for r in caplog.records if "refused" in r.getMessage()]) <= 3
    finally:
        ch.close()
        server.stop(grace=None)
