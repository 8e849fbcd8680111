"""Codec throughput benchmark: compress / decompress GB/s per codec against a numpy memcpy of the
same buffer, measured in the same run.

GB/s are raw tensor bytes / seconds. Decompress decodes into a preallocated tensor (decompress(
payload, out=...)), like the memcpy baseline copies into a preallocated buffer; decompress_alloc
is the same with a freshly allocated result, reported for reference.
"""
from __future__ import annotations

import argparse
import json
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
    host = x.cpu().numpy()
    dst = np.empty_like(host)
    memcpy_s = _median_time(lambda: np.copyto(dst, host), repeats)
    memcpy_gbps = raw / memcpy_s / 1e9
    rows = {}
    for spec in specs:
        codec = get_codec(spec)
        state = {}

        def comp():
            state["p"] = codec.compress(x, seed=1)
            _sync(device)
        c_s = _median_time(comp, repeats)
        p = state["p"]
        out = torch.empty(n)
        d_s = _median_time(lambda: codec.decompress(p, out=out) if codec.name != "none" else codec.decompress(p),
                           repeats)
        da_s = _median_time(lambda: codec.decompress(p), repeats)
        rt = raw / (c_s + d_s) / 1e9
        rows[spec] = {
            "compress_gbps": raw / c_s / 1e9, "decompress_gbps": raw / d_s / 1e9,
            "decompress_alloc_gbps": raw / da_s / 1e9, "roundtrip_gbps": rt,
            "ratio_vs_memcpy": rt / memcpy_gbps, "compression_ratio": raw / max(1, p.nbytes),
            "wire_bytes": p.nbytes,
        }
    return {"size_bytes": raw, "device": device, "repeats": repeats, "threads": torch.get_num_threads(),
            "memcpy_gbps": memcpy_gbps, "codecs": rows}


def format_table(result: dict) -> str:
    lines = [f"size={result['size_bytes'] / 2**20:.1f} MiB device={result['device']} "
             f"threads={result['threads']} memcpy={result['memcpy_gbps']:.2f} GB/s",
             f"{'codec':<20}{'comp GB/s':>10}{'decomp GB/s':>12}{'(alloc)':>9}{'rt GB/s':>9}"
             f"{'vs memcpy':>10}{'ratio':>9}"]
    for spec, r in result["codecs"].items():
        lines.append(f"{spec:<20}{r['compress_gbps']:>10.2f}{r['decompress_gbps']:>12.2f}"
                     f"{r['decompress_alloc_gbps']:>9.2f}{r['roundtrip_gbps']:>9.2f}"
                     f"{r['ratio_vs_memcpy']:>10.3f}{r['compression_ratio']:>9.1f}")
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
