"""Trainers for the click-through workload (worker/ctr.py) in the three modes `deltaps bench compare` runs:

* `allreduce`: the whole model, dense rows x dim table included, is a DDP module (gloo): every step
  allreduces the table's full dense gradient; the table's optimizer runs locally on every rank
  (torch.optim.SGD / Adagrad / Adam on the dense table).
* `ps`: the whole model is on the parameter servers with dense pushes (DistributedOptimizer): every
  step pushes the table's dense gradient and pulls it back; one server optimizer (--optimizer) for all.
* `hybrid`: modules selected by --ps-params (every nn.Embedding by default) live on the PS, row-sparse
  (worker/embedding.py, ps/embedding.py): a step pulls the unique rows of its batch, pushes their
  gradients; the rest of the model (the MLP) is a DDP module over gloo, allreduced in the same step.

With --embedding-optimizer sgd or adagrad, `allreduce` and `hybrid` compute the same updates: a dense
Adagrad/SGD step leaves rows with zero gradient unchanged, which is what the row-wise PS optimizer does
by not touching them (tested in tests/test_embedding.py); only float summation order differs.
"""
from __future__ import annotations

import datetime
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from deltaps.config import TrainConfig
from worker.workloads.ctr import CTRData, CTRModel, evaluate, table_spec

log = logging.getLogger("deltaps.hybrid")


def _dense_table_optimizer(cfg: TrainConfig, params):
    if cfg.embedding_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.embedding_lr, eps=1e-10)
    if cfg.embedding_optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.embedding_lr)
    return torch.optim.SGD(params, lr=cfg.embedding_lr)


def _model(cfg: TrainConfig, materialize: bool) -> CTRModel:
    return CTRModel(cfg.embedding_rows, cfg.embedding_dim, cfg.embedding_fields, cfg.hidden, cfg.layers, cfg.seed,
                    materialize_table=materialize, table_spec=table_spec(cfg))


def _logical_params(cfg: TrainConfig, model) -> int:
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("emb"))
    return dense + cfg.embedding_rows * cfg.embedding_dim


def _init_pg(cfg, rank, world_size, master_addr, master_port):
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s * 4))


def _result(cfg, rank, step_s, blocked, wait, losses, wall, ev, params, sent, pulled, extra) -> dict:
    total = sum(step_s)
    return {
        "rank": rank, "steps": cfg.steps, "wall_s": wall, "mean_step_s": total / max(1, len(step_s)),
        "median_step_s": sorted(step_s)[len(step_s) // 2] if step_s else 0.0,
        "compute_s": total - blocked, "comm_s": blocked - wait, "wait_s": wait,
        "bytes_pushed_wire": int(sent), "bytes_pushed_raw": int(sent), "bytes_pulled_wire": int(pulled),
        "push_rpcs": 0, "pull_rpcs": 0, "push_pull_rpcs": 0,
        "final_test_accuracy": ev["test_accuracy"], "final_test_auc": ev["test_auc"], "final_test_loss": ev["test_loss"],
        "oracle_auc": ev["oracle_auc"], "oracle_loss": ev["oracle_loss"],
        "final_train_loss": sum(losses[-5:]) / max(1, len(losses[-5:])),
        "samples_per_s": cfg.steps * cfg.batch_size / wall if wall > 0 else 0.0,
        "model_params": params, "losses": losses, "workload": "ctr",
        "codec": cfg.codec, "final_codec": cfg.codec, "codec_switches": [], "codec_fallbacks": [],
        "bytes_pushed_wire_steps": [], **extra,
    }


def _loop(cfg, rank, body, desc):
    data = CTRData(cfg.embedding_rows, cfg.embedding_fields, cfg.zipf_a, cfg.seed)
    step_s, losses = [], []
    bar = tqdm(range(cfg.steps), desc=desc, disable=not cfg.progress, unit="step", dynamic_ncols=True, mininterval=0.5)
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        ids, dense, y = data.batch(rank, step, cfg.batch_size)
        losses.append(body(step, ids, dense, y))
        step_s.append(time.perf_counter() - t0)
        if cfg.log_every and step % cfg.log_every == 0:
            log.info("worker %d step %d loss %.4f", rank, step, losses[-1])
    bar.close()
    return data, step_s, losses, time.perf_counter() - t_start


# ---- allreduce: everything through DDP -----------------------------------------------------------------
def train_ctr_allreduce(cfg: TrainConfig, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                        master_port: int = 29500, bucket_cap_mb: float = 25.0) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.trainers.allreduce import _HookState, _timed_allreduce_hook, ring_bytes
    from worker.trainers.ps import local_optimizer

    torch.set_num_threads(1)
    _init_pg(cfg, rank, world_size, master_addr, master_port)
    try:
        model = _model(cfg, True)
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        state = _HookState(world_size)
        ddp.register_comm_hook(state, _timed_allreduce_hook)
        opt_d = local_optimizer(cfg, model.mlp.parameters())
        opt_e = _dense_table_optimizer(cfg, [model.emb.weight])
        timing = {"blocked": 0.0, "bytes": 0}

        def body(step, ids, dense, y):
            state.last_ready, state.bucket_bytes = 0.0, 0
            loss = F.binary_cross_entropy_with_logits(ddp(ids, dense), y)
            opt_d.zero_grad(set_to_none=False)
            opt_e.zero_grad(set_to_none=False)
            t = time.perf_counter()
            loss.backward()
            end = time.time()
            timing["blocked"] += max(0.0, min(end - (state.last_ready or end), time.perf_counter() - t))
            timing["bytes"] += ring_bytes(state.bucket_bytes, world_size)
            opt_d.step()
            opt_e.step()
            return loss.item()
        dist.barrier()
        data, step_s, losses, wall = _loop(cfg, rank, body, f"worker {rank} (allreduce, ctr)")
        ev = evaluate(model, data)
        res = _result(cfg, rank, step_s, timing["blocked"], 0.0, losses, wall, ev, _logical_params(cfg, model),
                      timing["bytes"], timing["bytes"],
                      {"timing_method": "ddp-comm-hook: comm = backward return - last bucket ready (wait not split)"})
        dist.barrier()
        return res
    finally:
        dist.destroy_process_group()


# ---- ps: everything on the parameter servers, dense pushes ---------------------------------------------
def train_ctr_ps(cfg: TrainConfig, servers: list[str], rank: int, world_size: int, security=None) -> dict:
    from worker.optimizer import DistributedOptimizer
    from worker.trainers.ps import local_optimizer, make_compressor

    torch.set_num_threads(1)
    model = _model(cfg, True)
    opt = DistributedOptimizer(local_optimizer(cfg, model.parameters()), model, servers=servers, rank=rank,
                               world_size=world_size, sync=cfg.sync, codec=cfg.codec, pull_codec=cfg.pull_codec,
                               compressor=make_compressor(cfg), chunk_bytes=cfg.chunk_bytes,
                               max_message_bytes=cfg.max_message_bytes, bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s, security=security,
                               reconnect_deadline_s=cfg.reconnect_deadline_s, replay_steps=cfg.replay_steps)

    def body(step, ids, dense, y):
        loss = F.binary_cross_entropy_with_logits(model(ids, dense), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    data, step_s, losses, wall = _loop(cfg, rank, body, f"worker {rank} (ps, ctr)")
    opt.client.barrier("train-done")
    final = opt.client.pull(min_version=0)
    with torch.no_grad():
        for n, p in opt.named:
            p.copy_(final[n].view_as(p))
    ev = evaluate(model, data)
    comm = opt.client.stats.snapshot()
    res = _result(cfg, rank, step_s, opt.timing["blocked_s"], opt.timing["wait_s"], losses, wall, ev,
                  _logical_params(cfg, model), comm.get("bytes_pushed_wire", 0), comm.get("bytes_pulled_wire", 0),
                  {"optimizer_note": f"server {cfg.optimizer} on every parameter, table included"})
    if rank == 0:
        res["server_stats"] = opt.client.server_stats()
    opt.client.barrier("exit")
    opt.close()
    return res


# ---- hybrid: embeddings row-sparse on the PS, the rest by allreduce -------------------------------------
def train_hybrid(cfg: TrainConfig, servers: list[str], rank: int, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int = 29500, bucket_cap_mb: float = 25.0, security=None) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.embedding import EmbeddingClient, replace_embeddings, select_ps_modules
    from worker.trainers.allreduce import _HookState, _timed_allreduce_hook, ring_bytes
    from worker.trainers.ps import local_optimizer

    torch.set_num_threads(1)
    if cfg.sync not in ("bsp", "asp"):
        raise ValueError(f"hybrid mode supports --sync bsp or asp, not {cfg.sync}")
    _init_pg(cfg, rank, world_size, master_addr, master_port)
    client = None
    try:
        model = _model(cfg, False)
        names = select_ps_modules(model, cfg.ps_params)
        spec = table_spec(cfg)
        from dataclasses import replace
        client = EmbeddingClient(servers, rank, world_size, [replace(spec, name=n) for n in names], sync=cfg.sync,
                                 timeout_s=cfg.timeout_s, max_message_bytes=cfg.max_message_bytes,
                                 chunk_bytes=cfg.chunk_bytes, security=security)
        client.register()
        embs = replace_embeddings(model, names, client)
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        state = _HookState(world_size)
        ddp.register_comm_hook(state, _timed_allreduce_hook)
        opt = local_optimizer(cfg, ddp.parameters())
        timing = {"blocked": 0.0, "wait": 0.0, "ring": 0}
        min_v = (lambda step: step) if cfg.sync == "bsp" else (lambda step: 0)

        def body(step, ids, dense, y):
            t = time.perf_counter()
            waited0 = sum(e.waited_s for e in embs.values())
            for e in embs.values():
                e.prefetch(ids, min_v(step))             # BSP gate: rows at version `step`
            timing["wait"] += sum(e.waited_s for e in embs.values()) - waited0
            timing["blocked"] += time.perf_counter() - t
            state.last_ready, state.bucket_bytes = 0.0, 0
            loss = F.binary_cross_entropy_with_logits(ddp(ids, dense), y)
            opt.zero_grad(set_to_none=False)
            t = time.perf_counter()
            loss.backward()                              # the MLP's gradients are allreduced in here
            end = time.time()
            timing["blocked"] += max(0.0, min(end - (state.last_ready or end), time.perf_counter() - t))
            timing["ring"] += ring_bytes(state.bucket_bytes, world_size)
            grads = {}
            for e in embs.values():
                grads.update(e.row_grads())
            futs = client.push_rows_async(step, grads)   # row gradients, while the MLP steps locally
            opt.step()
            t = time.perf_counter()
            for f in futs:
                f.result()
            timing["blocked"] += time.perf_counter() - t
            return loss.item()
        dist.barrier()
        data, step_s, losses, wall = _loop(cfg, rank, body, f"worker {rank} (hybrid, ctr)")
        for e in embs.values():
            e.min_version = min_v(cfg.steps)             # evaluate the table after the last step
        ev = evaluate(model, data)
        c = client.stats.snapshot()
        sparse_sent, sparse_pulled = c.get("bytes_pushed_wire", 0), c.get("bytes_pulled_wire", 0)
        res = _result(cfg, rank, step_s, timing["blocked"], timing["wait"], losses, wall, ev,
                      _logical_params(cfg, model), sparse_sent + timing["ring"], sparse_pulled + timing["ring"],
                      {"ps_modules": names, "sparse_bytes_pushed": int(sparse_sent),
                       "sparse_bytes_pulled": int(sparse_pulled), "dense_ring_bytes": int(timing["ring"]),
                       "rows_pushed": int(c.get("rows_pushed", 0)),
                       "timing_method": "hybrid: blocked = sparse pull + exposed dense allreduce + push wait; "
                                        "wait = server-side BSP wait of the pulls; comm = blocked - wait"})
        return with_server_stats(res, client, rank)
    finally:
        if client is not None:
            client.close()
        dist.destroy_process_group()


def with_server_stats(res: dict, client, rank: int) -> dict:
    """Once every rank is done with the shards, rank 0 adds their counters; nobody closes before that."""
    dist.barrier()
    if rank == 0:
        res["server_stats"] = client.server_stats()
    dist.barrier()
    return res


def run_worker(cfg: TrainConfig, args, security=None) -> dict:
    """`deltaps worker` entry for --workload ctr (any mode) and --mode hybrid."""
    from worker.trainers.allreduce import env_rendezvous
    if cfg.mode in ("allreduce", "hybrid"):
        rank, world, addr, port = env_rendezvous(args.rank, args.world_size, args.master_addr, args.master_port)
        args.rank = rank
        if cfg.mode == "allreduce":
            return train_ctr_allreduce(cfg, rank, world, addr, port, bucket_cap_mb=args.bucket_cap_mb)
        if not args.servers:
            raise ValueError("mode hybrid needs --servers (the embedding shards) and --master-addr/--master-port")
        return train_hybrid(cfg, args.servers, rank, world, addr, port, bucket_cap_mb=args.bucket_cap_mb,
                            security=security)
    if not args.servers or args.rank is None or args.world_size is None:
        raise ValueError("mode ps needs --servers, --rank and --world-size")
    return train_ctr_ps(cfg, args.servers, args.rank, args.world_size, security=security)
