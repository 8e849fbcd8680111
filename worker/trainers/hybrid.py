"""Trainers for the click-through workload (worker/workloads/ctr.py) in the three modes `deltaps bench compare` runs:

* `allreduce`: the whole model, dense rows x dim table included, is a DDP module (gloo): every step
  allreduces the table's full dense gradient; the table's optimizer runs locally on every rank
  (torch.optim.SGD / Adagrad / Adam on the dense table).
* `allreduce` with --sparse-embeddings (bench compare's `ddp:sparse`, what a DDP user runs): the table is
  nn.Embedding(sparse=True); DDP reduces its sparse COO gradient in a bucket of its own (gloo's sparse
  allreduce: an allgather of every rank's coalesced row indices and values, summed locally; our hook divides
  by the world size first, so the mean as for the dense table), the MLP's as usual; the table's optimizer is a
  sparse one: SGD, Adagrad, or SparseAdam for adam (lazy, as the PS's row-wise adam).
* `ps`: the whole model is on the parameter servers with dense pushes (DistributedOptimizer): every
  step pushes the table's dense gradient and pulls it back; one server optimizer (--optimizer) for all.
* `hybrid`: modules selected by --ps-params (every nn.Embedding by default) live on the PS, row-sparse
  (worker/embedding.py, ps/embedding/): a step pulls the unique rows of its batch, pushes their
  gradients; the rest of the model (the MLP) is a DDP module over gloo, allreduced in the same step.

With --embedding-optimizer sgd or adagrad, `allreduce` and `hybrid` compute the same updates: a dense
Adagrad/SGD step leaves rows with zero gradient unchanged, which is what the row-wise PS optimizer does
by not touching them (tested in tests/rpc/test_embedding.py); only float summation order differs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deltaps.config import TrainConfig
from worker.trainers.base import (
    RunRecorder,
    RunResult,
    adopt_server_params,
    distributed_optimizer,
    local_optimizer,
    save_model,
)
from worker.trainers.collective import (
    AllreduceHookState,
    env_rendezvous,
    init_process_group,
    register_timed_hook,
    ring_bytes,
    server_stats_when_done,
    timed_allreduce_hook,
    wrap_hook,
)
from worker.workloads.ctr import CTRData, CTRModel, evaluate, table_spec

log = logging.getLogger("deltaps.hybrid")

HYBRID_TIMING_METHOD = ("hybrid: blocked = wait for the step's rows (bsp: requested during the previous step's "
                        "backward) + exposed dense allreduce (+ push wait, asp); wait = the part of the rows' wait "
                        "the shards spent at their BSP gate; comm = blocked - wait")


def table_optimizer(cfg: TrainConfig, params, sparse: bool = False):
    """The local table optimizer of the allreduce modes: --embedding-optimizer at --embedding-lr (the PS table's
    eps). sparse: for a sparse gradient; torch's SGD and Adagrad take one as is, adam becomes SparseAdam."""
    if cfg.embedding_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.embedding_lr, eps=1e-10)
    if cfg.embedding_optimizer == "adam":
        return (torch.optim.SparseAdam if sparse else torch.optim.Adam)(params, lr=cfg.embedding_lr)
    return torch.optim.SGD(params, lr=cfg.embedding_lr)


def _model(cfg: TrainConfig, materialize: bool) -> CTRModel:
    return CTRModel(cfg.embedding_rows, cfg.embedding_dim, cfg.embedding_fields, cfg.hidden, cfg.layers, cfg.seed,
                    materialize_table=materialize, table_spec=table_spec(cfg),
                    sparse=materialize and cfg.sparse_embeddings)


def _logical_params(cfg: TrainConfig, model) -> int:
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("emb"))
    return dense + cfg.embedding_rows * cfg.embedding_dim


def ctr_extras(ev: dict, **mode_extras) -> dict:
    """The ctr workload's own result keys (RunResult.extras): test AUC/loss, the teacher's, plus the mode's."""
    return {"final_test_auc": ev["test_auc"], "final_test_loss": ev["test_loss"], "oracle_auc": ev["oracle_auc"],
            "oracle_loss": ev["oracle_loss"], "workload": "ctr", **mode_extras}


def hybrid_extras(ps_modules: list[str], sparse_stats: dict, dense_ring_bytes: int) -> dict:
    """train_hybrid's own keys (beside ctr_extras): the sparse (PS) and dense (ring) traffic apart."""
    return {"ps_modules": ps_modules, "sparse_bytes_pushed": int(sparse_stats.get("bytes_pushed_wire", 0)),
            "sparse_bytes_pulled": int(sparse_stats.get("bytes_pulled_wire", 0)),
            "dense_ring_bytes": int(dense_ring_bytes), "rows_pushed": int(sparse_stats.get("rows_pushed", 0)),
            "timing_method": HYBRID_TIMING_METHOD}


def _result(cfg, run: RunRecorder, ev, params, sent, pulled, extra) -> RunResult:
    return run.result(final_test_accuracy=ev["test_accuracy"], model_params=params, bytes_pushed_wire=int(sent),
                      bytes_pushed_raw=int(sent), bytes_pulled_wire=int(pulled), codec=cfg.codec,
                      final_codec=cfg.codec, extras=ctr_extras(ev, **extra))


def _data(cfg) -> CTRData:
    return CTRData(cfg.embedding_rows, cfg.embedding_fields, cfg.zipf_a, cfg.seed)


def _loop(cfg, rank, body, desc, data: CTRData | None = None, auc_fn=None) -> tuple[CTRData, RunRecorder]:
    """body(run, step, ids, dense, y) -> loss runs one step (reporting its blocked time to run.comm);
    auc_fn(step) -> the test AUC after `step`, for --eval-every / --target-auc (off the clock)."""
    data = data or _data(cfg)
    run = RunRecorder(cfg, rank, desc, log)
    for step in run.steps():
        ids, dense, y = data.batch(rank, step, cfg.batch_size)
        run.record(body(run, step, ids, dense, y))
        if auc_fn is not None:
            run.evaluate(lambda step=step: auc_fn(step))
    return data, run


# ---- allreduce: everything through DDP -----------------------------------------------------------------
class SparseHookState(AllreduceHookState):
    """AllreduceHookState + the bytes of the sparse buckets (nn.Embedding(sparse=True) gradients) this step."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.sparse_sent = 0

    def new_step(self) -> None:
        super().new_step()
        self.sparse_sent = 0


def sparse_aware_hook(state: SparseHookState, bucket):
    """timed_allreduce_hook for dense buckets. A sparse bucket (DDP gives a sparse gradient a bucket of its own)
    is divided by the world size and allreduced by gloo's sparse allreduce, an allgather of each rank's coalesced
    (row index int64, values) pairs: a rank sends (W-1) x its own pairs' bytes in the ring (exact on average)."""
    buf = bucket.buffer()
    if not buf.is_sparse:
        return timed_allreduce_hook(state, bucket)
    state.last_ready = max(state.last_ready, time.time())
    buf = buf.coalesce()
    vals = buf.values()
    state.sparse_sent += (state.world_size - 1) * (buf.indices().numel() * 8 + vals.numel() * vals.element_size())
    fut = dist.all_reduce(buf.div_(state.world_size), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def train_ctr_allreduce(cfg: TrainConfig, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                        master_port: int = 29500, bucket_cap_mb: float = 25.0) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    init_process_group(cfg, rank, world_size, master_addr, master_port)
    try:
        model = _model(cfg, True)
        sparse = cfg.sparse_embeddings
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        state = SparseHookState(world_size)
        wrap_hook(state, cfg.ddp_hook)          # fp16 / bf16 (--ddp-hook): the dense buckets only
        ddp.register_comm_hook(state, sparse_aware_hook)
        opt_d = local_optimizer(cfg, model.mlp.parameters())
        opt_e = table_optimizer(cfg, [model.emb.weight], sparse)
        sent = {"bytes": 0, "sparse": 0}

        def body(run, step, ids, dense, y):
            state.new_step()
            loss = F.binary_cross_entropy_with_logits(ddp(ids, dense), y)
            opt_d.zero_grad(set_to_none=False)
            opt_e.zero_grad(set_to_none=sparse)          # a sparse gradient is replaced, not accumulated into
            t = time.perf_counter()
            loss.backward()
            run.comm(state.exposed_comm_s(time.time(), time.perf_counter() - t))
            sent["bytes"] += ring_bytes(state.payload_bytes, world_size) + state.sparse_sent
            sent["sparse"] += state.sparse_sent
            opt_d.step()
            opt_e.step()
            return loss.item()
        dist.barrier()
        data = _data(cfg)
        data, run = _loop(cfg, rank, body, f"worker {rank} (allreduce{', sparse table' if sparse else ''}, ctr)", data,
                          lambda step: evaluate(model, data)["test_auc"])
        ev = evaluate(model, data)
        save_model(cfg, rank, model)
        extra = {"timing_method": "ddp-comm-hook: comm = backward return - last bucket ready (wait not split)"}
        if sparse:
            extra.update(sparse_embeddings=True, sparse_allgather_bytes=sent["sparse"],
                         table_optimizer=type(opt_e).__name__)
        res = _result(cfg, run, ev, _logical_params(cfg, model), sent["bytes"], sent["bytes"], extra)
        dist.barrier()
        return res.to_dict()
    finally:
        dist.destroy_process_group()


# ---- ps: everything on the parameter servers, dense pushes ---------------------------------------------
def train_ctr_ps(cfg: TrainConfig, servers: list[str], rank: int, world_size: int, security=None) -> dict:
    torch.set_num_threads(1)
    model = _model(cfg, True)
    opt = distributed_optimizer(cfg, model, servers, rank, world_size, security)

    def body(run, step, ids, dense, y):
        before = dict(opt.timing)
        loss = F.binary_cross_entropy_with_logits(model(ids, dense), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.comm_since(opt.timing, before)
        return loss.item()
    data, run = _loop(cfg, rank, body, f"worker {rank} (ps, ctr)")
    adopt_server_params(opt)
    ev = evaluate(model, data)
    comm = opt.client.stats.snapshot()
    res = _result(cfg, run, ev, _logical_params(cfg, model), comm.get("bytes_pushed_wire", 0),
                  comm.get("bytes_pulled_wire", 0),
                  {"optimizer_note": f"server {cfg.optimizer} on every parameter, table included"})
    if rank == 0:
        res.server_stats = opt.client.server_stats()
    opt.client.barrier("exit")
    opt.close()
    return res.to_dict()


# ---- hybrid: embeddings row-sparse on the PS, the rest by allreduce -------------------------------------
def train_hybrid(cfg: TrainConfig, servers: list[str], rank: int, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int = 29500, bucket_cap_mb: float = 25.0, security=None) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.embedding import EmbeddingClient, replace_embeddings, select_ps_modules
    from worker.embedding_pipeline import RowPipeline

    torch.set_num_threads(1)
    if cfg.sync not in ("bsp", "asp"):
        raise ValueError(f"hybrid mode supports --sync bsp or asp, not {cfg.sync}")
    init_process_group(cfg, rank, world_size, master_addr, master_port)
    client = None
    try:
        model = _model(cfg, False)
        names = select_ps_modules(model, cfg.ps_params)
        spec = table_spec(cfg)
        client = EmbeddingClient(servers, rank, world_size, [replace(spec, name=n) for n in names], sync=cfg.sync,
                                 timeout_s=cfg.timeout_s, max_message_bytes=cfg.max_message_bytes,
                                 chunk_bytes=cfg.chunk_bytes, security=security,
                                 reconnect_deadline_s=cfg.reconnect_deadline_s, replay_steps=cfg.replay_steps)
        client.register()
        embs = replace_embeddings(model, names, client)
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        state = AllreduceHookState(world_size)
        register_timed_hook(ddp, state, cfg.ddp_hook)   # fp16 / bf16 (--ddp-hook) or DDP's fp32 average
        opt = local_optimizer(cfg, ddp.parameters())
        ring = {"bytes": 0}
        min_v = (lambda step: step) if cfg.sync == "bsp" else (lambda step: 0)
        data = _data(cfg)
        pipe = RowPipeline(client, embs) if cfg.sync == "bsp" else None

        def fetch_rows(run, step, ids):
            t = time.perf_counter()
            if pipe is not None:                         # requested during the previous step's backward
                waited = pipe.begin(step, ids)
            else:
                waited0 = sum(e.waited_s for e in embs.values())
                for e in embs.values():
                    e.prefetch(ids, min_v(step))
                waited = sum(e.waited_s for e in embs.values()) - waited0
            blocked = time.perf_counter() - t
            run.comm(blocked, min(waited, blocked))      # the shard's wait may have overlapped this worker's work

        def body(run, step, ids, dense, y):
            fetch_rows(run, step, ids)
            state.new_step()
            loss = F.binary_cross_entropy_with_logits(ddp(ids, dense), y)
            opt.zero_grad(set_to_none=False)
            if pipe is not None:    # pushes the row gradients from inside backward, then pulls the next rows
                # ... but not across an evaluation, which is off the clock: that pull stays on it
                last = step + 1 >= cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                pipe.arm(step, None if last else data.batch(rank, step + 1, cfg.batch_size)[0])
            t = time.perf_counter()
            loss.backward()                              # the MLP's gradients are allreduced in here
            run.comm(state.exposed_comm_s(time.time(), time.perf_counter() - t))
            ring["bytes"] += ring_bytes(state.payload_bytes, world_size)
            if pipe is not None:
                pipe.flush()
                opt.step()
                return loss.item()
            grads = {}
            for e in embs.values():
                grads.update(e.row_grads())
            futs = client.push_rows_async(step, grads)   # row gradients, while the MLP steps locally
            opt.step()
            t = time.perf_counter()
            for f in futs:
                f.result()
            run.comm(time.perf_counter() - t)
            return loss.item()

        def table_auc(step):    # the table the shards hold after `step` (the evaluation pulls at that version)
            for e in embs.values():
                e.min_version = min_v(step + 1)
            return evaluate(model, data)["test_auc"]
        dist.barrier()
        data, run = _loop(cfg, rank, body, f"worker {rank} (hybrid, ctr)", data, table_auc)
        if pipe is not None:
            pipe.close()
        for e in embs.values():
            e.min_version = min_v(run.steps_to_target or cfg.steps)   # the table after the last step run
        ev = evaluate(model, data)
        save_model(cfg, rank, model)                     # the dense part (the table stays on the shards)
        c = client.stats.snapshot()
        sparse_sent, sparse_pulled = c.get("bytes_pushed_wire", 0), c.get("bytes_pulled_wire", 0)
        res = _result(cfg, run, ev, _logical_params(cfg, model), sparse_sent + ring["bytes"],
                      sparse_pulled + ring["bytes"], hybrid_extras(names, c, ring["bytes"]))
        res.server_stats = server_stats_when_done(client, rank)
        return res.to_dict()
    finally:
        if client is not None:
            client.close()
        dist.destroy_process_group()


def run_worker(cfg: TrainConfig, args, security=None) -> dict:
    """`deltaps worker` entry for --workload ctr (any mode) and --mode hybrid."""
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
