"""Advice: every strategy's predicted step time and cost at each cluster size, and the recommendation
with its reasons (the product brief's decision table)."""
from __future__ import annotations

from deltaps.strategies import parse_mode_spec
from deltaps.tools import costmodel as cm
from deltaps.tools.advise.calibration import auto_chunk_bytes, calibration_for, job_for

COMM_SHARE_THRESHOLD = 0.30        # the product brief: communication > 30 % of the step -> act on it


def _acc_risk(prof: dict, strategy: str, max_drop: float) -> tuple[str, float | None]:
    name = str(parse_mode_spec(strategy))      # as merge_profiles names bench compare's modes
    if name in ("allreduce", "ps:none"):
        return "none (exact)", 0.0
    d = prof.get("accuracy_delta", {}).get(name)
    if d is None:
        return "unmeasured", None
    if d >= -max_drop:
        return f"low ({d * 100:+.2f} pp measured)", d
    return f"HIGH ({d * 100:+.2f} pp measured)", d


def _compressed(strategy: str) -> bool:
    """A PS strategy that synchronizes every step through a lossy codec (ps:int8, not ps:none or ps-local..)."""
    spec = parse_mode_spec(strategy)
    return spec.family == "ps" and spec.local_steps is None and spec.codec != "none"


def advise(prof: dict, gpus: list[int], bandwidth: str, strategies: list[str], steps: int, gpu_hour_usd: float,
           egress_usd_per_gb: float = 0.0, shards: int | None = None, max_acc_drop: float = 0.01,
           engineer_usd: float = 10000.0, chunk_bytes: int | None = None) -> dict:
    batch = prof["model"].get("batch_size", 32)
    cal = calibration_for(prof, bandwidth)
    rows = []
    for g in gpus:
        n = shards or max(1, g)
        G = prof["model"]["grad_bytes"]
        # PS key size: --chunk-bytes, else the best predicted of deltaps' default 4 MiB and smaller keys
        # that spread a big tensor over more shards (fewer hot links, more RPCs)
        chunks = [chunk_bytes] if chunk_bytes else sorted({4 << 20, 1 << 20, 256 << 10, auto_chunk_bytes(G, n)})
        job = job_for(prof, g, n, chunk_bytes=chunks[-1])
        preds = {}
        for s in strategies:
            try:
                if parse_mode_spec(s).family == "ps":
                    p = min((dict(cm.predict(cal, job_for(prof, g, n, chunk_bytes=c), s), chunk_bytes=c)
                             for c in chunks), key=lambda x: x["step_s"])
                else:
                    p = cm.predict(cal, job, s)
            except KeyError as e:
                preds[s] = {"strategy": s, "error": str(e)}
                continue
            egress = p["bytes_sent_per_worker"] * g * steps
            p.update(cm.training_cost(p["step_s"], steps, g, gpu_hour_usd, egress, egress_usd_per_gb))
            p["comm_share"] = p["comm_s"] / p["step_s"] if p["step_s"] else 0.0
            p["samples_per_s"] = g * batch / p["step_s"] if p["step_s"] else 0.0
            p["accuracy_risk"], p["accuracy_delta"] = _acc_risk(prof, s, max_acc_drop)
            preds[s] = p
        rec = recommend(preds, max_acc_drop, engineer_usd, bandwidth, g, prof)
        rows.append({"gpus": g, "shards": job.shards, "predictions": preds, **rec})
    return {"bandwidth": bandwidth, "steps": steps, "gpu_hour_usd": gpu_hour_usd,
            "egress_usd_per_gb": egress_usd_per_gb, "batch_size_per_gpu": batch, "model": prof["model"],
            "calibration": cal.to_dict(), "strategies": strategies, "rows": rows}


def recommend(preds: dict, max_acc_drop: float, engineer_usd: float, bandwidth: str, gpus: int,
              prof: dict) -> dict:
    ok = {s: p for s, p in preds.items() if "error" not in p}
    base = next((p for p in ok.values() if p["strategy"] == "allreduce"), None) or next(iter(ok.values()))
    safe = {s: p for s, p in ok.items() if p["accuracy_delta"] is None or p["accuracy_delta"] >= -max_acc_drop}
    best_s = min(safe, key=lambda s: safe[s]["step_s"])
    best = safe[best_s]
    fastest_s = min(ok, key=lambda s: ok[s]["step_s"])
    reasons = []
    share = base["comm_share"]
    params = prof["model"]["params"]
    reasons.append(f"at {gpus} GPUs on {bandwidth} links, {base['strategy']} spends {share:.0%} of its "
                   f"{base['step_s'] * 1e3:.1f} ms step communicating ({params / 1e6:.2f}M parameters)")
    saved = base["cost_usd"] - best["cost_usd"]
    speedup = base["step_s"] / best["step_s"] if best["step_s"] else 1.0
    spec = parse_mode_spec(best_s)
    local = spec.local_steps is not None
    compress = local or _compressed(best_s)
    if share <= COMM_SHARE_THRESHOLD and not (compress and speedup > 1.05):
        decision = "pure data parallel"
        reasons.append(f"communication is below the {COMM_SHARE_THRESHOLD:.0%} threshold: compression cannot win "
                       "much and its codec/RPC overhead costs more than the bytes it saves")
    elif local:
        decision = "local updates"
        reasons.append(f"{best_s} communicates once every {best['local_steps']} steps: its accuracy must be measured "
                       "against the synchronous baseline before switching (bench compare --target-accuracy)")
    elif compress:
        decision = "sparsification" if spec.codec.startswith(("topk", "randk", "dgc")) else "gradient quantization"
    else:
        decision = "pure data parallel"
    if compress and speedup > 1.05 and saved > engineer_usd:
        rec = best_s
        moved = best["bytes_sent_per_worker"] + best.get("bytes_pulled_per_worker", 0.0)
        ar_moved = 2 * base["bytes_sent_per_worker"] if base["strategy"] == "allreduce" else (
            base["bytes_sent_per_worker"] + base.get("bytes_pulled_per_worker", 0.0))
        reasons.append(f"{best_s} moves {moved / 2**20:.2f} MiB per worker per step (push + pull) instead of "
                       f"{ar_moved / 2**20:.2f} MiB and is predicted at {best['step_s'] * 1e3:.1f} ms/step "
                       f"(x{speedup:.2f} vs {base['strategy']}): {best['train_hours']:.1f} h instead of "
                       f"{base['train_hours']:.1f} h, saving ${saved:,.0f} minus ${engineer_usd:,.0f} of engineering "
                       f"= ${saved - engineer_usd:,.0f}; accuracy risk {best['accuracy_risk']}")
    elif compress and speedup > 1.05:
        rec = base["strategy"]
        decision = "pure data parallel"
        reasons.append(f"{best_s} would be x{speedup:.2f} faster but saves only ${saved:,.0f}, less than the "
                       f"${engineer_usd:,.0f} engineering cost of adopting it: keep {base['strategy']}")
    else:
        rec = base["strategy"] if best["step_s"] >= base["step_s"] * 0.95 else best_s
        over = [s for s in ok if _compressed(s)]
        if over:
            s2 = min(over, key=lambda s: ok[s]["step_s"])
            reasons.append(f"compression overhead exceeds its savings: the best codec ({s2}) is predicted at "
                           f"{ok[s2]['step_s'] * 1e3:.1f} ms/step vs {base['step_s'] * 1e3:.1f} ms for {base['strategy']} "
                           f"(codec + RPC CPU {ok[s2]['cpu_comm_s'] * 1e3:.1f} ms against "
                           f"{base['network_s'] * 1e3:.1f} ms of transfer) -> plain {rec}")
    if fastest_s != best_s:
        reasons.append(f"{fastest_s} would be fastest ({ok[fastest_s]['step_s'] * 1e3:.1f} ms) but its accuracy "
                       f"risk is {ok[fastest_s]['accuracy_risk']} (limit {max_acc_drop * 100:.1f} pp): not recommended")
    if best["comm_share"] > COMM_SHARE_THRESHOLD and (rec == best_s):
        reasons.append(f"communication still dominates even with {rec} ({best['comm_share']:.0%} of the step): the "
                       "next levers are hybrid (tensor/pipeline) parallelism or a larger batch per GPU")
        if rec == base["strategy"]:
            decision = "hybrid parallel"
    return {"recommendation": rec, "decision": decision, "reasons": reasons,
            "best_safe": best_s, "speedup_vs_allreduce": speedup, "saved_usd": saved}
