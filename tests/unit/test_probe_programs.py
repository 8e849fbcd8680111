"""The programs the probes run in child processes (deltaps/tools/socket_probes.py, deltaps/tools/torch_probes.py):
their argv contract and the compute probe in-process; on sockets in tests/rpc/test_probe_programs_loopback.py,
as child processes in tests/cluster/test_probe_children.py."""
from __future__ import annotations

import sys

from deltaps.tools import socket_probes, torch_probes
from deltaps.tools.children import run_program


def test_commands_run_the_module_by_its_importable_name():
    assert socket_probes.MODULE == socket_probes.__name__ and torch_probes.MODULE == torch_probes.__name__
    assert socket_probes.command("sink", "198.18.0.3", 5410, 1 << 20) == [
        sys.executable, "-m", "deltaps.tools.socket_probes", "sink", "198.18.0.3", "5410", "1048576"]
    assert torch_probes.command("ps-step", "a:1,b:2", 0, 2, "int8", '[["w", 4]]', 3)[2:] == [
        "deltaps.tools.torch_probes", "ps-step", "a:1,b:2", "0", "2", "int8", '[["w", 4]]', "3"]


def test_a_wrong_program_or_argument_count_prints_the_usage(capsys):
    assert socket_probes.main(["nope"]) == 2
    assert socket_probes.main(["sink", "127.0.0.1", "5201"]) == 2          # NBYTES missing
    assert run_program(torch_probes.PROGRAMS, [], torch_probes.MODULE) == 2
    err = capsys.readouterr().err
    assert "python -m deltaps.tools.socket_probes ping-client HOST PORT COUNT" in err
    assert "python -m deltaps.tools.torch_probes compute HIDDEN LAYERS BATCH STEPS START" in err


def test_compute_step_times_of_a_tiny_mlp():
    got = torch_probes.compute_step_times(hidden=8, layers=1, batch=4, steps=3, start=0.0)
    assert set(got) == {"fwd_bwd_s", "bwd_s", "optimizer_s"}
    assert 0 < got["bwd_s"] <= got["fwd_bwd_s"] < 5 and 0 < got["optimizer_s"] < 5
