"""Codec throughput benchmark: compress / decompress GB/s per codec against a plain copy of the same
buffer, measured in the same run: a numpy memcpy on the CPU, a device-to-device copy with --device cuda.

GB/s are raw tensor bytes / seconds. Decompress decodes into a preallocated tensor (decompress(
payload, out=...)), like the baseline copies into a preallocated buffer; decompress_alloc is the same
with a freshly allocated result, reported for reference. On a GPU a round trip is what a GPU worker
does: compress on the device (CuPy kernels) into a host payload, then decode that payload back into a
device tensor (the body crosses to the GPU and decodes there where the codec can).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time

import numpy as np
import torch

from compression.base import available_codecs, get_codec
from deltaps.units import argparse_type, parse_bytes

DEFAULT_SPECS = ["none", "fp16", "bf16", "int8", "qsgd:levels=16", "sign", "topk:ratio=0.01",
                 "randk:ratio=0.01", "dgc:ratio=0.001"]


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def run_codec_bench(size_bytes: int, specs: list[str] | None = None, device: str = "cpu",
                    repeats: int = 5) -> dict:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = specs or DEFAULT_SPECS
    n = max(1, size_bytes // 4)
    raw = n * 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(device)
    baseline_gbps = raw / _median_time(_copy_baseline(x), repeats) / 1e9
    rows = {}
    for spec in specs:
        codec = get_codec(spec)
        src = square_view(x) if codec.matrix_keys else x     # a matrix codec's cost is a matrix's (lowrank)
        raw = src.numel() * 4
        state = {}

        def comp():
            state["p"] = codec.compress(src, seed=1)
            _sync(device)
        c_s = _median_time(comp, repeats)
        p = state["p"]
        d_s = _median_time(_decoder(codec, p, torch.empty(src.shape, device=device)), repeats)
        da_s = _median_time(_decoder(codec, p, None, device), repeats)
        rt = raw / (c_s + d_s) / 1e9
        rows[spec] = {
            "compress_gbps": raw / c_s / 1e9, "decompress_gbps": raw / d_s / 1e9,
            "decompress_alloc_gbps": raw / da_s / 1e9, "roundtrip_gbps": rt,
            "ratio_vs_baseline": rt / baseline_gbps, "compression_ratio": raw / max(1, p.nbytes),
            "wire_bytes": p.nbytes, "shape": list(src.shape),
        }
    return {"size_bytes": n * 4, "device": device, "repeats": repeats, "threads": torch.get_num_threads(),
            "baseline": BASELINES[device], "baseline_gbps": baseline_gbps, "codecs": rows}


BASELINES = {"cpu": "numpy memcpy", "cuda": "device-to-device copy"}


def square_view(x: torch.Tensor) -> torch.Tensor:
    """The squarest matrix view of the first r x c elements of a flat buffer, r = c = isqrt(n): what a matrix codec
    (matrix_keys) is measured on — its ratio depends on the shape, (r + c) x rank values for r x c."""
    side = max(1, math.isqrt(x.numel()))
    return x[:side * side].view(side, side)


def _copy_baseline(x: torch.Tensor):
    """The copy every codec is measured against: numpy's memcpy of the host buffer, or a GPU's own copy."""
    if x.device.type == "cuda":
        dst = torch.empty_like(x)
        return lambda: (dst.copy_(x), torch.cuda.synchronize())
    host = x.numpy()
    dst = np.empty_like(host)
    return lambda: np.copyto(dst, host)


def _decoder(codec, payload, out: torch.Tensor | None, device: str = "cpu"):
    """Decode `payload` into `out` (preallocated; None: a fresh tensor on `device`), synchronised."""
    def decode():
        if out is None:
            codec.decompress_on(payload, torch.device(device))
        elif codec.name == "none":      # raw bytes: a zero-copy view on the CPU, one copy onto a GPU
            out.copy_(codec.decompress(payload).view(-1))
        elif out.device.type == "cpu" or codec.decodes_on_device:
            codec.decompress(payload, out=out)
        else:
            out.copy_(codec.decompress(payload).view(-1))
        _sync(device)
    return decode


def format_table(result: dict) -> str:
    lines = [f"size={result['size_bytes'] / 2**20:.1f} MiB device={result['device']} "
             f"threads={result['threads']} {result['baseline']}={result['baseline_gbps']:.2f} GB/s",
             f"{'codec':<20}{'comp GB/s':>10}{'decomp GB/s':>12}{'(alloc)':>9}{'rt GB/s':>9}"
             f"{'vs copy':>10}{'ratio':>9}"]
    for spec, r in result["codecs"].items():
        lines.append(f"{spec:<20}{r['compress_gbps']:>10.2f}{r['decompress_gbps']:>12.2f}"
                     f"{r['decompress_alloc_gbps']:>9.2f}{r['roundtrip_gbps']:>9.2f}"
                     f"{r['ratio_vs_baseline']:>10.3f}{r['compression_ratio']:>9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="deltaps bench codecs", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=argparse_type(parse_bytes, "byte size"), default=64 << 20)
    ap.add_argument("--codecs", default=",".join(DEFAULT_SPECS),
                    help=f"';'- or ','-separated specs (available: {', '.join(available_codecs())})")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    result = run_codec_bench(args.size, _split_specs(args.codecs), args.device, args.repeats)
    print(format_table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _split_specs(text: str) -> list[str]:
    """'int8,topk:ratio=0.01,qsgd:levels=4,chunk=512' -> specs; a ',' followed by key=value belongs
    to the previous spec; ';' always separates."""
    specs: list[str] = []
    for part in re.split(r"[;,]", text):
        part = part.strip()
        if not part:
            continue
        if "=" in part and ":" not in part and specs:
            specs[-1] += "," + part if ":" in specs[-1] else ":" + part
        else:
            specs.append(part)
    return specs


if __name__ == "__main__":
    raise SystemExit(main())
