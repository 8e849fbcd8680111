"""A mode's figures in `deltaps bench compare`'s report, from its workers' result dicts: step-time split, bytes,
accuracy, time to target (bench_report.eval_fields) and, where the network was shaped, veth counters."""
from __future__ import annotations

from deltaps.tools import bench_protocol, bench_report
from deltaps.tools.launch import summarize
from worker.trainers.strategy import load_job
from worker.workloads import get_workload, workload_class


def mode_figures(cfg, results: list[dict], launch_wall_s: float, before: dict, after: dict, worker_nodes) -> dict:
    """cfg: the mode's TrainConfig; before / after: the worker nodes' veth counters ({} on loopback)."""
    W = len(results)
    s = summarize(cfg, results, launch_wall_s)
    steps = max(r["steps"] for r in results)     # steps run: fewer than --steps when the target stopped the mode
    shares = []
    for r in results:
        tot = max(1e-12, r["compute_s"] + r["comm_s"] + r["wait_s"])
        shares.append((r["compute_s"] / tot, r["comm_s"] / tot, r["wait_s"] / tot))
    out = {
        "mode": cfg.mode, "sync": cfg.sync, "codec": cfg.codec, "ddp_hook": cfg.ddp_hook, "steps": steps,
        "device": results[0].get("device", "cpu"), **({"backend": results[0]["backend"]} if "backend" in results[0] else {}),
        "median_step_s": s["median_step_s"], "mean_step_s": s["mean_step_s"], "wall_s": s["wall_s"],
        "samples_per_s": s["samples_per_s"],
        "compute_share": sum(x[0] for x in shares) / W, "comm_share": sum(x[1] for x in shares) / W,
        "wait_share": sum(x[2] for x in shares) / W,
        "compute_s_per_step": s["compute_s"] / steps, "comm_s_per_step": s["comm_s"] / steps,
        "wait_s_per_step": s["wait_s"] / steps,
        # application-level bytes one worker sends / receives per step (allreduce: 2(p-1)/p x gradient bytes)
        "bytes_per_step": s["bytes_pushed_wire"] / W / steps,
        "bytes_pulled_per_step": sum(r["loop_bytes_pulled_wire"] for r in results) / W / steps,
        "bytes_per_round_fraction": bench_protocol.bytes_per_round_fraction(results, s["model_params"]),
        "compression_ratio": s["compression_ratio"],
        "final_test_accuracy": s["final_test_accuracy"], "final_train_loss": s["final_train_loss"],
        "final_codec": s["final_codec"], "codec_fallbacks": s["codec_fallbacks"],
        "model_params": s["model_params"],
    }
    # the shards' Stats, read by rank 0 at the end of a PS job ([] for other modes)
    shards = next((r["server_stats"] for r in results if r.get("server_stats")), None) or []
    if cfg.workload == "ctr":   # click-through workload: AUC / log-loss on the held-out set, loss curve
        r0 = results[0]
        out.update({k: r0[k] for k in ("final_test_auc", "final_test_loss", "oracle_auc", "oracle_loss")})
        out["losses_rank0"] = r0["losses"]
        # memory: the table on the shards (hybrid) and the largest worker process (every mode)
        out["shard_table_bytes"] = sum(s.get("bytes", 0) for s in shards)
        out["shard_rows_held"] = sum(t.get("rows_held", 0) for s in shards for t in s.get("tables", {}).values())
        out["worker_peak_rss_bytes"] = max(r.get("peak_rss_bytes", 0) for r in results)
        for k in ("sparse_bytes_pushed", "sparse_bytes_pulled", "dense_ring_bytes", "rows_pushed"):
            if k in r0:
                out[k + "_per_step"] = sum(r[k] for r in results) / W / steps
    out.update(bench_report.eval_fields(results))
    # per worker, by rank: the steps it trained (a straggler's fewer under quorum rounds: the useful steps a goodput
    # figure is made of) and, local-update rounds, its mean inner steps per round (inner=adaptive: fewer when slow)
    trained = [r.get("steps_trained", r["steps"]) for r in results]    # a loop that skipped to the job's step
    out["steps_per_worker"] = trained
    out["compute_s_per_step_per_worker"] = [r["compute_s"] / max(1, n) for r, n in zip(results, trained)]
    if any(r.get("inner_steps_per_round") for r in results):
        out["inner_steps_per_round_per_worker"] = [r.get("inner_steps_per_round") for r in results]
    if s["payload_energy_share"] is not None:     # local-update rounds: how much of a delta a payload carries
        out["payload_energy_share"] = s["payload_energy_share"]
    if shards and cfg.local_steps:     # local-update rounds, from the shards' counters
        out["rounds"] = round_figures(shards)
    slow = [r for r in results if r.get("straggler_factor")]
    if slow:     # --straggler: the slow-down asked for and the one measured (compute + sleep) / compute
        out["straggler"] = {"rank": slow[0]["rank"], "factor": slow[0]["straggler_factor"],
                            "achieved_factor": slow[0]["straggler_achieved_factor"]}
    if before:
        tx = sum(after[i][0] - before[i][0] for i in worker_nodes) / W
        rx = sum(after[i][1] - before[i][1] for i in worker_nodes) / W
        # measured on each worker's veth for the whole run (setup, final pull and TCP/IP overhead included)
        out["veth_tx_bytes_per_step"] = tx / steps
        out["veth_rx_bytes_per_step"] = rx / steps
    if cfg.mode in ("allreduce", "hybrid", "torchrec") and cfg.workload == "ctr":
        out["timing_method"] = results[0].get("timing_method")
    elif cfg.mode == "allreduce":
        out["timing_method"] = results[0].get("timing_method")
        out["params_max_diff_across_ranks"] = max(r.get("params_max_diff_across_ranks", 0.0) for r in results)
    else:
        out["timing_method"] = ("PS DistributedOptimizer: blocked = time step() waits for pushes/pulls; "
                                "wait = server-side wait for other workers (BSP); comm = blocked - wait")
    return out


def round_figures(shards: list[dict]) -> dict:
    """A local-update job's rounds as the shards counted them, per key (each key closes its rounds on its own):
    rounds applied (the fewest of any key), late contributions per key, and the share of the key-rounds that closed
    with n contributions (index n) — a dead or late worker shows as rounds of fewer."""
    keys = max(1, sum(s["num_keys"] for s in shards))
    width = max((len(s["step_contributors"]) for s in shards), default=0)
    closed = [sum(s["step_contributors"][n] for s in shards if n < len(s["step_contributors"])) for n in range(width)]
    return {"applied": min(s["min_version"] for s in shards),
            "late_contributions_per_key": sum(s["late_contributions"] for s in shards) / keys,
            "contributors_share": [round(c / max(1, sum(closed)), 4) for c in closed]}


def model_params(base: dict) -> int:
    """The model's parameter count, from the workload's own model (a table-less one: cheap to build)."""
    workload = workload_class(base["workload"])
    if workload.has_embeddings:
        return 0       # the click-through report counts its table and dense part itself
    return sum(p.numel() for p in get_workload(load_job(None, base)).build_model().parameters())
