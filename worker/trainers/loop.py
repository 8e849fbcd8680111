"""The one training loop: every mode (a Strategy) x every workload (a Workload) runs through `train`.

Lifecycle of one worker run: threads (torch gets one intra-op thread per process: the ranks of a local
cluster share the host's cores) -> the workload and the strategy from their registries -> the process group
(collective strategies) -> setup -> begin -> `for step in run.steps()`: batch, train_step, record, metrics,
evaluation off the clock (may end the job at the target), end_step -> finish (the job's final model) -> final evaluation, saved
model, result -> report (server stats, barriers) -> close, whatever happened (the process group's teardown bounded;
a hang past --timeout-s after training dumps every thread's stack to the log).
"""
from __future__ import annotations

import faulthandler
import logging
import resource
import sys

import torch
import torch.distributed as dist

from deltaps.units import parse_bytes
from worker.shared_evaluations import SharedEvaluations
from worker.trainers.base import RunRecorder, save_model
from worker.trainers.collective import destroy_process_group_within, init_process_group
from worker.trainers.context import RunContext
from worker.trainers.strategy import check_job, strategy_class
from worker.workloads import get_workload

log = logging.getLogger("deltaps.worker")


def train(cfg, ctx: RunContext) -> dict:
    """Run one worker of the job `cfg` describes (its mode and workload); returns RunResult.to_dict()."""
    check_job(cfg, ctx)
    limit_memory(cfg.worker_memory_limit)
    torch.set_num_threads(1)
    workload = get_workload(cfg)
    strategy = strategy_class(cfg.mode)(cfg, ctx, workload)
    if cfg.eval_cache and strategy.evaluates_alone:   # every strategy and the final evaluation go through it
        workload.evaluate = SharedEvaluations(cfg.eval_cache, workload.evaluate)
    if strategy.collective:
        init_process_group(cfg, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port, strategy.backend())
    try:
        strategy.setup()
        run = RunRecorder(cfg, ctx.rank, strategy.desc, log, metric=workload.metric, target_key=workload.target_field,
                          reaches=workload.reaches)
        strategy.begin(run)
        slow = cfg.straggler_of(ctx.rank)
        _steps(strategy, run, ctx, slow)
        # the end of a job waits on the others (barriers, a shared final evaluation, the teardown): should it hang,
        # the stacks of every thread go to this worker's log while it hangs
        faulthandler.dump_traceback_later(cfg.timeout_s, exit=False, file=sys.__stderr__)
        fields = strategy.finish(run)
        evaluation = workload.evaluate(strategy.model)
        if cfg.save_model:
            save_model(cfg, ctx.rank, strategy.model_state())
        fields["extras"] = {"device": str(strategy.device), "peak_rss_bytes": peak_rss_bytes(),
                            "steps_trained": len(run.step_times),     # fewer than `steps` where the loop skipped
                            **workload.result_extras(evaluation),
                            **run.straggler_extras(slow), **fields.get("extras", {})}
        result = run.result(final_test_accuracy=evaluation["test_accuracy"],
                            model_params=workload.logical_params(strategy.model), **fields)
        strategy.report(result)
        return result.to_dict()
    finally:
        try:
            strategy.close()
            if strategy.collective and dist.is_initialized():
                destroy_process_group_within()
        finally:
            faulthandler.cancel_dump_traceback_later()


def _steps(strategy, run: RunRecorder, ctx: RunContext, slow: float = 1.0) -> None:
    batches = strategy.batches()
    for step in run.steps(first=strategy.first_step):
        batch = next(batches)
        out = strategy.train_step(run, step, batch)
        if slow != 1.0:       # --straggler: this rank's compute takes `slow` times as long
            run.straggle(slow)
        step_s = run.record(out.loss, wire_bytes=out.wire_bytes, end=out.end)
        if ctx.metrics is not None and out.loss is not None:
            ctx.metrics.on_step(step_s, out.loss, len(batch[1]))
        run.evaluate(lambda: strategy.evaluate(step), synced=strategy.synced, judges=strategy.judges)
        strategy.end_step(run, step)


def peak_rss_bytes() -> int:
    """This worker process' peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def limit_memory(size: str) -> None:
    """--worker-memory-limit: cap this process' data memory, RLIMIT_DATA (heap and private mappings: what tensors
    take; shared libraries and code are not counted, unlike RLIMIT_AS). Allocations past it raise MemoryError / a torch
    'can't allocate memory' RuntimeError, which the worker reports)."""
    if size:
        limit = parse_bytes(size)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
