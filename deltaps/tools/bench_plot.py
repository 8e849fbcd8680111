"""`deltaps bench compare --plot`: the report's PNG (step split, accuracy, time to target), from the report's dict."""
from __future__ import annotations

from deltaps.tools.bench_report import flagged, is_peer, measured, metric_of


def plot(report: dict, path: str) -> None:
    """Step split per mode, final accuracy per mode (red: flagged, bench_report.flagged) and, when there were
    evaluations, test accuracy against training seconds with the target line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [k for k, m in report["modes"].items() if measured(m)]
    ms = [report["modes"][k] for k in modes]
    curves = any(m.get("evals") for m in ms)
    ratios = [2, 1, 2] if curves else [2, 1]
    fig, axes = plt.subplots(1, len(ratios), figsize=(max(8, 2.2 * len(modes) + 4) + (6 if curves else 0), 4.5),
                             gridspec_kw={"width_ratios": ratios})
    ax1, ax2 = axes[0], axes[1]
    x = range(len(modes))
    bottom = [0.0] * len(modes)
    for key, label, color in (("compute_s_per_step", "compute", "#4c72b0"), ("comm_s_per_step", "comm", "#dd8452"),
                              ("wait_s_per_step", "wait", "#c44e52")):
        vals = [m[key] * 1e3 for m in ms]
        ax1.bar(x, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, m in enumerate(ms):
        sp = m.get("speedup_vs_allreduce")
        ax1.text(i, bottom[i], f"{bottom[i]:.0f} ms" + (f"\nx{sp:.2f}" if sp else ""), ha="center", va="bottom",
                 fontsize=8)
    ax1.set_ylim(0, max(bottom, default=0) * 1.15 or 1)    # headroom for the labels above the bars
    ax1.set_xticks(list(x), modes, rotation=15, fontsize=8)
    ax1.set_ylabel("mean step time (ms)")
    ax1.set_title(f"step split, {report['workers']} workers @ {report['bandwidth']}"
                  + ("" if report["shaped"] else " (loopback, NOT shaped)"), fontsize=9)
    ax1.legend(fontsize=8)
    auc = metric_of(report) == "test_auc"     # the click-through workload: AUC, not click accuracy
    accs = [m["final_test_auc" if auc else "final_test_accuracy"] * 100 for m in ms]
    ax2.bar(x, accs, color=["#d62728" if flagged(m) else "#55a868" for m in ms])
    for i, a in enumerate(accs):
        ax2.text(i, a, f"{a:.1f}", ha="center", va="bottom", fontsize=8)
    ax2.set_ylim(max(0, min(accs, default=0) - 10), 100)
    ax2.set_xticks(list(x), modes, rotation=15, fontsize=8)
    ax2.set_ylabel("final test AUC (x100)" if auc else "final test accuracy (%)")
    ax2.set_title(f"{'AUC' if auc else 'accuracy'}, {report['model_params'] / 1e6:.1f}M params"
                  + ("" if auc else " (red: >0.5 pp off ddp at the common step)"), fontsize=9)
    if curves:
        ax3, metric = axes[2], metric_of(report)
        for spec, m in zip(modes, ms):
            pts = m.get("evals") or []
            t = m.get("time_to_target_s")
            label = f"{spec}: " + (f"{t:.2f} s" if t is not None else "not reached") + (" !" if flagged(m) else "")
            ax3.plot([p["time_s"] for p in pts], [p[metric] * 100 for p in pts], marker=".", label=label,
                     linestyle="--" if is_peer(spec) else "-")
        if report.get("target"):
            ax3.axhline(report["target"] * 100, color="black", linewidth=0.8, linestyle=":", label="target")
        times = [p["time_s"] for m in ms for p in (m.get("evals") or []) if p["time_s"] > 0]
        if times and max(times) > 20 * min(times):   # modes 10-100x apart: a log axis keeps the fast ones readable
            ax3.set_xscale("log")
            ax3.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())   # labels on decades only
        ax3.set_xlabel("training time (s, evaluations excluded)")
        ax3.set_ylabel("test AUC (x100)" if metric == "test_auc" else "test accuracy (%)")
        ax3.set_title(f"time to target (best peer: {report.get('best_peer') or '—'})", fontsize=9)
        _rows_live(ax3, modes, ms)
        legend = ax3.legend(fontsize=7)
        for text, m in zip(legend.get_texts(), ms):
            if flagged(m):
                text.set_color("#d62728")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows_live(ax, modes: list[str], ms: list[dict]) -> None:
    """Hybrid's rows on the shards at each evaluation (table_rows_live), dotted on a right-hand axis."""
    if not any("table_rows_live" in p for m in ms for p in m.get("evals") or ()):
        return
    rows = ax.twinx()
    for spec, m in zip(modes, ms):
        pts = [p for p in m.get("evals") or () if "table_rows_live" in p]
        rows.plot([p["time_s"] for p in pts], [p["table_rows_live"] / 1e3 for p in pts], linestyle=":", label=spec)
    rows.set_ylabel("rows on the shards (thousands, dotted)")
