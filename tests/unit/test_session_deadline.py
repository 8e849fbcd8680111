"""ShardSession's reconnect deadline runs per outage (a recovery ends one), and one call recovers at most
MAX_RECOVERIES times (worker/session.py; a scripted stub, no sockets)."""
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from deltaps.errors import PSError
from protos import pb
from worker import session as session_module
from worker.session import SessionPolicy, ShardSession


class _Failure(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"scripted {self._code.name}"

    def trailing_metadata(self):
        return ()


class _Stub:
    """A scripted shard. Push takes the next step of `script`: "ok"; "restart" (a new incarnation: ABORTED);
    ("down", after_s, for_s): sleep after_s, then refuse every call (UNAVAILABLE) for for_s seconds."""
    def __init__(self, script):
        self.script, self.incarnation, self.down_until = list(script), 1, 0.0

    def _check_up(self):
        if time.monotonic() < self.down_until:
            raise _Failure(grpc.StatusCode.UNAVAILABLE)

    def Register(self, req, timeout):
        self._check_up()
        return SimpleNamespace(server_id=f"s{self.incarnation}", durable_step=-1, initialized=True, step=0)

    def Push(self, req, timeout):
        self._check_up()
        step = self.script.pop(0) if self.script else "ok"
        if step == "restart":
            self.incarnation += 1
            raise _Failure(grpc.StatusCode.ABORTED)
        if step != "ok":
            _, after_s, for_s = step
            time.sleep(after_s)
            self.down_until = time.monotonic() + for_s
            raise _Failure(grpc.StatusCode.UNAVAILABLE)
        return SimpleNamespace(durable_step=-1)


def _session(stub, deadline_s):
    s = ShardSession(stub, "127.0.0.1:1", 0, SessionPolicy(0, 5.0, deadline_s, 64), threading.Event(),
                     on_restart=lambda shard, rep: None)
    s.register(pb.RegisterRequest(worker_id=0))
    return s


def test_deadline_restarts_after_a_recovery():
    """A restart (ABORTED) is recovered at once; an outage that starts 0.6 s later and lasts 0.3 s gets its own
    0.5 s deadline, not what is left of the first failure's (which ran out at 0.5 s)."""
    stub = _Stub(["restart", ("down", 0.6, 0.3), "ok"])
    s = _session(stub, deadline_s=0.5)
    s.push(pb.PushRequest(worker_id=0, step=0, seq=1), 5.0)
    assert s.restarts == 1 and stub.incarnation == 2


def test_an_outage_past_the_deadline_still_ends_the_call():
    stub = _Stub([("down", 0.0, 60.0)])
    s = _session(stub, deadline_s=0.3)
    with pytest.raises(PSError, match="unreachable"):
        s.push(pb.PushRequest(worker_id=0, step=0, seq=1), 5.0)


def test_recoveries_per_call_are_bounded():
    stub = _Stub(["restart"] * 1000)   # restarts as often as we come back
    s = _session(stub, deadline_s=60.0)
    with pytest.raises(PSError, match=f"after {session_module.MAX_RECOVERIES} recoveries"):
        s.push(pb.PushRequest(worker_id=0, step=0, seq=1), 5.0)
