import os
import threading

import pytest

from ps.server import start_server
from ps.shard import Shard
from worker.workloads.data_cache import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _kept_splits(tmp_path_factory):
    """The session's workers (in process and spawned) keep the tabular splits they make in a directory of the
    session's own, not in the user's ~/.cache."""
    os.environ.setdefault(CACHE_ENV, str(tmp_path_factory.mktemp("data-cache")))


class Cluster:
    """In-process shards on loopback ports chosen by the OS (port 0)."""

    def __init__(self, num_shards: int, threads: int = 64, **shard_kw):
        self.shards = [Shard(i, num_shards, **shard_kw) for i in range(num_shards)]
        self.servers, self.addrs = [], []
        for s in self.shards:
            server, port = start_server(s, "127.0.0.1", 0, max_workers=threads)
            self.servers.append(server)
            self.addrs.append(f"127.0.0.1:{port}")

    def stop(self):
        for s in self.servers:
            s.stop(grace=None)


@pytest.fixture
def cluster_factory():
    made = []

    def make(num_shards: int, **kw) -> Cluster:
        c = Cluster(num_shards, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def run_threads(fns, timeout=60):
    """Run callables in threads, re-raise the first error."""
    errors, threads = [], []
    for fn in fns:
        def wrap(fn=fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        t = threading.Thread(target=wrap, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "thread hung"
    if errors:
        raise errors[0]


@pytest.fixture(autouse=True)
def _unit_tests_open_no_sockets(request, monkeypatch):
    """tests/unit promises no sockets: any socket a unit test opens fails it (subprocesses are theirs)."""
    if request.node.path.parent.name != "unit":
        return
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test opened a socket: it belongs in tests/rpc or tests/cluster")
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def procs(tmp_path):
    """Processes started by a test, killed at its end; their logs in tmp_path."""
    from helpers import Procs
    p = Procs(tmp_path)
    yield p
    p.cleanup()


@pytest.fixture(autouse=True, scope="session")
def _launches_fork_from_the_session_zygote():
    """`launch` called in this process forks its shards and workers from the session's zygote (helpers.session_zygote,
    which start_program's processes come from too) instead of starting a zygote of its own: ~3.8 s of a core before
    each job's first process, ~30 jobs. Launches in subprocesses (the CLI and signal tests), bench networks,
    `zygote=False` and tests/cluster/test_zygote.py still start their own; a job's children are forked either way."""
    from helpers import session_zygote

    from deltaps.tools import launch, zygote

    class SessionStarter(zygote.Starter):
        def __init__(self, zygote_path=None, prefix=(), env=None, hub=None, node=None):
            self.shared = zygote_path is not None and not prefix and hub is None
            if self.shared:       # the session's zygote starts on first use: runs of tests/unit never pay for it
                self.prefix, self.env, self.zygote = [], env, session_zygote()
            else:
                super().__init__(zygote_path, prefix, env, hub, node)

        def ready(self):
            return self if self.shared else super().ready()

        def close(self):
            if not self.shared:     # the session's zygote outlives the job
                super().close()

    launch.Starter = SessionStarter
    yield
    launch.Starter = zygote.Starter
