"""wait_port_file (deltaps/tools/launch.py): a child that never listens fails the job with one error line naming
the child and quoting its log — a JobFailed the CLI prints, never a bare TimeoutError's traceback."""
from __future__ import annotations

import pytest

from deltaps.errors import JobFailed
from deltaps.tools.launch import wait_port_file


class _Child:
    def __init__(self, returncode=None):
        self.returncode = returncode

    def poll(self):
        return self.returncode


def test_a_port_written_is_read(tmp_path):
    (tmp_path / "p").write_text("7001")
    assert wait_port_file(str(tmp_path / "p"), _Child(), timeout=1) == 7001


def test_a_child_that_never_listens_fails_the_job_naming_it_and_its_log(tmp_path):
    log = tmp_path / "server0.log"
    log.write_text("starting\nstuck on something\n")
    with pytest.raises(JobFailed, match=r"server metrics exporter did not start listening in 0.2 s") as e:
        wait_port_file(str(tmp_path / "missing"), _Child(), timeout=0.2, log=str(log), what="server metrics exporter")
    assert str(log) in str(e.value) and "stuck on something" in str(e.value)


def test_a_child_that_exits_first_fails_the_job_with_its_code(tmp_path):
    with pytest.raises(JobFailed, match="worker metrics exporter exited with code 3 before listening"):
        wait_port_file(str(tmp_path / "missing"), _Child(3), timeout=5, what="worker metrics exporter")
