"""The probes' child programs as the parents start them (`python -m deltaps.tools.<module> PROGRAM ARGS`) and
parse their output: the socket pairs on a loopback stand-in for netns.Topology (no root needed), two gloo
ranks of the allreduce program, the compute program from a cwd outside the checkout."""
from __future__ import annotations

import json
import subprocess

from deltaps.tools import netns, socket_probes, torch_probes
from deltaps.tools.children import checkout_env
from deltaps.tools.launch import free_port


class Loopback:
    """netns.Topology's interface with every node on this host's loopback."""

    def exec_prefix(self, i: int) -> list[str]:
        return []

    def addr(self, i: int) -> str:
        return "127.0.0.1"


def test_parents_start_the_socket_programs_and_parse_their_output():
    """netns.measure_throughput and the latency probe, exactly as on namespaces, with children on loopback."""
    bps = netns.measure_throughput(Loopback(), 0, 1, nbytes=2 << 20, port=free_port())
    assert bps > 1e6
    assert 0 < socket_probes.one_way_latency(Loopback(), 0, 1, port=free_port(), count=20) < 1


def test_allreduce_program_with_two_gloo_ranks():
    port = free_port()
    env = {**checkout_env(), "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [subprocess.Popen(torch_probes.command("allreduce", r, 2, "127.0.0.1", port, 64 << 10, 16 << 10, 3),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    assert 0 < float(outs[0][0].strip()) < 5 and outs[1][0].strip() == ""     # rank 0 alone prints


def test_compute_program_runs_from_any_cwd_and_prints_what_probe_compute_parses(tmp_path):
    """As probe_compute runs it (its cwd need not be the checkout: `ip netns exec` children inherit any)."""
    p = subprocess.run(torch_probes.command("compute", 8, 1, 4, 3, 0.0), cwd=tmp_path, env=checkout_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr, p.stderr       # e.g. runpy's "found in sys.modules" of a double import
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(got) == {"fwd_bwd_s", "bwd_s", "optimizer_s"} and all(v > 0 for v in got.values())
