"""DDP with torch's communication hooks as peer modes (`--mode allreduce --ddp-hook ...`, bench compare's
`ddp:<hook>`): real 2-rank gloo runs on loopback (worker/trainers/ddp_hooks.py, docs/compare.md).

All runs start at once (module fixture) so that the whole file stays well under a minute on 2 cores."""
import json

import pytest
from helpers import start_program

from deltaps.cli import main as cli_main
from deltaps.tools.launch import free_port, launch
from worker.trainers.collective import ring_bytes
from worker.trainers.ddp_hooks import parse_ddp_hook
from worker.trainers.strategy import load_job as load_config

STEPS, HIDDEN = 8, 64
# SGD without momentum: averaging the models after every step == averaging the gradients (localsgd:period=1)
JOB = {"steps": STEPS, "hidden": HIDDEN, "optimizer": "sgd", "momentum": 0.0, "lr": 0.2, "progress": False}
RUNS = {   # name -> worker flags (fp16 goes through `deltaps launch` instead)
    "ddp": [],
    "bf16": ["--ddp-hook", "bf16"],
    "localsgd1": ["--ddp-hook", "localsgd:period=1"],
    "localsgd3": ["--ddp-hook", "localsgd:period=3"],
    # several buckets (10 KiB cap): torch's powerSGD_hook deadlocks or mismatches collectives here on gloo
    "powersgd": ["--ddp-hook", "powersgd:rank=2:start=2", "--bucket-cap-mb", "0.01"],
    # one bucket, where torch's own hook works: ours must compute the same thing
    "powersgd1": ["--ddp-hook", "powersgd:rank=2:start=2:impl=deltaps"],
    "powersgd1-torch": ["--ddp-hook", "powersgd:rank=2:start=2:impl=torch"],
}


def _flags(job: dict) -> list[str]:
    out = []
    for k, v in job.items():
        if k != "progress":
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out + ["--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp-peers")
    # forked from the session's zygote (as `deltaps launch` starts its workers): 14 fresh interpreters importing torch
    # at once cost ~20 s of the 2 cores before any rank trained
    procs = {}
    try:
        for name, extra in RUNS.items():
            port = free_port()
            procs[name] = []
            for r in range(2):
                with open(tmp / f"{name}{r}.log", "w") as log:
                    procs[name].append(start_program(
                        ["worker", "--mode", "allreduce", "--rank", str(r), "--world-size", "2", "--master-addr",
                         "127.0.0.1", "--master-port", str(port), "--result-json", str(tmp / f"{name}{r}.json"),
                         *_flags(JOB), *extra], log))
        # meanwhile: fp16 through `deltaps launch --mode allreduce --ddp-hook fp16`
        fp16 = launch(load_config(None, {**JOB, "mode": "allreduce", "workers": 2, "ddp_hook": "fp16"}), quiet=True)
        out = {}
        for name, ps in procs.items():
            for r, p in enumerate(ps):
                rc = p.wait(120)
                assert rc == 0, f"{name}: exit {rc}\n{(tmp / f'{name}{r}.log').read_text()[-3000:]}"
            out[name] = [json.load(open(tmp / f"{name}{r}.json")) for r in range(2)]
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()
    out["fp16"] = fp16
    return out


def _max_diff(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_every_peer_mode_trains_and_reports(runs):
    for name in RUNS:
        for w in runs[name]:
            assert w["steps"] == STEPS and len(w["losses"]) == STEPS, name
            assert w["ddp_hook"] == str(parse_ddp_hook(RUNS[name][1] if RUNS[name] else "none")), name
            total = w["mean_step_s"] * w["steps"]
            assert w["compute_s"] + w["comm_s"] + w["wait_s"] == pytest.approx(total, rel=1e-6), name
            assert min(w["compute_s"], w["comm_s"], w["wait_s"]) >= 0, name
            assert len(w["bytes_pushed_wire_steps"]) == STEPS, name
    s = runs["fp16"]
    assert s["mode"] == "allreduce" and s["per_worker"][0]["ddp_hook"] == "fp16"
    assert "fp16_compress_hook" in s["per_worker"][0]["ddp_hook_impl"]


@pytest.mark.slow
def test_half_precision_hooks_follow_fp32_ddp_with_half_the_bytes(runs):
    ddp = runs["ddp"][0]
    g = ddp["grad_bytes_per_step"]
    assert ddp["bytes_pushed_wire_steps"] == [ring_bytes(g, 2)] * STEPS
    bf16, fp16 = runs["bf16"][0], runs["fp16"]
    assert bf16["bytes_pushed_wire_steps"] == [ring_bytes(g // 2, 2)] * STEPS
    assert fp16["bytes_pushed_wire_steps_rank0"] == [ring_bytes(g // 2, 2)] * STEPS
    assert fp16["compression_ratio"] == pytest.approx(2.0)
    assert _max_diff(fp16["loss_curve_rank0"], ddp["losses"]) < 5e-3
    assert _max_diff(bf16["losses"], ddp["losses"]) < 3e-2
    assert bf16["params_max_diff_across_ranks"] == 0.0


@pytest.mark.slow
def test_localsgd_period_1_equals_ddp_and_moves_the_model_every_h_steps(runs):
    ddp, l1, l3 = runs["ddp"][0], runs["localsgd1"][0], runs["localsgd3"][0]
    assert _max_diff(l1["losses"], ddp["losses"]) < 1e-5
    assert l1["params_max_diff_across_ranks"] < 1e-6
    full = ring_bytes(ddp["grad_bytes_per_step"], 2)     # parameters and gradients have the same size
    assert l1["bytes_pushed_wire_steps"] == [full] * STEPS
    # step 0 allreduces gradients (start_localSGD_iter=1); then a full fp32 average at steps 1, 4, 7, nothing else
    assert l3["bytes_pushed_wire_steps"] == [full if s in (0, 1, 4, 7) else 0 for s in range(STEPS)]
    assert l3["params_max_diff_across_ranks"] < 1e-6      # the last step (7) averaged
    assert l3["losses"][:2] == pytest.approx(ddp["losses"][:2], abs=1e-5)


@pytest.mark.slow
def test_powersgd_does_not_hang_and_learns(runs):
    for w, ddp in zip(runs["powersgd"], runs["ddp"]):
        assert w["ddp_hook"] == "powersgd:rank=2:start=2" and "deltaps" in w["ddp_hook_impl"]
        assert w["params_max_diff_across_ranks"] == 0.0
        assert sum(w["losses"][-2:]) / 2 < w["losses"][0] - 0.02, w["losses"]
        assert w["losses"][:2] == pytest.approx(ddp["losses"][:2], abs=1e-5)   # vanilla allreduce before start
        # from step 2 on: (n + m) * r per matrix + the uncompressed biases, fp32, ring over 2 ranks
        h, r = HIDDEN, 2
        elems = (64 + h) * r + h + (h + h) * r + h + (10 + h) * r + 10
        full = ring_bytes(ddp["grad_bytes_per_step"], 2)
        assert w["bytes_pushed_wire_steps"] == [full, full] + [ring_bytes(4 * elems, 2)] * (STEPS - 2)


@pytest.mark.slow
def test_our_powersgd_computes_what_torchs_hook_computes(runs):
    ours, theirs = runs["powersgd1"][0], runs["powersgd1-torch"][0]
    assert "torch powerSGD_hook" in theirs["ddp_hook_impl"]
    assert _max_diff(ours["losses"], theirs["losses"]) < 1e-5
    assert ours["bytes_pushed_wire_steps"] == theirs["bytes_pushed_wire_steps"]


def test_a_bad_ddp_hook_flag_fails_before_the_rendezvous(capsys):
    assert cli_main(["worker", "--mode", "allreduce", "--ddp-hook", "powersgd:rank=0", "--rank", "0",
                     "--world-size", "1", "--master-port", "1", "--no-progress"]) != 0
    assert "rank must be >= 1" in capsys.readouterr().err
