"""The advice as text (tables, the decision table, the recommendation's reasons) and as a plot."""
from __future__ import annotations

from deltaps.strategies import parse_mode_spec


def _fmt_usd(x: float) -> str:
    return f"${x:,.0f}"


def format_report(rep: dict) -> str:
    m = rep["model"]
    lines = [f"deltaps advise: {m['params']:,} params ({m['grad_bytes'] / 2**20:.1f} MiB fp32 gradient), batch "
             f"{rep['batch_size_per_gpu']}/GPU, {rep['bandwidth']} links (achieved "
             f"{rep['calibration']['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s), {rep['steps']:,} steps, "
             f"${rep['gpu_hour_usd']}/GPU-hour"
             + (f", egress ${rep['egress_usd_per_gb']}/GB" if rep['egress_usd_per_gb'] else "")]
    for row in rep["rows"]:
        lines.append("")
        lines.append(f"== {row['gpus']} GPUs (ps:*: {row['shards']} PS shards; key size = best predicted --chunk-bytes)")
        cols = ["strategy", "step", "comm share", "samples/s", "train time", "cost", "accuracy risk"]
        body = []
        for s, p in row["predictions"].items():
            if "error" in p:
                body.append([s, "n/a: " + p["error"][:50], "", "", "", "", ""])
                continue
            t = p["train_hours"]
            body.append([s + (f" (--chunk-bytes {p['chunk_bytes']})" if "chunk_bytes" in p else ""),
                         f"{p['step_s'] * 1e3:.1f} ms", f"{p['comm_share']:.0%}", f"{p['samples_per_s']:,.0f}",
                         f"{t / 24:.1f} d" if t >= 48 else f"{t:.1f} h", _fmt_usd(p["cost_usd"]), p["accuracy_risk"]])
        lines += markdown_table(cols, body)
        lines.append("")
        lines += _decision_table(row)
        lines.append(f"RECOMMENDATION: {row['recommendation']}   [decision table row: {row['decision']}]")
        for r in row["reasons"]:
            lines.append(f"  - {r}")
    return "\n".join(lines)


def _decision_table(row: dict) -> list[str]:
    """The product brief's decision table, filled in with this job's numbers."""
    P = row["predictions"]
    ar = P.get("allreduce", {})

    def cell(names):
        got = [(s, P[s]) for s in P if "error" not in P[s] and str(parse_mode_spec(s)).startswith(tuple(names))]
        if not got:
            return "not evaluated"
        s, p = min(got, key=lambda x: x[1]["step_s"])
        return (f"{s}: {p['step_s'] * 1e3:.1f} ms, comm {p['comm_share']:.0%}, {_fmt_usd(p['cost_usd'])}, "
                f"risk {p['accuracy_risk']}")
    share = ar.get("comm_share")
    rows = [["pure data parallel", "comm share <= 30 %", f"allreduce comm share {share:.0%}" if share is not None else "",
             cell(["allreduce", "ps:none"])],
            ["gradient quantization", "comm share > 30 %, accuracy-neutral", "",
             cell(["ps:int8", "ps:fp16", "ps:bf16", "ps:qsgd"])],
            ["sparsification", "comm share > 30 % after quantization; accuracy delta acceptable", "",
             cell(["ps:topk", "ps:randk", "ps:dgc", "ps:sign"])],
            ["hybrid parallel", "comm share still > 30 % with the best codec", "", "outside deltaps (tensor/pipeline parallel)"]]
    for r in rows:
        r[2] = "; ".join(x for x in ("<- chosen" if r[0] == row["decision"] else "", r[2]) if x)
    return markdown_table(["option", "when (brief)", "this job", "prediction"], rows)


def markdown_table(cols, rows) -> list[str]:
    """`cols` over `rows` as the lines of a pipe (Markdown) table, columns padded to their widest cell."""
    w = [max(len(str(r[i])) for r in [cols] + rows) for i in range(len(cols))]
    line = lambda r: "| " + " | ".join(str(c).ljust(x) for c, x in zip(r, w)) + " |"  # noqa: E731
    return [line(cols), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows]


def plot(rep: dict, path: str, more_gpus: list[int] | None = None, prof: dict | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = [r["gpus"] for r in rep["rows"]]
    for s in rep["strategies"]:
        ys = [(g, r["predictions"][s]["step_s"] * 1e3) for g, r in zip(gpus, rep["rows"])
              if "error" not in r["predictions"][s]]
        if ys:
            ax.plot([a for a, _ in ys], [b for _, b in ys], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (workers)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"deltaps advise: {rep['model']['params'] / 1e6:.2f}M params, {rep['bandwidth']} links", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
