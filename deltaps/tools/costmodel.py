"""Alpha-beta cost model of one training step: ring allreduce vs the deltaps parameter server.

Pure functions of a measured `Calibration` (deltaps/tools/advise measures one: `deltaps advise --calibrate`)
and a `Job` (model tensors, workers, shards, codecs). No constant here is tuned to a result; every
speed comes from the calibration.

Notation: G = gradient bytes per step (4 x parameters), W = workers, n = shards, B = achieved
bandwidth of one link, one direction (bytes/s), alpha = per-message latency (s).

Ring allreduce (DDP/gloo):
    bytes each worker sends (and receives) = 2(W-1)/W x G
    t_comm = 2(W-1)/W x G / B + 2(W-1) alpha + (W-1)/W x G / reduce_Bps          (reduce = the sums)
    t_step = t_fwd_bwd + t_opt + max(0, t_comm - overlap)
Parameter server (BSP, push chained to pull per key):
    Pw = G / r_push, Pl = G / r_pull                       (wire bytes one worker pushes / pulls)
    s_j = share of G on shard j (the real partition, deltaps/layout.py), k_j = its keys
    shard link = max_j W s_j (Pw + Pl + Pl + Pw / W) / 2 / B   the mean of two bounds: the W pulls leave
                 together (fan-in, then fan-out: in + out) or one after another (out + in / W)
    link time = max(shard link, (Pw + Pl) / B) + 2 alpha     (the worker's own link)
    R_j = PushPull RPCs a worker sends shard j per step (buckets x messages, fused_rpcs), R = sum R_j
    shard j CPU = W R_j rpc_s + W s_j (Pw + Pl) / grpc_Bps + W s_j G / dec_push
                  + s_j G / apply_Bps + s_j G / comp_pull + W s_j G path / 2
    worker CPU  = R rpc_s + (Pw + Pl) / grpc_Bps + G / comp_push + G / dec_pull + G path / 2
        (path = the codec's measured one-worker PushPull cycle beyond these terms, per raw byte)
    S = max_j shard j CPU;  t_comm = worker CPU + max(link, S) + min(link, S) / W
        (a shard's work on one worker's message hides behind the others' transfers, and vice versa)
    t_step = t_fwd_bwd + max(0, t_comm - overlap)
Overlap: gradients are handed to the network bucket by bucket as backward produces them (DDP buckets;
deltaps' --bucket-bytes, both 25 MiB by default), so up to the backward time after the first bucket is
ready can hide communication: overlap = t_bwd x (1 - g_last / G), g_last = the last bucket's bytes.

CPU contention (only when the processes share one host, `Job.host_cores`, e.g. the 2-core box the
validation runs on): a phase where m processes are busy on c cores runs max(1, m / c) times slower
than measured alone (compute is instead measured directly with W concurrent processes), and the step
can never be shorter than all processes' CPU work divided by the cores. Nor can communication be
faster than the same path measured on this host with unshaped links, W processes at once: gloo's
allreduce of the gradient (`allreduce_host_s`), or the PS step path of W workers against the job's
shards with the model's tensors (`ps_host_s`, per codec): t_comm = max(model terms, that time).

Costs: train time = steps x t_step; GPU-hours = gpus x train time / 3600; cost = GPU-hours x price
(+ egress bytes x price per GB when given).
"""
from __future__ import annotations

import dataclasses

from deltaps.layout import (
    build_layout,
    make_buckets,
    message_batches,
    shard_loads,
)
from deltaps.optimizer_config import overlap_steps
from deltaps.pull_codec import resolve_pull_codec
from deltaps.strategies import ModeSpec, parse_mode_spec
from deltaps.tools.cost_inputs import IDENTITY, PREDICTED, Calibration, CodecSpeed, Job, canonical


def pull_codec_for(push: str) -> str:
    """The pull codec `--pull-codec auto` puts in force for this push codec (deltaps.pull_codec's rule)."""
    return resolve_pull_codec("auto", canonical(push))


def buckets(tensors: list, bucket_bytes: int) -> list[list[str]]:
    """The runtime's buckets (deltaps.layout.make_buckets) for (name, numel) fp32 tensors."""
    return make_buckets([(name, 4 * numel) for name, numel in tensors], bucket_bytes)


def last_bucket_bytes(tensors: list, bucket_bytes: int) -> int:
    """Gradient bytes of the bucket backward completes last (sent after backward: nothing hides it)."""
    sizes = dict(tensors)
    bs = buckets(tensors, bucket_bytes)
    return 4 * sum(sizes[n] for n in bs[-1]) if bs else 0


def fused_rpcs(tensors: list, layout: list, shards: int, bucket_bytes: int, fused_bytes: int) -> list[int]:
    """PushPull RPCs one worker sends each shard per step: per bucket, the bucket's keys on that shard
    in messages of at most fused_bytes raw (a larger key alone), as worker/client.py batches them."""
    by_param: dict = {}
    for k in layout:
        by_param.setdefault(k.param, []).append(k)
    out = [0] * shards
    for b in buckets(tensors, bucket_bytes):
        per_shard: dict = {}
        for name in b:
            for k in by_param.get(name, []):
                per_shard.setdefault(k.shard, []).append(k)
        for j, keys in per_shard.items():
            out[j] += sum(1 for _ in message_batches(keys, fused_bytes))
    return out


def _stretch(busy: int, cores: int | None) -> float:
    return 1.0 if not cores else max(1.0, busy / cores)


# ---- the two formulas every test checks by hand -----------------------------------------------------------
def ring_allreduce_bytes(grad_bytes: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring allreduce: 2(p-1)/p x bytes."""
    return 0.0 if workers <= 1 else 2.0 * (workers - 1) / workers * grad_bytes


def ring_allreduce_time(grad_bytes: float, workers: int, bandwidth_Bps: float, alpha_s: float) -> float:
    """2(p-1)/p x bytes / B + 2(p-1) alpha."""
    if workers <= 1:
        return 0.0
    return ring_allreduce_bytes(grad_bytes, workers) / bandwidth_Bps + 2 * (workers - 1) * alpha_s


def ps_link_bytes(grad_bytes: float, workers: int, shard_share: float, push_ratio: float = 1.0,
                  pull_ratio: float = 1.0) -> dict:
    """Bytes per step on a shard's link (fan-in of W pushes, fan-out of W pulls) and a worker's link."""
    pw, pl = grad_bytes / push_ratio, grad_bytes / pull_ratio
    return {"shard_in": workers * shard_share * pw, "shard_out": workers * shard_share * pl,
            "worker_out": pw, "worker_in": pl}


def training_cost(step_s: float, steps: int, gpus: int, gpu_hour_usd: float, egress_bytes: float = 0.0,
                  egress_usd_per_gb: float = 0.0) -> dict:
    hours = step_s * steps / 3600.0
    gpu_hours = hours * gpus
    egress = egress_bytes / 1e9 * egress_usd_per_gb
    return {"train_hours": hours, "train_days": hours / 24, "gpu_hours": gpu_hours,
            "compute_usd": gpu_hours * gpu_hour_usd, "egress_usd": egress, "cost_usd": gpu_hours * gpu_hour_usd + egress}


# ---- predictions ------------------------------------------------------------------------------------------
def _network(cal: Calibration, job: Job, hot_link_bytes: float, total_link_bytes: float, flows: int) -> float:
    """Transfer time of one step: the busiest link at the achieved single-link rate; on a shared host
    also every link's bytes through the host's measured aggregate veth throughput."""
    t = hot_link_bytes / cal.bandwidth(1)
    if job.host_cores:
        t = max(t, total_link_bytes / cal.host_network(flows))
    return t


def predict_allreduce(cal: Calibration, job: Job) -> dict:
    W, G = job.workers, job.grad_bytes
    k = W if job.host_cores else 1
    fb = cal.compute(k)
    opt = cal.compute(k, cal.optimizer_s) if cal.optimizer_s else 0.0
    ring = ring_allreduce_bytes(G, W)
    net = _network(cal, job, ring, W * ring, W) + (2 * (W - 1) * cal.alpha_s if W > 1 else 0.0)
    if job.host_cores and cal.allreduce_host_s and W > 1:   # gloo's own CPU floor on this host, measured
        net = max(net, cal.compute(W, cal.allreduce_host_s) * G / (cal.host_probe_bytes or G))
    reduce = (W - 1) / W * G / cal.reduce_Bps * (cal.stretch(W) if job.host_cores else 1.0) if W > 1 else 0.0
    comm = net + reduce
    last_bucket = last_bucket_bytes(job.tensors, job.bucket_cap_bytes)    # the same buckets as predict_ps
    overlap = fb * cal.bwd_fraction * (1 - last_bucket / G) if G else 0.0
    exposed = max(0.0, comm - overlap)
    step = fb + opt + exposed
    return {"strategy": "allreduce", "step_s": step, "compute_s": fb + opt, "comm_s": step - fb - opt,
            "network_s": net, "cpu_comm_s": reduce, "overlap_s": min(overlap, comm),
            "bytes_sent_per_worker": ring, "bytes_hot_link": ring}


def predict_ps(cal: Calibration, job: Job, codec: str, pull_codec: str | None = None) -> dict:
    W, n, G = job.workers, job.shards, job.grad_bytes
    push = cal.codec(codec)
    pull = cal.codec(pull_codec or pull_codec_for(codec))
    layout = build_layout([(name, numel, "float32") for name, numel in job.tensors], n, job.chunk_bytes)
    loads = shard_loads(layout, n)
    K = len(layout)
    share = [ld / G for ld in loads]
    pw, pl = G / push.ratio, G / pull.ratio
    hot = max(max(W * s * pw, W * s * pl) for s in share)
    # per key, the pull follows the push (BSP): a shard's fan-in, then its fan-out. If the W pulls leave
    # together (fair sharing), nothing overlaps: in + out. If they leave one after another, the first
    # workers' next pushes overlap the rest: out + in / W. The model takes the mean of the two bounds.
    shard_link = max(W * s * (pw + pl + (pl + pw / W)) / 2 for s in share)
    link = _network(cal, job, max(shard_link, pw + pl), W * (pw + pl), W) + 2 * cal.alpha_s
    rpcs, worker_cpu, shard_cpu = _ps_cpu(cal, job, push, pull, layout, share)
    ws = cal.stretch(W) if job.host_cores else 1.0
    ss = cal.stretch(n) if job.host_cores else 1.0
    scpu = max(shard_cpu) * ss
    # a shard handles W messages: all but one worker's share of its CPU hides behind the others'
    # transfers when the link is the bottleneck (and vice versa)
    shard_phase = max(link, scpu) + min(link, scpu) / W
    comm = worker_cpu * ws + shard_phase
    spec = canonical(codec)
    if job.host_cores and W > 1 and spec in cal.ps_host_s and n == cal.ps_host_shards:   # measured host floor
        # measured on unshaped links; a shaped link adds the pull's transfer, which under BSP starts only
        # once the step's last push is applied and so overlaps none of that CPU path
        pull_link = _network(cal, job, max(max(W * s * pl for s in share), pl), W * pl, W)
        comm = max(comm, cal.compute(W, cal.ps_host_s[spec]) * G / (cal.host_probe_bytes or G) + pull_link)
    k = W if job.host_cores else 1
    fb = cal.compute(k)
    g_last = last_bucket_bytes(job.tensors, job.bucket_cap_bytes)
    overlap = fb * cal.bwd_fraction * (1 - g_last / G) if G else 0.0
    exposed = max(0.0, comm - overlap)
    step = fb + exposed
    if job.host_cores:   # all processes' CPU work through the cores they actually get
        cpu = W * (cal.compute(1) + worker_cpu) + sum(shard_cpu)
        step = max(step, cpu / cal.effective_cores())
    return {"strategy": f"ps:{canonical(codec)}", "codec": canonical(codec),
            "pull_codec": pull_codec or pull_codec_for(codec), "step_s": step, "compute_s": fb,
            "comm_s": step - fb, "network_s": link, "cpu_comm_s": worker_cpu * ws + scpu,
            "overlap_s": min(overlap, comm), "bytes_sent_per_worker": pw, "bytes_pulled_per_worker": pl,
            "bytes_hot_link": hot, "shard_shares": share, "keys": K, "rpcs_per_worker": sum(rpcs),
            "push_ratio": push.ratio, "pull_ratio": pull.ratio}


def _ps_cpu(cal: Calibration, job: Job, push: CodecSpeed, pull: CodecSpeed, layout: list, share: list):
    """(PushPull RPCs per shard, one worker's CPU per step, each shard's CPU per step), uncontended.
    gRPC costs are measured client + server together: half on each side. One PushPull RPC per bucket,
    shard and message (fused_rpcs), as worker/optimizer.py sends them."""
    W, n, G = job.workers, job.shards, job.grad_bytes
    pw, pl = G / push.ratio, G / pull.ratio
    rpcs = fused_rpcs(job.tensors, layout, n, job.bucket_cap_bytes, job.fused_bytes)
    rpc, per_byte = cal.rpc_s / 2, 0.5 / cal.grpc_Bps
    shard_cpu = [W * rj * rpc + W * s * (pw + pl) * per_byte + W * s * G / push.decompress_Bps
                 + s * G / cal.apply_Bps + s * G / pull.compress_Bps + W * s * G * push.path_s_per_byte / 2
                 for s, rj in zip(share, rpcs)]
    worker_cpu = (sum(rpcs) * rpc + (pw + pl) * per_byte + G / push.compress_Bps + G / pull.decompress_Bps
                  + G * push.path_s_per_byte / 2)
    return rpcs, worker_cpu, shard_cpu


def predict_local(cal: Calibration, job: Job, codec: str, local_steps: int, fragments: int = 1,
                  overlap: int | None = None) -> dict:
    """A local-update job (--local-steps H, --stream-fragments F, --overlap-steps tau): H inner steps
    (forward, backward, the local optimizer) per PS round; the round moves the parameter delta as ps:<codec>
    moves a gradient, as F fragment exchanges (1/F of the round each), each hidden behind the tau inner
    steps it overlaps (tau defaults to 1 with fragments and H >= 2F, else 0: nothing hides the round)."""
    if local_steps < 1 or fragments < 1:
        raise ValueError(f"local steps and fragments must be >= 1, got {local_steps} and {fragments}")
    tau = overlap_steps(local_steps, fragments, overlap)
    p = predict_ps(cal, job, codec)
    k = job.workers if job.host_cores else 1
    inner = cal.compute(k) + (cal.compute(k, cal.optimizer_s) if cal.optimizer_s else 0.0)
    round_comm = p["comm_s"] + p["overlap_s"]
    exposed = fragments * max(0.0, round_comm / fragments - tau * inner) / local_steps
    step = inner + exposed
    H = local_steps
    name = ModeSpec("ps", codec=canonical(codec), local_steps=H, stream_fragments=fragments,
                    overlap_steps=None if overlap is None else tau)
    return {**p, "strategy": str(name),
            "step_s": step, "compute_s": inner, "comm_s": exposed, "network_s": p["network_s"] / H,
            "cpu_comm_s": p["cpu_comm_s"] / H, "overlap_s": round_comm / H - exposed,
            "bytes_sent_per_worker": p["bytes_sent_per_worker"] / H,
            "bytes_pulled_per_worker": p["bytes_pulled_per_worker"] / H, "bytes_hot_link": p["bytes_hot_link"] / H,
            "rpcs_per_worker": p["rpcs_per_worker"] / H, "local_steps": H, "stream_fragments": fragments,
            "overlap_steps": tau}


def predict(cal: Calibration, job: Job, strategy: str) -> dict:
    """strategy: a mode spec (deltaps/strategies.py) this model predicts: 'allreduce' (fp32 DDP), 'ps:<codec spec>'
    (ps:none, ps:int8, ps:topk:ratio=0.01, ...) or a local-update job 'ps-local<H>[x<F>][o<tau>]:<codec spec>'
    (ps-local8:int8: --local-steps 8; ps-local32x4:none: 4 fragments; ps-local32x4o4:int8: each fragment's
    exchange overlapping 4 inner steps). Not DDP hooks, ddp:sparse, ps-asp or hybrid."""
    spec = parse_mode_spec(strategy)
    job = dataclasses.replace(job, shards=spec.shards or job.shards)    # a spec's shards=N is this mode's own
    if spec.family == "ddp" and spec.ddp_hook is None and not spec.sparse_embeddings:
        return predict_allreduce(cal, job)
    if spec.family == "ps" and spec.sync == "bsp":
        out = predict_ps(cal, job, spec.codec) if spec.local_steps is None else \
            predict_local(cal, job, spec.codec, spec.local_steps, spec.stream_fragments, spec.overlap_steps)
        return {**out, "strategy": out["strategy"] + f":shards={spec.shards}"} if spec.shards else out
    raise ValueError(f"strategy {strategy!r}: the cost model predicts {PREDICTED}")


def mlp_tensors(hidden: int, layers: int, in_features: int = 64, classes: int = 10) -> list:
    """(name, numel) of worker.workloads.mlp.make_mlp's parameters, in model order (as named by nn.Sequential)."""
    out, width, idx = [], in_features, 0
    for _ in range(layers):
        out += [(f"{idx}.weight", width * hidden), (f"{idx}.bias", hidden)]
        width, idx = hidden, idx + 2
    out += [(f"{idx}.weight", width * classes), (f"{idx}.bias", classes)]
    return out


__all__ = ["Calibration", "CodecSpeed", "IDENTITY", "Job", "PREDICTED", "canonical", "predict", "predict_allreduce", "predict_ps",
           "predict_local", "ring_allreduce_bytes", "ring_allreduce_time", "ps_link_bytes", "training_cost", "mlp_tensors",
           "pull_codec_for"]
