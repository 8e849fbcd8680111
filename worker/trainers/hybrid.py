"""`--mode hybrid`: embedding tables row-sparse on the parameter servers, the rest of the model allreduced.

Modules selected by --ps-params (every nn.Embedding by default) live on the PS, row-sparse (worker/embedding/,
ps/embedding/): a step pulls the unique rows of its batch and pushes their gradients; the rest of the model
(the click-through workload's MLP) is a DDP module over gloo, allreduced in the same step (fp32, or the fp16 /
bf16 hook with --ddp-hook). Under bsp the row exchange is pipelined (worker/embedding/pipeline.py): the row
gradients go out from inside backward while DDP allreduces, and the next step's rows are requested right
behind them — exact, the shard's BSP gate holds the pull until every worker pushed.

With --embedding-optimizer sgd or adagrad, `allreduce` (the table dense in DDP) and `hybrid` compute the same
updates: a dense Adagrad/SGD step leaves rows with zero gradient unchanged, which is what the row-wise PS
optimizer does by not touching them (tested in tests/rpc/test_embedding.py); only float summation order differs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch.distributed as dist

from worker.trainers.base import local_optimizer
from worker.trainers.collective import (
    AllreduceHookState,
    check_table_model_hook,
    register_timed_hook,
    ring_bytes,
    server_stats_when_done,
)
from worker.trainers.context import ClientOptions
from worker.trainers.strategy import StepOutcome, Strategy, register
from worker.workloads.ctr import table_spec

log = logging.getLogger("deltaps.hybrid")

HYBRID_TIMING_METHOD = ("hybrid: blocked = wait for the step's rows (bsp: requested during the previous step's "
                        "backward) + exposed dense allreduce (+ push wait, asp); wait = the part of the rows' wait "
                        "the shards spent at their BSP gate; comm = blocked - wait")


def hybrid_extras(ps_modules: list[str], sparse_stats: dict, dense_ring_bytes: int) -> dict:
    """The hybrid mode's own result keys: the sparse (PS) and dense (ring) traffic apart."""
    return {"ps_modules": ps_modules, "sparse_bytes_pushed": int(sparse_stats.get("bytes_pushed_wire", 0)),
            "sparse_bytes_pulled": int(sparse_stats.get("bytes_pulled_wire", 0)),
            "dense_ring_bytes": int(dense_ring_bytes), "rows_pushed": int(sparse_stats.get("rows_pushed", 0)),
            "timing_method": HYBRID_TIMING_METHOD}


@register("hybrid")
class Hybrid(Strategy):
    collective = True
    evaluates_alone = False     # its tables live on the shards, outside the module's state_dict
    needs_servers = True
    takes_ddp_hook = dynamic_tables = needs_embeddings = True

    @classmethod
    def validate(cls, cfg, workload_cls) -> None:
        super().validate(cfg, workload_cls)
        if cfg.sync not in ("bsp", "asp"):
            raise ValueError(f"hybrid mode supports --sync bsp or asp, not {cfg.sync}")
        check_table_model_hook(cfg.ddp_hook, workload_cls.name)
        cls.target_needs_bsp(cfg, workload_cls)

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from worker.embedding import EmbeddingClient, replace_embeddings, select_ps_modules
        from worker.embedding.pipeline import RowPipeline
        cfg, ctx = self.cfg, self.ctx
        self.model = model = self.workload.build_model("remote")
        self.names = select_ps_modules(model, cfg.ps_params)
        spec = table_spec(cfg)
        self.client = EmbeddingClient(ctx.servers, ctx.rank, ctx.world_size, [replace(spec, name=n) for n in self.names],
                                      **ClientOptions.from_config(cfg, ctx.security).kwargs())
        self.closables.append(self.client.close)
        self.client.register()
        self.embs = replace_embeddings(model, self.names, self.client)
        self.ddp = DDP(model, bucket_cap_mb=ctx.bucket_cap_mb)
        self.state = AllreduceHookState(ctx.world_size)
        register_timed_hook(self.ddp, self.state, cfg.ddp_hook)   # fp16 / bf16 (--ddp-hook) or DDP's fp32 average
        self.opt = local_optimizer(cfg, self.ddp.parameters())
        self.ring_bytes = 0
        self.pipe = RowPipeline(self.client, self.embs) if cfg.sync == "bsp" else None
        dist.barrier()

    def _min_version(self, step: int) -> int:
        return step if self.cfg.sync == "bsp" else 0

    def _fetch_rows(self, run, step: int, ids) -> None:
        t = time.perf_counter()
        if self.pipe is not None:                         # requested during the previous step's backward
            waited = self.pipe.begin(step, ids)
        else:
            waited0 = sum(e.waited_s for e in self.embs.values())
            for e in self.embs.values():
                e.prefetch(ids, self._min_version(step))
            waited = sum(e.waited_s for e in self.embs.values()) - waited0
        blocked = time.perf_counter() - t
        run.comm(blocked, min(waited, blocked))      # the shard's wait may have overlapped this worker's work

    def _next_ids(self, step: int):
        """The next step's row ids for the pipeline — None at the last step and before an evaluation, which is
        off the clock: that pull stays on it."""
        cfg = self.cfg
        if step + 1 >= cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
            return None
        return self.workload.batch_at(self.rank, step + 1)[0][0]

    def train_step(self, run, step: int, batch) -> StepOutcome:
        ids = batch[0][0]
        self._fetch_rows(run, step, ids)
        self.state.new_step()
        loss = self.workload.loss(self.ddp, batch)
        self.opt.zero_grad(set_to_none=False)
        if self.pipe is not None:    # pushes the row gradients from inside backward, then pulls the next rows
            self.pipe.arm(step, self._next_ids(step))
        t = time.perf_counter()
        loss.backward()                              # the MLP's gradients are allreduced in here
        run.comm(self.state.exposed_comm_s(time.time(), time.perf_counter() - t))
        self.ring_bytes += ring_bytes(self.state.payload_bytes, self.ctx.world_size)
        if self.pipe is not None:
            self.pipe.flush()
            self.opt.step()
            return StepOutcome(loss.item())
        grads = {}
        for e in self.embs.values():
            grads.update(e.row_grads())
        futs = self.client.push_rows_async(step, grads)   # row gradients, while the MLP steps locally
        self.opt.step()
        t = time.perf_counter()
        for f in futs:
            f.result()
        run.comm(time.perf_counter() - t)
        return StepOutcome(loss.item())

    def evaluate(self, step: int) -> dict:
        for e in self.embs.values():   # the table the shards hold after `step` (the evaluation pulls that version)
            e.min_version = self._min_version(step + 1)
        evaluation = self.workload.evaluate(self.model)
        if self.rank == 0:        # the table's memory over time: the rows the shards hold now
            shards = self.client.server_stats()
            evaluation["table_rows_live"] = sum(t["rows_held"] for s in shards for t in s["tables"].values())
        return evaluation

    def finish(self, run) -> dict:
        if self.pipe is not None:
            self.pipe.close()
        for e in self.embs.values():
            e.min_version = self._min_version(run.stopped_at or self.cfg.steps)   # the table after the last step
        c = self.client.stats.snapshot()
        sent = int(c.get("bytes_pushed_wire", 0) + self.ring_bytes)
        return dict(bytes_pushed_wire=sent, bytes_pushed_raw=sent,
                    bytes_pulled_wire=int(c.get("bytes_pulled_wire", 0) + self.ring_bytes), codec=self.cfg.codec,
                    final_codec=self.cfg.codec, extras=hybrid_extras(self.names, c, self.ring_bytes))

    def report(self, result) -> None:
        result.server_stats = server_stats_when_done(self.client, self.rank)
