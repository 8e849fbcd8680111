"""--mode torchft (worker/trainers/torchft_peer.py): torchft's own DiLoCo, run by real worker processes against a
real Lighthouse (`deltaps launch` starts it), computes exactly what deltaps' local-update mode computes with the
same inner and outer settings — the race's peers get the same outer optimizer, checked bit for bit."""
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from deltaps.tools.launch import free_port, launch
from worker.trainers.strategy import load_job

pytest.importorskip("torchft", reason="torchft is the optional `peers` extra (make setup installs it)")

JOB = dict(workers=2, servers=2, steps=24, local_steps=4, batch_size=32, hidden=64, layers=2, optimizer="adam",
           lr=1e-3, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9, progress=False, timeout_s=30.0)


def _run(tmp_path, metrics: bool = False, **over) -> tuple[dict, dict]:
    out = tmp_path / f"{over['mode']}.pt"
    summary = launch(load_job(None, {**JOB, **over, "save_model": str(out)}), quiet=True, metrics=metrics)
    return summary, torch.load(out)


@pytest.fixture(scope="module")
def job_runs(tmp_path_factory):
    """JOB's torchft run (with --metrics) and ps run, made once for the tests that compare against them (a launch
    costs seconds)."""
    tmp = tmp_path_factory.mktemp("job")
    return {mode: _run(tmp, mode=mode, metrics=mode == "torchft") for mode in ("torchft", "ps")}


def test_torchft_diloco_is_deltaps_local_updates_with_the_same_outer_nesterov(job_runs):
    (ft, ft_model), (ps, ps_model) = job_runs["torchft"], job_runs["ps"]
    assert ft_model.keys() == ps_model.keys()
    diff = max((ft_model[k] - ps_model[k]).abs().max().item() for k in ft_model)
    assert diff < 1e-6, diff                        # same rounds, same mean pseudo-gradient, same Nesterov
    w = ft["per_worker"][0]
    assert w["syncs"] == 6 and w["torchft_algorithm"] == "diloco" and w["fragments"] == 1
    assert w["bytes_pushed_wire"] == 6 * sum(v.numel() * 4 for v in ft_model.values())   # ring 2(W-1)/W = 1
    assert ft["final_test_accuracy"] == pytest.approx(ps["final_test_accuracy"])


def test_a_torchft_job_with_metrics_does_not_wait_for_a_lighthouse_exporter(job_runs):
    # --metrics starts exporters in the shards and ps workers; the Lighthouse has none (it once waited 60 s for one)
    assert job_runs["torchft"][0]["metrics_urls"] == []


def test_the_lm_s_own_parameter_is_synced_too(tmp_path):
    # the byte transformer's `position` belongs to the root module, outside every child torchft's fragments are
    # cut from: unsynced, each replica kept its own and the peer trailed deltaps on lm (worker/trainers/torchft_peer.py)
    lm = dict(workload="lm", steps=8, batch_size=8, layers=1)
    _, ft_model = _run(tmp_path, mode="torchft", **lm)
    _, ps_model = _run(tmp_path, mode="ps", **lm)
    assert "position" in ft_model
    assert max((ft_model[k] - ps_model[k]).abs().max().item() for k in ft_model) < 1e-6


def test_a_spec_s_own_outer_settings_reach_both_sides(tmp_path, job_runs):
    from deltaps.strategies import parse_mode_spec
    outer = ":outer=sgd:outer_lr=0.5:outer_momentum=0.5"       # not the JOB's nesterov 0.7 / 0.9
    _, ft_model = _run(tmp_path, **parse_mode_spec("torchft:diloco:sync=4" + outer).overrides())
    _, ps_model = _run(tmp_path, **parse_mode_spec("ps-local4:none" + outer).overrides())
    _, nesterov = job_runs["ps"]
    assert max((ft_model[k] - ps_model[k]).abs().max().item() for k in ft_model) < 1e-6
    assert max((nesterov[k] - ps_model[k]).abs().max().item() for k in ft_model) > 1e-4     # the settings took


def test_a_bf16_wire_halves_the_bytes_and_stays_close(tmp_path, job_runs):
    fp32, fp32_model = job_runs["torchft"]
    bf16, bf16_model = _run(tmp_path, mode="torchft", torchft_wire="bf16")
    assert bf16["per_worker"][0]["wire_dtype"] == "bf16"
    assert 2 * bf16["per_worker"][0]["bytes_pushed_wire"] == fp32["per_worker"][0]["bytes_pushed_wire"]
    diff = max((fp32_model[k] - bf16_model[k]).abs().max().item() for k in fp32_model)
    assert 0 < diff < 0.05, diff                         # rounded pseudo-gradients: close, not identical


def test_rules_name_what_is_missing():
    with pytest.raises(ValueError, match="needs --local-steps"):
        load_job(None, {"mode": "torchft"})
    with pytest.raises(ValueError, match="must divide --local-steps"):
        load_job(None, {"mode": "torchft", "local_steps": 8, "stream_fragments": 3})
    with pytest.raises(ValueError, match="no --stream-fragments"):
        load_job(None, {"mode": "torchft", "local_steps": 8, "stream_fragments": 2, "torchft_algorithm": "localsgd"})
    with pytest.raises(ValueError, match="--sync bsp"):
        load_job(None, {"mode": "torchft", "local_steps": 8, "sync": "asp"})
    with pytest.raises(ValueError, match="--torchft-wire must be"):
        load_job(None, {"mode": "torchft", "local_steps": 8, "torchft_wire": "int8"})
    with pytest.raises(ValueError, match="no --torchft-wire"):
        load_job(None, {"mode": "torchft", "local_steps": 8, "torchft_wire": "bf16", "torchft_algorithm": "localsgd"})


def _listening_lighthouse(tmp_path, *flags: str) -> tuple[subprocess.Popen, int]:
    """`deltaps lighthouse --bind 127.0.0.1:<free port> <flags>` once it accepts connections (its log: lh.log)."""
    port = free_port("127.0.0.1")
    with open(tmp_path / "lh.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deltaps", "lighthouse", "--bind", f"127.0.0.1:{port}", *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "lh.log").read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.monotonic() >= deadline:
                proc.kill()
                raise AssertionError("the Lighthouse never listened") from None
            time.sleep(0.05)


def test_deltaps_lighthouse_serves_torchfts_lighthouse_until_sigterm(tmp_path):
    """`deltaps lighthouse` (what launch and bench compare fork for torchft modes) serves torchft's LighthouseServer
    at --bind, exits 0 on SIGTERM; a bad --min-replicas is a usage error naming the flag."""
    proc, _ = _listening_lighthouse(tmp_path, "--min-replicas", "2", "--quorum-tick-ms", "10")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "serving at http://" in (tmp_path / "lh.log").read_text()
    bad = subprocess.run([sys.executable, "-m", "deltaps", "lighthouse", "--bind", "127.0.0.1:0", "--min-replicas", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--min-replicas must be >= 1, got 0" in bad.stderr


def test_deltaps_lighthouse_waits_for_a_heartbeating_replica_as_torchft_lighthouse_does(tmp_path):
    # torchft's Python LighthouseServer takes an unset join timeout as 100 ms: a quorum of more than half the
    # heartbeating replicas formed without one 0.1 s late (the faults race's min_replicas=3 peer healed all job long)
    from datetime import timedelta

    from torchft._torchft import LighthouseClient
    proc, port = _listening_lighthouse(tmp_path, "--min-replicas", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        client = LighthouseClient(url, timedelta(seconds=5))
        quorums = {}

        def ask(replica: str, wait_s: float) -> None:
            try:
                quorums[replica] = LighthouseClient(url, timedelta(seconds=5)).quorum(replica, timedelta(seconds=wait_s))
            except TimeoutError:
                quorums[replica] = None
        for replica in ("a", "b", "late"):
            client.heartbeat(replica)
        asking = [threading.Thread(target=ask, args=(r, 1.5)) for r in ("a", "b")]
        [t.start() for t in asking]
        [t.join(30) for t in asking]
        assert quorums == {"a": None, "b": None}     # 2 of 3 would do, but "late" heartbeats: it is waited for
        # "a" and "b" ask again before "late" joins: their first requests, timed out on this side, may still be held
        # by the Lighthouse, and a "late" in first would complete a quorum with those and leave the new ones waiting
        asking = [threading.Thread(target=ask, args=(r, 20)) for r in ("a", "b", "late")]
        [t.start() for t in asking[:2]]
        time.sleep(0.5)
        asking[2].start()
        [t.join(30) for t in asking]
        assert [sorted(m.replica_id for m in quorums[r].participants) for r in ("a", "late")] == [["a", "b", "late"]] * 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_first_quorum_before_the_clock_changes_no_bit_and_takes_the_set_up_off_the_first_sync(tmp_path, job_runs):
    # --torchft-first-quorum (the bench's first start): the Lighthouse's quorum and the gloo group's set-up happen
    # before step 0, so the first sync costs what the later ones do; the quorum is no sync and heals nothing
    (plain, plain_model) = job_runs["torchft"]
    first, first_model = _run(tmp_path, mode="torchft", torchft_first_quorum=True)
    assert max((first_model[k] - plain_model[k]).abs().max().item() for k in plain_model) == 0.0
    assert first["per_worker"][0]["syncs"] == 6 and first["per_worker"][0]["steps_trained"] == JOB["steps"]
    syncs = {r is first: r["per_worker"][0]["sync_blocked_s"] for r in (plain, first)}
    print("each sync's seconds, without / with the first quorum:", syncs[False], syncs[True])
    later = sorted(syncs[True][1:])
    assert syncs[True][0] < 3 * later[len(later) // 2], syncs[True]


def test_a_first_quorum_below_every_replica_meets_again_until_all_are_in(tmp_path, job_runs):
    # --torchft-min-replicas 1: a quorum may form with the first replica alone; it meets again until both are in,
    # else the late one's first quorum would pair with the other's first sync
    _, plain_model = job_runs["torchft"]
    first, first_model = _run(tmp_path, mode="torchft", torchft_first_quorum=True, torchft_min_replicas=1)
    assert max((first_model[k] - plain_model[k]).abs().max().item() for k in plain_model) == 0.0
    assert [w["syncs"] for w in first["per_worker"]] == [6, 6]
