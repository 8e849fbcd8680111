"""The probes' child programs run in the test process on loopback: the socket pairs, and the PS programs against
in-process shards (as child processes: tests/cluster/test_probe_children.py)."""
from __future__ import annotations

import json
import threading

from deltaps.tools import socket_probes, torch_probes


def _serving(serve, *args):
    """A listener on a port the OS picks, served by serve(listener, *args) in a thread."""
    listener = socket_probes.listen("127.0.0.1", 0)
    got = []
    t = threading.Thread(target=lambda: got.append(serve(listener, *args)), daemon=True)
    t.start()
    return listener, t, got


def test_sink_and_source_move_every_byte():
    nbytes = (3 << 20) + 123           # not a multiple of the chunk
    listener, t, got = _serving(socket_probes.sink, nbytes)
    seconds = socket_probes.source("127.0.0.1", listener.getsockname()[1], nbytes)
    t.join(10)
    listener.close()
    assert got == [nbytes] and 0 < seconds < 10


def test_ping_measures_half_a_round_trip():
    listener, t, _ = _serving(socket_probes.echo)
    one_way = socket_probes.ping("127.0.0.1", listener.getsockname()[1], 20)
    t.join(10)                          # the echo ends when the client hangs up
    listener.close()
    assert not t.is_alive() and 0 < one_way < 1


def test_ps_cycle_against_a_real_shard(cluster_factory):
    c = cluster_factory(1)
    for codec in ("none", "int8"):
        assert 0 < torch_probes.ps_cycle_seconds(c.addrs[0], codec, numel=4096, n=3) < 5


def test_ps_step_through_the_distributed_optimizer(cluster_factory):
    c = cluster_factory(2)
    tensors = json.loads(json.dumps([["w", 8192], ["b", 16]]))      # as the parent hands them over
    for codec in ("none", "int8"):
        assert 0 < torch_probes.ps_step_seconds(c.addrs, 0, 1, codec, tensors, n=2) < 5
