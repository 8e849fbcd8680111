"""The socket programs behind the network probes, each run in a child process (often inside a network namespace,
deltaps/tools/netns.py), and what their parents read from stdout:

    python -m deltaps.tools.socket_probes sink HOST PORT NBYTES         # "ready", then takes NBYTES and answers b"k"
    python -m deltaps.tools.socket_probes source HOST PORT NBYTES       # seconds until the sink's b"k" (a float)
    python -m deltaps.tools.socket_probes ping-server HOST PORT         # "ready", then echoes one client
    python -m deltaps.tools.socket_probes ping-client HOST PORT COUNT   # median one-way latency, seconds (a float)

Standard library only, so a child is listening (or sending) a moment after it starts. The parents' side,
stream_seconds and one_way_latency, starts them on the nodes of a netns.Topology (anything with exec_prefix(i)
and addr(i): a stand-in returning [] and 127.0.0.1 runs them on loopback).
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from deltaps.tools.children import checkout_env, module_command, run_program

MODULE = "deltaps.tools.socket_probes"
CHUNK = 1 << 20
PING_BYTES = 32


def command(program: str, *args) -> list[str]:
    """argv of one of this module's programs (see the module docstring)."""
    return module_command(MODULE, program, *args)


def listen(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # the fixed probe ports are reused run after run
    s.bind((host, port))
    s.listen(1)
    return s


def sink(listener: socket.socket, nbytes: int) -> int:
    """Take nbytes from one connection, then answer one byte: the source's clock stops when all has arrived."""
    conn, _ = listener.accept()
    got = 0
    while got < nbytes:
        b = conn.recv(CHUNK)
        if not b:
            break
        got += len(b)
    conn.sendall(b"k")
    conn.close()
    return got


def source(host: str, port: int, nbytes: int) -> float:
    """Seconds to send nbytes to a sink and hear back that it has them all."""
    conn = socket.create_connection((host, port), timeout=60)
    buf, sent = b"\0" * CHUNK, 0
    t0 = time.perf_counter()
    while sent < nbytes:
        sent += conn.send(buf[: min(len(buf), nbytes - sent)])
    conn.recv(1)
    seconds = time.perf_counter() - t0
    conn.close()
    return seconds


def echo(listener: socket.socket) -> None:
    """Echo one client's bytes back until it hangs up."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = conn.recv(64)
        if not b:
            break
        conn.sendall(b)
    conn.close()


def ping(host: str, port: int, count: int) -> float:
    """Median one-way latency of small messages to an echo server: half the median round trip."""
    conn = socket.create_connection((host, port), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    round_trips = []
    for _ in range(count):
        t0 = time.perf_counter()
        conn.sendall(b"x" * PING_BYTES)
        got = 0
        while got < PING_BYTES:
            b = conn.recv(64)
            if not b:
                raise ConnectionError("echo server hung up")
            got += len(b)
        round_trips.append(time.perf_counter() - t0)
    conn.close()
    round_trips.sort()
    return round_trips[len(round_trips) // 2] / 2


def _serve(host: str, port: str, serve, *args) -> None:
    listener = listen(host, int(port))
    print("ready", flush=True)      # the parent starts the other side only after this line
    serve(listener, *args)
    listener.close()


PROGRAMS = {   # name -> (argument names, run)
    "sink": (("host", "port", "nbytes"), lambda h, p, n: _serve(h, p, sink, int(n))),
    "source": (("host", "port", "nbytes"), lambda h, p, n: print(source(h, int(p), int(n)))),
    "ping-server": (("host", "port"), lambda h, p: _serve(h, p, echo)),
    "ping-client": (("host", "port", "count"), lambda h, p, n: print(ping(h, int(p), int(n)))),
}


def _spawn_ready(cmd: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=checkout_env())
    if p.stdout.readline().strip() != "ready":
        p.kill()
        p.wait()
        raise RuntimeError(f"probe server did not start: {' '.join(cmd)}")
    return p


def stream_seconds(topo, pairs, port: int, nbytes: int) -> list[float]:
    """Seconds each (src, dst) node pair took to move nbytes over one TCP stream, all pairs at once."""
    sinks = [_spawn_ready(topo.exec_prefix(d) + command("sink", topo.addr(d), port, nbytes)) for _, d in pairs]
    try:
        sources = [subprocess.Popen(topo.exec_prefix(s) + command("source", topo.addr(d), port, nbytes),
                                    stdout=subprocess.PIPE, text=True, env=checkout_env())
                   for s, d in pairs]
        outs = [p.communicate(timeout=300)[0] for p in sources]
        if any(p.returncode for p in sources):
            raise RuntimeError(f"throughput source failed (exit codes {[p.returncode for p in sources]})")
        return [float(out.strip()) for out in outs]
    finally:
        for p in sinks:
            p.kill()
            p.wait()


def one_way_latency(topo, src: int, dst: int, port: int, count: int = 300) -> float:
    """Median one-way seconds of a small message from node src to node dst (half a round trip)."""
    server = _spawn_ready(topo.exec_prefix(dst) + command("ping-server", topo.addr(dst), port))
    try:
        out = subprocess.run(topo.exec_prefix(src) + command("ping-client", topo.addr(dst), port, count),
                             capture_output=True, text=True, check=True, env=checkout_env()).stdout
        return float(out.strip())
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    return run_program(PROGRAMS, sys.argv[1:] if argv is None else argv, MODULE)


if __name__ == "__main__":
    raise SystemExit(main())
