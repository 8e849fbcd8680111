"""End to end with real processes on loopback: `deltaps launch`, and the rollback switch on a live job."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from helpers import CONFIG, DELTAPS, ROOT, client, session_zygote, start_program, start_shards, worker_proc

from deltaps.cli import main as cli_main
from deltaps.tools.process_tree import descendants, running

pytestmark = pytest.mark.slow
SUMMARY_KEYS = {"mode", "sync", "codec", "workers", "servers", "steps", "final_test_accuracy", "wall_s",
                "mean_step_s", "compute_s", "comm_s", "wait_s", "bytes_pushed_wire", "bytes_pushed_raw",
                "bytes_pulled_wire"}


@pytest.fixture
def launched(tmp_path, capsys, monkeypatch):
    """`deltaps launch --config demo.yaml FLAGS...` in this process (its shards and workers forked from the session's
    zygote: conftest), its summary; a launcher in a subprocess (the signal tests below) imported torch and a zygote
    of its own first, ~7.5 s of a core a job."""
    def run(*flags):
        out, scratch = tmp_path / "summary.json", tmp_path / "scratch"
        scratch.mkdir()
        session_zygote()        # started before the scratch directory: its socket's path would be too long there
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))
        rc = cli_main(["launch", "--config", CONFIG, "--no-progress", "--json", str(out), *flags])
        printed = capsys.readouterr()
        assert rc == 0, printed.out + printed.err
        assert "deltaps summary" in printed.out
        # logs, results: removed after a job that ran (torch's own caches may stay)
        assert not list(scratch.glob("deltaps-*"))
        return json.loads(out.read_text())
    return run


def _check_honest(s, steps):
    assert SUMMARY_KEYS <= set(s)
    params_bytes = s["model_params"] * 4
    assert s["bytes_pushed_raw"] == params_bytes * steps * s["workers"]        # every gradient, every step
    full_every_step = params_bytes * steps * s["workers"]
    if s["sync"] == "bsp":      # every key advances every step: a full value per key per step
        assert s["bytes_pulled_wire"] >= full_every_step
    else:                       # keys that did not advance since the last pull cost nothing
        assert params_bytes * s["workers"] <= s["bytes_pulled_wire"] <= full_every_step + 4 * params_bytes * s["workers"]
    assert s["wall_s"] > 0 and s["mean_step_s"] > 0
    split = s["compute_s"] + s["comm_s"] + s["wait_s"]
    assert split == pytest.approx(s["mean_step_s"] * steps, rel=0.02)
    assert min(s["compute_s"], s["comm_s"], s["wait_s"]) >= 0
    pushes = sum(st["grads_applied"] for st in s["server_stats"])
    assert pushes > 0


def test_launch_bsp_demo_reaches_95_percent(launched):
    s = launched()
    assert (s["sync"], s["workers"], s["servers"]) == ("bsp", 2, 2)
    assert s["final_test_accuracy"] >= 0.95
    _check_honest(s, 300)
    assert sum(st["grads_applied"] for st in s["server_stats"]) == 300 * sum(st["num_keys"] for st in s["server_stats"])


@pytest.mark.parametrize("sync", ["asp", "ssp:2"])
def test_launch_async_modes_converge(launched, sync):
    s = launched("--sync", sync)
    assert s["sync"] == sync
    assert s["final_test_accuracy"] >= 0.93
    _check_honest(s, 300)
    if sync == "ssp:2":
        assert all(st["max_staleness"] <= 2 for st in s["server_stats"])


def test_rollback_switch_on_a_running_job(tmp_path, procs, capsys):
    """set-codec none mid-run: every worker adopts it at its next step, bytes per step jump, training completes."""
    addrs = start_shards(procs)
    workers = [procs.add(worker_proc(r, addrs, tmp_path, procs.log(f"worker{r}"), "--codec", "topk:ratio=0.01",
                                     "--steps", "600")) for r in range(2)]
    with client(addrs) as probe:
        for _ in range(1200):
            try:
                if min(st["min_version"] for st in probe.server_stats()) >= 150:
                    break
            except Exception:   # noqa: BLE001 - job not registered yet
                pass
            time.sleep(0.05)
        capsys.readouterr()
        # `deltaps ctl` in this process: a fresh interpreter's start-up (seconds on a loaded box) let the job run
        # on past the switch's window
        assert cli_main(["ctl", "--servers", ",".join(addrs), "set-codec", "none"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["codec"] == "none"
    for w in workers:
        assert w.wait(180) == 0
    for r in range(2):
        res = json.loads((tmp_path / f"w{r}.json").read_text())
        assert res["final_codec"] == "none" and len(res["codec_switches"]) == 1
        switch_step = res["codec_switches"][0][0]
        assert 150 <= switch_step < 600
        per_step = res["bytes_pushed_wire_steps"]
        # windows clipped to the run: on a slow box the switch can land late
        before_w, after_w = per_step[switch_step - 50:switch_step - 1], per_step[switch_step + 1:switch_step + 50]
        assert len(before_w) == 49 and len(after_w) >= 10, (switch_step, len(per_step))
        before, after = sum(before_w) / len(before_w), sum(after_w) / len(after_w)
        assert after > 20 * before, (before, after)
        assert after == pytest.approx(res["model_params"] * 4, rel=0.01)
        assert res["final_test_accuracy"] >= 0.93


def test_launch_passes_server_args_checkpoints_written(tmp_path, launched):
    ck = tmp_path / "ck"
    s = launched("--steps", "60", "--server-args", f"--checkpoint-dir {ck} --checkpoint-every-steps 20")
    assert s["steps"] == 60
    names = sorted(p.name for p in ck.iterdir())
    assert any(n.startswith("shard0-") for n in names) and any(n.startswith("shard1-") for n in names), names


def test_ranks_of_one_host_share_their_evaluations(tmp_path, launched):
    """--eval-cache across real worker processes: a local-update job's ranks hold the same global model at every
    evaluation, so each model state is scored once and both ranks log the same figures."""
    cache, logs = tmp_path / "evals", str(tmp_path / "ev{rank}.jsonl")
    s = launched("--local-steps", "8", "--steps", "48", "--eval-every", "8", "--eval-log", logs,
                 "--eval-cache", str(cache))
    assert s["steps"] == 48
    evals = [[json.loads(line) for line in open(logs.format(rank=r))][1:] for r in range(2)]     # after "started"
    assert len(evals[0]) == len(evals[1]) == 6
    assert [(e["step"], e["test_accuracy"]) for e in evals[0]] == [(e["step"], e["test_accuracy"]) for e in evals[1]]
    scored = list(cache.glob("eval-*.json"))
    assert len(scored) <= 6 + 1             # one per global model (+ the final evaluation), not one per rank


def test_a_failed_job_is_one_error_line_not_a_traceback(tmp_path):
    """A launcher whose shard or worker exits with an error prints `deltaps launch: error:` with what failed and
    exits 1; the launcher's own stack is noise to a user."""
    proc = subprocess.run(DELTAPS + ["launch", "--config", CONFIG, "--no-progress", "--steps", "5",
                                     "--server-args=--no-such-flag"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "deltaps launch: error: server exited with code 2 before listening" in proc.stderr
    log = Path(proc.stderr.split("(log ")[1].split(")")[0])      # the failed job's logs stay, named in the error
    assert log.name == "server0.log" and "--no-such-flag" in log.read_text()
    assert "unrecognized arguments: --no-such-flag" in proc.stderr      # the log's tail, in the error itself
    shutil.rmtree(log.parent)
    assert "Traceback" not in proc.stderr


def test_a_worker_past_its_deadline_is_asked_where_it_waits(tmp_path):
    """Before the launchers stop a worker that overran its deadline they ask it for its stacks (SIGUSR1,
    faulthandler): its log, which the error quotes, shows where it waits — here, reconnecting to a shard that is
    not there."""
    from deltaps.tools.process_tree import STACKS_SIGNAL, ask_for_stacks, catches
    log_path = tmp_path / "worker0.log"
    with open(log_path, "w") as log:
        worker = start_program(["worker", "--servers", "127.0.0.1:1", "--rank", "0", "--world-size", "1", "--config",
                                CONFIG, "--no-progress", "--reconnect-deadline-s", "60"], log)
    try:
        deadline = time.monotonic() + 30
        assert ask_for_stacks([worker]) in (0, 1)          # one still starting is not asked: it would die of it
        while not catches(worker.pid, STACKS_SIGNAL):
            assert worker.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        while "worker/session.py" not in log_path.read_text():   # until its shard registration is retrying
            assert ask_for_stacks([worker], settle_s=0.3) == 1 and time.monotonic() < deadline, log_path.read_text()
        assert "most recent call first" in log_path.read_text()
        assert worker.poll() is None            # asked, not stopped
    finally:
        worker.kill()
        worker.wait(10)
    assert ask_for_stacks([worker]) == 0        # a process that is gone is not asked
    other = subprocess.Popen(["sleep", "30"])   # nor one without a handler (a torchrun agent): it would die of it
    try:
        assert ask_for_stacks([other]) == 0 and other.poll() is None
    finally:
        other.kill()
        other.wait()


@contextlib.contextmanager
def launch_tree(proc: subprocess.Popen, scratch: Path, servers: int, workers: int):
    """The pids of a running `deltaps launch`'s zygote, shards and workers, once each of its workers has a log;
    on the way out the launcher and whatever of them is left are killed."""
    kids = []
    try:
        deadline = time.monotonic() + 120
        while len(kids) < 1 + servers + workers or len(list(scratch.glob("deltaps-*/worker*.log"))) < workers:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            time.sleep(0.1)
            kids = descendants(proc.pid)
        yield kids
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:
            if running(k):
                os.kill(k, 9)


def outliving(kids: list[int], within_s: float = 30.0) -> list[int]:
    """Those of kids still running after up to within_s."""
    deadline = time.monotonic() + within_s
    while any(running(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [k for k in kids if running(k)]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_launcher_ended_by_a_signal_stops_its_shards_and_workers(tmp_path, sig, code):
    """A supervisor (timeout, systemd, a pod's deletion) ends `deltaps launch` with SIGTERM, a user with Ctrl-C: it
    stops its shards and workers and removes its scratch, then exits with one line, no stack (found: shards of a job
    whose launcher got SIGTERM still serving, reparented to init)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen(DELTAPS + ["launch", "--config", CONFIG, "--no-progress", "--servers", "1", "--workers", "1",
                                       "--steps", "1000000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch)},
                            preexec_fn=lambda: (signal.signal(sig, signal.SIG_DFL), signal.signal(signal.SIGHUP,
                                                                                                  signal.SIG_IGN)))
    # started as `nohup` starts it (SIGHUP ignored: it stays ignored), with the signal under test at its default (a
    # test run in the background would otherwise hand SIGINT down ignored)
    with launch_tree(proc, scratch, servers=1, workers=1) as kids:
        proc.send_signal(signal.SIGHUP)         # the terminal closing under nohup: nothing stops
        time.sleep(0.5)
        assert proc.poll() is None and all(running(k) for k in kids)
        proc.send_signal(sig)
        time.sleep(0.2)
        proc.send_signal(sig)       # a second one (Ctrl-C twice, a resent SIGTERM) does not cut the cleanup short
        assert proc.wait(60) == code
        out = proc.stdout.read()
        assert "Traceback" not in out and (sig != signal.SIGINT or "deltaps launch: interrupted" in out), out
        assert not outliving(kids), "a shard or worker outlived its launcher"
        assert not list(scratch.glob("deltaps-*"))


def test_a_launcher_killed_with_sigkill_leaves_no_shard_or_worker_running(tmp_path):
    """SIGKILL (the OOM killer, `kill -9`) cannot be handled: the launcher's zygote, seeing its caller gone, stops the
    shards and workers it forked (found: they served on, reparented to init)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen(DELTAPS + ["launch", "--config", CONFIG, "--no-progress", "--servers", "2", "--workers", "2",
                                       "--steps", "1000000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch)})
    with launch_tree(proc, scratch, servers=2, workers=2) as kids:
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        assert not outliving(kids), "a shard or worker outlived its launcher's SIGKILL"
