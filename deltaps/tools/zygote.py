"""Pre-warmed `deltaps` processes for local clusters: `python -m deltaps.tools.zygote SOCKET` imports torch once
(and torch._dynamo, which torch.optim imports on its first call), then forks every `deltaps <command>` it is asked
to run, so the child starts where a fresh interpreter would be after ~2 s of a core.

Why: a bench race starts 8 processes per run (4 workers + 4 shards, or a Lighthouse) on 2 shared cores; measured
here, a worker's start costs ~2.6 s of a core, ~2.1 of them those two imports, and a run's start-up took ~10.7 s of
wall time before its first step — longer than the training it measures on clf. Started with a node's exec prefix
(its network namespace, host name and mounts: deltaps/tools/netns.py), a zygote's children inherit all of it; the
caller moves each child into the node's CPU cap by pid, as it does a fresh process.

Protocol (a Unix socket: its path is reachable from every network namespace): the caller sends one JSON line
{"argv": [...], "env": {...}, "cwd": ...} (at most MAX_REQUEST_BYTES) with the child's stdout (and, if it differs,
stderr) as file descriptors beside it (SCM_RIGHTS: a log file the caller opened, or its own terminal); the zygote
answers {"pid": N}, then, when the child exits, {"returncode": rc} (negative: killed by that signal, as subprocess
reports it). A request with {"zygote": SOCKET, "node": {"netns": NS, "hostname": NAME}} (argv may be empty, the
descriptor is its log) forks a zygote of a bench network's node instead: the child enters the node in-process
(deltaps/tools/node_host.py enter) and serves SOCKET — so one hub imports torch for every node. The zygote stays
single-threaded (a child forked while another thread held a lock would inherit it held; the kernel gives a new mount
namespace only to a single thread).
What a child does not get afresh: modules imported before the fork (frozen out of the garbage collector, gc.freeze,
so a child's collections neither walk them nor copy their pages), and environment variables torch reads at import
(the zygote's environment, i.e. the caller's, holds for those). Python's `random` reseeds at fork itself. `ps`
shows a child with the zygote's command line. A zygote stops on SIGTERM, or by itself once its caller is gone; either
way it stops the children still running (a caller killed with SIGKILL could not).
"""
from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import time

from deltaps.errors import JobFailed
from deltaps.tools import node_host
from deltaps.tools.process_tree import kill_descendants, running, stop_children, stop_processes

# what costs a start its ~2 s of a core, then deltaps' own modules that every shard and worker imports (~0.15 s of a
# core each where bytecode is not cached, PYTHONDONTWRITEBYTECODE; none of them starts a thread or reads the
# environment at import, so a child's own environment still holds)
PRELOADED = ("torch", "torch._dynamo", "numpy", "deltaps.cli", "ps.server", "worker.trainers.loop",
             "worker.trainers.ps", "worker.trainers.torchft_peer")
POLL_S = 0.05                                      # how soon a child's exit is reported
MAX_REQUEST_BYTES = 1 << 20                        # argv + environment: far below; more is not a deltaps caller
HANDSHAKE_S = 60.0          # a caller waits this long for a zygote's answer ({"pid"}: it forks at once when serving)
UNKNOWN_EXIT = 255          # a child that outlived its zygote: its exit status is lost, so it counts as failed
STOP_GRACE_S = 10.0         # a zygote on its way out gives its children this long to end on SIGTERM


# ---- the zygote ---------------------------------------------------------------------------------------------------
def serve(path: str) -> tuple[dict, list[int]]:
    """Accept requests until SIGTERM; fork one child per request. Returns only in a child: its request and the file
    descriptors of its stdout and stderr."""
    gc.disable()            # what the imports free would leave holes in pages the children share
    for name in PRELOADED:
        __import__(name)
    gc.freeze()             # a child's collections then never write to the preloaded objects (copy-on-write)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path + ".tmp"):
        os.unlink(path + ".tmp")
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.replace(path + ".tmp", path)         # the path appears once the zygote can serve it
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C reaches the caller, which stops children, then us
    listener.settimeout(POLL_S)
    children: dict[int, socket.socket] = {}
    caller = os.getppid()
    while not stopping:
        if os.getppid() != caller:      # our caller died without stopping us (kill -9): nobody will ask or stop us
            break
        reap(children)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(5.0)        # a caller that connects and sends nothing does not stall the others
        fds = []
        try:
            request, fds = receive_request(conn)
            conn.settimeout(None)
            if len(fds) not in (1, 2):
                raise ValueError(f"a request carries the child's stdout (and stderr) as 1 or 2 file descriptors, "
                                 f"got {len(fds)}")
        except (ValueError, OSError) as e:
            for fd in fds:
                os.close(fd)
            reply(conn, {"error": str(e)})
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        # SIGTERM held over the fork: one sent to the child as soon as its caller has the pid must reach the child's
        # own (default) handler, not our copy of `stopping`
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)     # as a fresh interpreter has them
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            for c in (listener, conn, *children.values()):
                c.close()
            gc.enable()
            return request, fds
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        for fd in fds:
            os.close(fd)
        reply(conn, {"pid": pid})
        children[pid] = conn
    listener.close()
    os.unlink(path)
    # what still runs: a caller killed with SIGKILL could not stop it (found: shards serving on, reparented to init)
    stop_children(list(children), STOP_GRACE_S)
    for conn in children.values():
        conn.close()
    return {}, []


def receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request line and the file descriptors sent with it (they come with its first bytes); on any failure the
    descriptors are closed here (every later child would inherit them)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    try:
        while data and not data.endswith(b"\n"):
            if len(data) > MAX_REQUEST_BYTES:
                raise ValueError(f"a request line is at most {MAX_REQUEST_BYTES} bytes")
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        return parse_request(data.decode()), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def parse_request(line: str) -> dict:
    """One request line -> its fields, checked (ValueError names what is wrong)."""
    request = json.loads(line)          # json.JSONDecodeError is a ValueError
    fields = {"argv": list, "env": dict, "cwd": str}
    if not isinstance(request, dict) or any(not isinstance(request.get(k), t) for k, t in fields.items()):
        raise ValueError(f"a request is a JSON object with {', '.join(f'{k} ({t.__name__})' for k, t in fields.items())}")
    if "zygote" in request:     # a node's zygote: {"zygote": SOCKET, "node": {"netns": NS, "hostname": NAME}}
        node = request.get("node")
        if not isinstance(request["zygote"], str) or not isinstance(node, dict) or \
                any(not isinstance(node.get(k), str) or not node[k] for k in ("netns", "hostname")):
            raise ValueError("a node's zygote is asked for with zygote (its socket path) and node "
                             "({netns, hostname}: non-empty strings)")
    elif not request["argv"] or not all(isinstance(a, str) for a in request["argv"]):
        raise ValueError("argv must be a non-empty list of strings (a deltaps command and its arguments)")
    return request


def reply(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:     # the caller is gone: nobody to tell
        pass


def reap(children: dict[int, socket.socket]) -> None:
    """Report every exited child's return code to the caller that started it."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            reply(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: the request's output, environment, directory and argv."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)
    for fd in {null, *fds} - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["deltaps", *request["argv"]]


def exit_status(code) -> int:
    """What the interpreter makes of SystemExit(code)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def leave(code: int) -> None:
    """A child's last exit step: flush, then skip the teardown of torch's modules (~0.7 s of a core, measured;
    the zygote's own atexit hooks, registered before the fork, only log and free)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m deltaps.tools.zygote SOCKET")
    request, fds = serve(argv[0])
    while request.get("zygote"):      # forked to serve one node of a bench network, from inside it
        become(request, fds)
        node_host.enter(request["node"]["netns"], request["node"]["hostname"])
        request, fds = serve(request["zygote"])
    if not request:
        leave(0)
    become(request, fds)
    exit_code = [1]     # an exception out of the program leaves 1, as the interpreter would
    atexit.register(lambda: leave(exit_code[0]))   # first registered, last run: after the program's own hooks
    try:
        runpy.run_module("deltaps", run_name="__main__", alter_sys=True)    # what `python -m deltaps` runs
        exit_code[0] = 0
    except SystemExit as e:
        exit_code[0] = exit_status(e.code)
    raise SystemExit(exit_code[0])     # the interpreter's own exit: joins the program's threads, runs its hooks


# ---- the caller's side --------------------------------------------------------------------------------------------
class ZygoteUnavailable(JobFailed):
    """A zygote that did not start or no longer answers (the CLI prints it as one error line)."""


class Zygote:
    """One zygote process, started with an exec prefix (a node's namespace) or none (this machine)."""

    def __init__(self, path: str, prefix: list[str] = (), log: str | None = None, hub: "Zygote | None" = None,
                 node: dict | None = None):
        """Starts the zygote; ready() waits until it serves (start several, then wait for each). With a hub (a ready
        zygote on this machine) and a node ({netns, hostname}: netns.Topology.node), it is forked from the hub into
        that node instead of started through the prefix: torch is imported once for every node of a bench network."""
        self.path, self.log = path, log
        with open(log or os.devnull, "w") as out:      # the child holds its own copy; ours closes on errors too
            if hub is not None:
                self.proc = hub.spawn([], out, node_zygote={"zygote": path, "node": node})
            else:
                self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "deltaps.tools.zygote", path],
                                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready(self, timeout: float = 120.0) -> "Zygote":
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = open(self.log, errors="replace").read()[-2000:] if self.log and os.path.exists(self.log) else ""
                raise ZygoteUnavailable(f"zygote at {self.path} did not start (exit {self.proc.returncode}); "
                                        f"--no-zygote(s) starts fresh interpreters instead; its log:\n{tail}")
            time.sleep(0.02)
        return self

    def spawn(self, argv: list[str], stdout=None, env: dict | None = None, stderr=None,
              node_zygote: dict | None = None, cwd: str | None = None) -> "Forked":
        """`deltaps <argv...>` forked from the zygote, its output to stdout (a file or a descriptor; None: this
        process's), its errors to stderr (None: with the output, as Popen's stderr=STDOUT), in cwd (None: ours);
        node_zygote: the request fields that ask for a node's zygote instead ({"zygote": SOCKET, "node": {...}})."""
        fd = lambda f, own: own.fileno() if f is None else f if isinstance(f, int) else f.fileno()  # noqa: E731
        out = fd(stdout, sys.stdout)
        fds = [out] if stderr is None or fd(stderr, sys.stderr) == out else [out, fd(stderr, sys.stderr)]
        request = json.dumps({"argv": list(argv), "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd(),
                              **(node_zygote or {})})
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(HANDSHAKE_S)        # a wedged zygote fails the start instead of hanging it
        try:
            conn.connect(self.path)
            data = request.encode() + b"\n"
            conn.sendall(data[socket.send_fds(conn, [data], fds):])    # the descriptors ride the first bytes
            received = b""
            while b"\n" not in received:      # byte-exact: the exit report may follow in the same segment
                chunk = conn.recv(4096)
                if not chunk:
                    raise OSError(f"closed the connection without starting {argv[:1]}")
                received += chunk
        except OSError as e:
            conn.close()
            raise ZygoteUnavailable(f"zygote at {self.path}: {e}") from e
        conn.settimeout(None)               # Forked waits on it with select
        answer, rest = received.split(b"\n", 1)
        answer = json.loads(answer)
        if "error" in answer:
            conn.close()
            raise ValueError(f"zygote at {self.path} refused `deltaps {' '.join(argv[:1])}`: {answer['error']}")
        return Forked(answer["pid"], conn, ["deltaps", *argv], rest)

    def stop(self) -> None:
        stop_processes([self.proc])


class Starter:
    """Starts `deltaps <argv...>` programs on one machine (an exec prefix: a node's namespace; none: here): forked
    from a zygote when given a socket path for one (started here: ready() waits for it, close() stops it), else fresh
    interpreters. Output to a file with stderr beside it, or None: this process's stdout and stderr."""

    def __init__(self, zygote_path: str | None = None, prefix: list[str] = (), env: dict | None = None,
                 hub: Zygote | None = None, node: dict | None = None):
        """hub, node: the zygote is forked from hub into node (Zygote's); the prefix still starts fresh programs."""
        self.prefix, self.env = list(prefix), env
        self.zygote = Zygote(zygote_path, self.prefix, zygote_path + ".log", hub, node) if zygote_path else None

    def ready(self) -> "Starter":
        if self.zygote is not None:
            self.zygote.ready()
        return self

    def __call__(self, argv: list[str], stdout=None, env: dict | None = None, cwd: str | None = None):
        env = self.env if env is None else env
        if self.zygote is not None:
            return self.zygote.spawn(argv, stdout, env, stderr=None if stdout is not None else sys.stderr, cwd=cwd)
        return subprocess.Popen([*self.prefix, sys.executable, "-m", "deltaps", *argv], stdout=stdout,
                                stderr=None if stdout is None else subprocess.STDOUT, env=env, cwd=cwd)

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.stop()


class Forked:
    """A zygote's child, with the subprocess.Popen calls the launchers use (poll, wait, send_signal, terminate,
    kill). kill() takes the child's whole process tree, as bench_faults.TreeProcess does."""

    def __init__(self, pid: int, conn: socket.socket, args: list[str], received: bytes = b""):
        self.pid, self.args, self.returncode = pid, args, None
        self._conn, self._buf = conn, received

    def _read(self, timeout: float | None) -> None:
        if self._conn is None:       # the zygote died first: the orphan can only be watched, not waited for
            if not running(self.pid):
                self.returncode = UNKNOWN_EXIT
            elif timeout:
                time.sleep(min(timeout, POLL_S))
            return
        ready = selectors.DefaultSelector()
        ready.register(self._conn, selectors.EVENT_READ)
        try:
            if not ready.select(timeout):
                return
        finally:
            ready.close()
        chunk = self._conn.recv(4096)
        self._buf += chunk
        if b"\n" in self._buf:
            self.returncode = json.loads(self._buf.split(b"\n", 1)[0])["returncode"]
        if self.returncode is not None or not chunk:
            self._conn.close()
            self._conn = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(POLL_S * 4 if left is None else min(left, POLL_S * 4))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            kill_descendants(self.pid)
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
