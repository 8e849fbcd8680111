"""`make gpu-check`: the GPU path end to end in one run, on a machine with a CUDA GPU (docs/gpu.md).

    python -m deltaps.tools.gpu_check --out gpu-check        # make gpu-check installs the gpu extra first

Steps, each under its own time limit; a failed step does not stop the next, and the exit status is 1 if any failed:
1. `pytest -m gpu`: CuPy payloads byte-identical to the CPU kernels' for every codec (the local-update round
   codecs included), decoding and scatter-adding on the device, error feedback kept on the device.
2. `deltaps bench codecs --device cuda --size 256MiB`: each codec's round trip as a ratio of a device-to-device copy
   of the same buffer, measured in the same run.
3. `deltaps launch --device cuda` on digits, 2 shards + 2 workers sharing the one GPU: a gradient job and a
   local-update job, each also run with `--device cpu` for the accuracy band; the workers' /metrics are scraped
   while they train (deltaps_gpu_*), and the compute/comm split is read from the summary.
4. `deltaps bench compare --no-shaping --device cuda`: fp32 `ddp` over NCCL beside `ps:int8`, one worker per GPU
   (NCCL refuses two ranks on one GPU).
Everything lands in --out: gpu-check.json (the verdicts and figures), one log per step, the scrapes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import torch

PY = [sys.executable, "-m"]
JOBS = {   # name -> launch flags beside --config configs/demo.yaml
    "ps": ["--codec", "int8"],
    "ps-local8": ["--codec", "int8", "--local-steps", "8"],
}
ACCURACY_BAND = 0.02     # a GPU job's final accuracy within 2 points of the same job on the CPU


def run_step(name: str, argv: list[str], out: str, timeout_s: float) -> dict:
    """Run one step's command, its output to <out>/<name>.log; rc, seconds and the output's tail."""
    t0 = time.perf_counter()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(os.path.join(out, f"{name}.log")) as log:
        tail = log.read()[-1500:]
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def scrape_while_running(proc: subprocess.Popen, log_path: str, workers: int) -> dict[str, str]:
    """Follow a `deltaps launch --metrics` run: once it prints its metrics URLs, fetch every worker's /metrics
    until the run ends; the last scrape of each worker that carried deltaps_gpu_* lines."""
    scrapes: dict[str, str] = {}
    urls: list[str] = []
    with open(log_path, "w") as log:
        def follow():
            for line in proc.stdout:
                log.write(line)
                if "metrics at" in line:
                    urls.extend(line.split("metrics at", 1)[1].split()[-workers:])
        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        while proc.poll() is None:
            for url in list(urls):
                try:
                    text = urllib.request.urlopen(url, timeout=2).read().decode()
                except OSError:
                    continue
                if "deltaps_gpu_" in text:
                    scrapes[url] = text
            time.sleep(0.5)
        reader.join(timeout=5)
    return scrapes


def launch_job(name: str, flags: list[str], device: str, out: str, timeout_s: float) -> dict:
    summary_path = os.path.join(out, f"launch-{name}-{device}.json")
    argv = PY + ["deltaps", "launch", "--config", "configs/demo.yaml", "--device", device, "--no-progress",
                 "--json", summary_path, *flags] + (["--metrics"] if device == "cuda" else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    scrapes = scrape_while_running(proc, os.path.join(out, f"launch-{name}-{device}.log"), workers=2)
    timer.cancel()
    res = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    if proc.returncode == 0:
        s = json.load(open(summary_path))
        split = max(1e-12, s["compute_s"] + s["comm_s"] + s["wait_s"])
        res.update(final_test_accuracy=s["final_test_accuracy"], device=s["device"], steps=s["steps"],
                   median_step_ms=round(s["median_step_s"] * 1e3, 3),
                   split={k: round(s[f"{k}_s"] / split, 3) for k in ("compute", "comm", "wait")})
    if scrapes:
        with open(os.path.join(out, f"metrics-{name}.txt"), "w") as f:
            f.write("\n".join(scrapes.values()))
        res["gpu_metrics"] = sorted({line.split("{")[0] for text in scrapes.values() for line in text.splitlines()
                                     if line.startswith("deltaps_gpu_")})
    return res


def check_launches(results: dict, out: str, timeout_s: float, save) -> None:
    """Each job of JOBS on the GPU and on the CPU, into `results` (saved after each)."""
    for name, flags in JOBS.items():
        gpu, cpu = launch_job(name, flags, "cuda", out, timeout_s), launch_job(name, flags, "cpu", out, timeout_s)
        ok = gpu["rc"] == 0 and cpu["rc"] == 0 and gpu.get("device", "").startswith("cuda") and bool(gpu.get("gpu_metrics"))
        if ok:
            ok = abs(gpu["final_test_accuracy"] - cpu["final_test_accuracy"]) <= ACCURACY_BAND
        results[name] = {"ok": ok, "cuda": gpu, "cpu": cpu}
        save()


def cupy_version() -> str | None:
    try:
        import cupy
        return f"{cupy.__version__} (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})"
    except Exception:  # noqa: BLE001 - ImportError, or a CUDA install cupy cannot use
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltaps.tools.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check", help="folder for gpu-check.json, the logs and the scrapes")
    ap.add_argument("--size", default="256MiB", help="bench codecs buffer size")
    ap.add_argument("--step-timeout", type=float, default=150.0, help="seconds per step")
    ap.add_argument("--cupy-present", action="store_true", help="only say (exit status 0/1) whether cupy imports")
    args = ap.parse_args(argv)
    if args.cupy_present:
        return 0 if cupy_version() else 1
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA GPU; nothing to check here", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    report: dict = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
                    "python": sys.version.split()[0]}
    report["cupy"] = cupy_version() or "not importable"
    path = os.path.join(args.out, "gpu-check.json")

    def save():      # after every step: a run cut short still leaves what it found
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    codecs_json = os.path.join(args.out, "bench-codecs-cuda.json")
    report["pytest_gpu"] = run_step("pytest-gpu", PY + ["pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/unit"],
                                    args.out, args.step_timeout)
    save()
    report["bench_codecs"] = run_step("bench-codecs", PY + ["deltaps", "bench", "codecs", "--device", "cuda", "--size",
                                                             args.size, "--json", codecs_json], args.out, args.step_timeout)
    if os.path.exists(codecs_json):
        rows = json.load(open(codecs_json))["codecs"]
        report["bench_codecs"]["ratio_vs_device_copy"] = {k: round(v["ratio_vs_baseline"], 3) for k, v in rows.items()}
    save()
    report["launch"] = {}
    check_launches(report["launch"], args.out, args.step_timeout, save)
    compare_json = os.path.join(args.out, "bench-compare-nccl.json")
    report["nccl_ddp"] = run_step("bench-compare-nccl", PY + [
        "deltaps", "bench", "compare", "--no-shaping", "--device", "cuda", "--workers", str(gpus), "--servers", "2",
        "--workload", "clf", "--steps", "200", "--modes", "ddp,ps:int8", "--json", compare_json], args.out,
        args.step_timeout)
    if os.path.exists(compare_json):
        modes = json.load(open(compare_json))["modes"]
        report["nccl_ddp"]["modes"] = {k: {f: v.get(f) for f in ("device", "backend", "median_step_s", "final_test_accuracy",
                                                                  "error")} for k, v in modes.items()}
    verdicts = {"pytest_gpu": report["pytest_gpu"]["rc"] == 0, "bench_codecs": report["bench_codecs"]["rc"] == 0,
                **{f"launch_{k}": v["ok"] for k, v in report["launch"].items()},
                "nccl_ddp": report["nccl_ddp"]["rc"] == 0}
    report["verdicts"] = verdicts
    save()
    print(json.dumps({k: v for k, v in report.items() if k not in ("pytest_gpu", "bench_codecs", "nccl_ddp")}, indent=1))
    for step in ("pytest_gpu", "bench_codecs", "nccl_ddp"):
        print(f"--- {step}: rc {report[step]['rc']} in {report[step]['seconds']} s\n{report[step]['tail']}")
    print("gpu-check: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in verdicts.items()))
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
