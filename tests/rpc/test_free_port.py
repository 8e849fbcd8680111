"""free_port hands out listen ports outside the kernel's ephemeral range, so no outgoing connection can take
one between the pick and the child's bind (CI saw a torch rendezvous fail with EADDRINUSE that way)."""
from __future__ import annotations

import random
import socket

from deltaps.tools.launch import free_port


def test_ports_lie_below_the_ephemeral_range_are_bindable_and_distinct():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch):
    real, calls = random.SystemRandom.randrange, []

    def busy_first(self, a, b):     # the first two probes hit the busy port, then random ones
        calls.append(a)
        return taken if len(calls) <= 2 else real(self, a, b)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen(1)
        taken = busy.getsockname()[1]
        monkeypatch.setattr(random.SystemRandom, "randrange", busy_first)
        assert free_port() != taken
        assert len(calls) >= 3
