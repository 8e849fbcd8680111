"""deltaps/tools/zygote.py: real zygote processes forking real `deltaps` commands (no namespaces: the bench's use
with them is tests/cluster/test_bench_compare.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from deltaps.tools import netns, node_host
from deltaps.tools.process_tree import descendants, running, stat_fields, stop_children, stop_processes
from deltaps.tools.zygote import MAX_REQUEST_BYTES, UNKNOWN_EXIT, Zygote, ZygoteUnavailable

OK, WHY = netns.shaping_available()
needs_root = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
TEST_PREFIX = "dpsy"      # this file's namespaces (test_bench_compare's: dpst, dpsu)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    d = tmp_path_factory.mktemp("zygote")
    z = Zygote(str(d / "z.sock"), log=str(d / "z.log")).ready()
    yield z
    z.stop()
    assert z.proc.returncode == 0 and not os.path.exists(z.path)   # a stop is clean and removes the socket


def started_server(zygote, tmp_path, name="s"):
    port_file = tmp_path / f"{name}.port"
    with open(tmp_path / f"{name}.log", "w") as log:
        proc = zygote.spawn(["server", "--host", "127.0.0.1", "--port", "0", "--shard-id", "0", "--num-shards", "1",
                             "--port-file", str(port_file)], log)
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()
        time.sleep(0.02)
    return proc, int(port_file.read_text())


def test_a_child_runs_the_command_with_the_callers_environment_directory_and_output(zygote, tmp_path, monkeypatch):
    log = tmp_path / "bad.log"
    env = {**os.environ, "DELTAPS_NUM_SHARDS": "not-a-number"}
    with open(log, "w") as out:
        proc = zygote.spawn(["server", "--host", "127.0.0.1", "--port", "0", "--shard-id", "0"], out, env)
    assert proc.wait(30) == 2
    assert "$DELTAPS_NUM_SHARDS='not-a-number' is not an integer" in log.read_text()
    # output to the descriptor given (here appended to the same log); the working directory is the caller's
    monkeypatch.chdir(tmp_path)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        proc = zygote.spawn(["server", "--host", "127.0.0.1", "--port", "0", "--shard-id", "0", "--num-shards", "1",
                             "--port-file", "relative.port", "--no-such-flag"], fd)
    finally:
        os.close(fd)
    assert proc.wait(30) == 2
    text = log.read_text()
    assert "not-a-number" in text and "unrecognized arguments: --no-such-flag" in text
    with open(tmp_path / "out.log", "w") as out, open(tmp_path / "err.log", "w") as err:   # stderr apart
        proc = zygote.spawn(["server", "--no-such-flag"], out, stderr=err)
    assert proc.wait(30) == 2
    assert "--no-such-flag" in (tmp_path / "err.log").read_text() and (tmp_path / "out.log").read_text() == ""
    proc, _ = started_server(zygote, tmp_path, "cwd")
    try:
        os.chdir(tmp_path.parent)       # the child keeps the directory it was started in
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_served_child_stops_on_sigterm_and_a_killed_one_reports_the_signal(zygote, tmp_path):
    proc, port = started_server(zygote, tmp_path, "graceful")
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass                      # it serves on the port it wrote
    proc.terminate()
    assert proc.wait(30) == 0     # the shard's graceful stop, exit code passed through
    proc, _ = started_server(zygote, tmp_path, "killed")
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()                   # a second kill of a dead child is a no-op


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_bad_requests_are_refused_and_the_zygote_serves_on(zygote, tmp_path):
    good = {"argv": ["server", "--help"], "env": dict(os.environ), "cwd": str(tmp_path)}
    held = _open_fds(zygote.proc.pid)
    with open(tmp_path / "unused.log", "w") as out:
        for line, fds, why in ((b"not json\n", [out.fileno()], b"Expecting value"),
                               (b"x" * (MAX_REQUEST_BYTES + (1 << 17)), [out.fileno()], b"at most"),     # no end
                               (b'{"argv": "server"}\n', [out.fileno()], b"JSON object with argv"),
                               (json.dumps({**good, "argv": []}).encode() + b"\n", [out.fileno()], b"non-empty"),
                               (json.dumps({**good, "zygote": str(tmp_path / "n.sock"), "node": {"netns": ""}}).encode()
                                + b"\n", [out.fileno()], b"node ({netns, hostname}"),
                               (json.dumps(good).encode() + b"\n", [], b"1 or 2 file descriptors, got 0")):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(zygote.path)
                socket.send_fds(s, [line], fds)
                answer = s.makefile("rb").readline()
                assert b'"error"' in answer and why in answer, answer
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:  # its descriptor, half a line, silence
            stalled.connect(zygote.path)
            socket.send_fds(stalled, [b'{"argv": '], [out.fileno()])
            with open(tmp_path / "help.log", "w") as log:
                proc = zygote.spawn(["server", "--help"], log)         # served after the stalled one times out
    assert proc.wait(30) == 0 and "--shard-id" in (tmp_path / "help.log").read_text()
    assert (tmp_path / "unused.log").read_text() == ""
    deadline = time.monotonic() + 5       # every descriptor a refused request brought was closed, none inherited
    while _open_fds(zygote.proc.pid) > held and time.monotonic() < deadline:    # (earlier tests' children may end)
        time.sleep(0.05)
    assert _open_fds(zygote.proc.pid) <= held


def test_a_child_that_outlives_its_zygote_is_watched_to_its_end(tmp_path):
    z = Zygote(str(tmp_path / "z.sock"), log=str(tmp_path / "z.log")).ready()
    try:
        proc, _ = started_server(z, tmp_path)
        z.proc.kill()
        z.proc.wait()
        assert proc.poll() is None                    # still running, reparented
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == UNKNOWN_EXIT          # its status went with the zygote: counted as failed
    finally:
        z.stop()
    with open(os.devnull, "w") as out, pytest.raises(ZygoteUnavailable):      # a dead zygote starts nothing
        z.spawn(["server", "--help"], out)


def test_a_zygote_whose_caller_died_stops_serving(tmp_path):
    """A caller killed -9 (a launcher, a test session) never stops its zygote: the zygote sees it gone, stops
    serving and removes its socket instead of holding torch's memory forever."""
    path = tmp_path / "z.sock"
    caller = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "zygote_parent.py"), str(path)],
                              stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(caller.stdout.readline())
        assert path.exists()
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() < deadline, "the zygote went on serving after its caller died"
        assert not path.exists()
    finally:
        if caller.poll() is None:
            caller.kill()
        if pid is not None and os.path.exists(f"/proc/{pid}"):     # a zygote that served on: not left behind
            os.kill(pid, signal.SIGKILL)


def test_stop_children_ends_a_polite_child_at_once_and_a_deaf_one_with_what_it_started_after_the_grace():
    """What a zygote does on its way out (stop_children): SIGTERM; a child that ignores it is killed after the grace,
    with its own child; both are reaped (no zombie left)."""
    # spawned by pid, as a zygote's forks are (a Popen would warn that a child reaped behind its back still runs)
    polite = os.posix_spawnp("sleep", ["sleep", "60"], os.environ)
    deaf = os.posix_spawn(sys.executable, [sys.executable, str(Path(__file__).parents[1] / "deaf_parent.py")], os.environ)
    deadline = time.monotonic() + 30
    while not (grandchild := descendants(deaf)):      # it ignores SIGTERM before it starts its child
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    stop_children([polite, deaf], grace=1.0)
    took = time.monotonic() - t0
    assert 1.0 <= took < 10, took            # the deaf one held it to the grace, no longer
    for pid in (polite, deaf):               # reaped by stop_children: no such child any more
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    deadline = time.monotonic() + 5
    while running(grandchild[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(grandchild[0])


def test_a_zygote_that_cannot_start_says_so(tmp_path):
    z = Zygote(str(tmp_path / "no-such-dir" / "z.sock"), log=str(tmp_path / "z.log"))
    with pytest.raises(ZygoteUnavailable, match="did not start") as failed:
        z.ready(timeout=60)
    assert "No such file or directory" in str(failed.value)      # with the zygote's own error from its log


def _stop(procs) -> list[int]:
    """Stop every one (SIGTERM, SIGKILL past the grace) before anything is asserted; their exit codes."""
    stop_processes(procs)
    return [p.returncode for p in procs]


def parent_of(pid: int) -> int:
    return int(stat_fields(pid)[1])


@pytest.mark.parametrize("zygotes", [True, False])
def test_a_bench_machine_forks_its_programs_from_one_zygote_unless_told_not_to(tmp_path, zygotes, monkeypatch):
    from deltaps.tools.bench_nodes import Nodes
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    net = Nodes(None, zygotes=zygotes)      # no topology: every node is this machine
    procs = []
    try:
        for i in range(2):
            port_file = tmp_path / f"s{i}.port"
            procs.append(net.spawn(i, ["server", "--host", "127.0.0.1", "--port", "0", "--shard-id", str(i),
                                       "--num-shards", "2", "--port-file", str(port_file)], str(tmp_path / f"s{i}.log")))
            while not (port_file.exists() and port_file.read_text().strip()):
                assert procs[-1].poll() is None, (tmp_path / f"s{i}.log").read_text()
                time.sleep(0.02)
        parents = {parent_of(p.pid) for p in procs}
        assert (parents == {os.getpid()}) != zygotes and len(parents) == 1
    finally:
        codes = _stop(procs)
        net.close()
    assert codes == [0] * len(procs)
    assert not list((tmp_path / "scratch").glob("deltaps-*"))     # the zygotes' sockets and logs went with them


@needs_root
def test_a_process_that_enters_a_node_sees_what_its_exec_prefix_shows():
    """node_host.enter (a zygote forked into a node) against `ip netns exec NS unshare --uts node_host NAME`: the same
    host name, hosts file and network devices; the process that forked it keeps its own."""
    with netns.Topology(2, rate="50mbit", prefix=TEST_PREFIX) as topo:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:        # the child only makes system calls and writes to the pipe, then leaves without cleanup
            try:
                node_host.enter(**topo.node(1))
                os.write(w, json.dumps({"hostname": socket.gethostname(), "peer": socket.gethostbyname(topo.ns(0)),
                                        "devices": sorted(os.listdir("/sys/class/net"))}).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as pipe:
            seen = json.loads(pipe.read() or "{}")
        os.waitpid(pid, 0)
        shown = subprocess.run(topo.exec_prefix(1) + ["ls", "/sys/class/net"], capture_output=True, text=True,
                               check=True).stdout.split()
        assert seen == {"hostname": topo.ns(1), "peer": topo.addr(0), "devices": sorted(shown)}
        assert socket.gethostname() != topo.ns(1) and topo.ifname(1) not in os.listdir("/sys/class/net")


@needs_root
def test_a_bench_networks_nodes_fork_from_zygotes_forked_from_one_hub(tmp_path):
    """torch is imported once for all of a network's nodes: each node's zygote is a child of one hub, and a shard
    forked on a node serves at that node's address (which exists only inside its namespace)."""
    from deltaps.tools.bench_nodes import Nodes
    with netns.Topology(2, rate="50mbit", prefix=TEST_PREFIX) as topo:
        net = Nodes(topo, workdir=str(tmp_path / "zygotes"))
        procs = []
        try:
            for i in range(2):
                port_file = tmp_path / f"s{i}.port"
                procs.append(net.spawn(i, ["server", "--host", net.addr(i), "--port", "0", "--shard-id", str(i),
                                           "--num-shards", "2", "--port-file", str(port_file)],
                                       str(tmp_path / f"s{i}.log")))
                while not (port_file.exists() and port_file.read_text().strip()):
                    assert procs[-1].poll() is None, (tmp_path / f"s{i}.log").read_text()
                    time.sleep(0.02)
            zygotes = [parent_of(p.pid) for p in procs]
            assert len(set(zygotes)) == 2 and len({parent_of(z) for z in zygotes}) == 1
        finally:
            codes = _stop(procs)
            net.close()
        assert codes == [0] * len(procs)
