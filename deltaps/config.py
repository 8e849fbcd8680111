"""Job configuration: dataclass defaults < YAML file (--config) < command-line flags."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

import yaml


@dataclass
class TrainConfig:
    mode: str = "ps"                 # ps (parameter servers) | allreduce (DDP baseline) | hybrid
    sync: str = "bsp"                # bsp | asp | ssp:S
    servers: int = 2                 # launch: number of PS shards
    workers: int = 2                 # launch: number of workers (= world size)
    steps: int = 300
    batch_size: int = 32             # per worker
    optimizer: str = "adam"          # sgd | adam (runs on the servers)
    lr: float = 1e-3
    momentum: float = 0.9            # sgd only
    weight_decay: float = 0.0
    codec: str = "none"              # gradient codec spec, e.g. int8, topk:ratio=0.01
    chunk_bytes: int = 4 << 20       # tensors are split into keys of at most this size
    max_message_bytes: int = 64 << 20
    bucket_bytes: int = 25 << 20     # gradient fusion: pushes go out per bucket of this many bytes (0 = per parameter)
    pull_codec: str = "auto"         # parameter deltas served by pulls: auto (follows codec), none, spec
    min_compress_bytes: int = 1024   # smaller tensors go uncompressed (256 float32)
    compress_warmup_steps: int = 0   # send uncompressed for the first N steps
    fallback_factor: float = 3.0     # auto-rollback to codec none if smoothed loss > factor x its minimum (0 = off)
    fallback_warmup_steps: int = 50  # loss-rise check starts after this many steps (NaN/Inf always checked)
    fallback_loss_floor: float = 0.05  # minimum below this counts as this (noise near zero loss)
    hidden: int = 256
    layers: int = 2
    seed: int = 0
    timeout_s: float = 120.0         # longest a push/pull/barrier may wait
    reconnect_deadline_s: float = 60.0  # give up (PSError naming the shard) after a shard is unreachable this long
    replay_steps: int = 256          # per-shard replay buffer bound, in steps (pushes not yet in a checkpoint)
    progress: bool = True            # tqdm bar (launch shows rank 0's)
    log_every: int = 0               # log loss every N steps (0 = never)
    save_model: str = ""             # rank 0 writes the final model's state_dict here (torch.save)
    # ---- hybrid parallelism / embedding workload (worker/hybrid.py, README "Hybrid parallelism") ----
    workload: str = "mlp"            # mlp (digits MLP) | ctr (synthetic click-through model, large embedding)
    ps_params: str = "embedding"     # hybrid: modules on the PS (row-sparse): "embedding" or fnmatch patterns
    embedding_rows: int = 1_000_000  # ctr: rows of the embedding table
    embedding_dim: int = 64
    embedding_fields: int = 8        # ctr: categorical fields per sample (share the table)
    embedding_optimizer: str = "adagrad"  # sgd | adagrad | adam (row-wise on the PS; dense torch in allreduce)
    embedding_lr: float = 0.05
    zipf_a: float = 1.1              # ctr: Zipf exponent of the id distribution
    # ---- pipeline parallelism (worker/pipeline.py, README "Hybrid parallelism") ----
    pipeline_stages: int = 2         # pipeline: stages S per replica (workers = S x data-parallel replicas)
    microbatches: int = 4            # pipeline: micro-batches per step (must divide --batch-size)
    pipeline_schedule: str = "gpipe"  # pipeline: gpipe | 1f1b (torch.distributed.pipelining)
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        from deltaps.sync import parse_sync
        parse_sync(self.sync)
        if self.mode not in ("ps", "allreduce", "hybrid", "pipeline"):
            raise ValueError(f"unknown mode {self.mode!r}; use ps, allreduce, hybrid or pipeline")
        if self.mode == "pipeline":
            self._validate_pipeline()
        if self.workload not in ("mlp", "ctr"):
            raise ValueError(f"unknown workload {self.workload!r}; use mlp or ctr")
        if self.mode == "hybrid" and self.workload != "ctr":
            raise ValueError("--mode hybrid needs a model with embeddings: use --workload ctr")
        if self.embedding_optimizer not in ("sgd", "adagrad", "adam"):
            raise ValueError(f"unknown embedding optimizer {self.embedding_optimizer!r}; use sgd, adagrad or adam")
        for name in ("embedding_rows", "embedding_dim", "embedding_fields"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use sgd or adam")
        for name in ("servers", "workers", "steps", "batch_size", "hidden", "layers", "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {self.bucket_bytes}")
        from compression import get_codec
        from deltaps.pull_codec import resolve_pull_codec
        get_codec(self.codec)
        resolve_pull_codec(self.pull_codec, self.codec)

    def _validate_pipeline(self) -> None:
        if self.workload != "mlp":
            raise ValueError("--mode pipeline runs the digits MLP: use --workload mlp")
        if self.sync != "bsp":
            raise ValueError(f"--mode pipeline supports --sync bsp only, not {self.sync}")
        if self.pipeline_schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown pipeline schedule {self.pipeline_schedule!r}; use gpipe or 1f1b")
        if not 1 <= self.pipeline_stages <= self.layers + 1:
            raise ValueError(f"--pipeline-stages must be in [1, layers + 1 = {self.layers + 1}], "
                             f"got {self.pipeline_stages}")
        if self.workers % self.pipeline_stages:
            raise ValueError(f"--workers {self.workers} must be a multiple of --pipeline-stages {self.pipeline_stages}")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"--microbatches {self.microbatches} must be >= 1 and divide --batch-size {self.batch_size}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_HELP = {
    "mode": "training mode: ps (parameter servers), allreduce (DDP ring-allreduce baseline), hybrid "
            "(embeddings on the PS, rest allreduced) or pipeline (pipeline stages x data-parallel replicas via the PS)", "sync": "bsp, asp or ssp:S", "servers": "number of PS shards (launch)",
    "workers": "number of workers / world size (launch)", "steps": "training steps per worker",
    "batch_size": "batch size per worker", "optimizer": "server-side optimizer: sgd or adam",
    "lr": "learning rate", "momentum": "SGD momentum", "weight_decay": "weight decay",
    "codec": "gradient codec spec (none, fp16, int8, topk:ratio=0.01, ...)",
    "chunk_bytes": "split tensors into keys of at most this many bytes",
    "max_message_bytes": "gRPC max send/receive message size",
    "bucket_bytes": "gradient fusion (as DDP buckets): parameters are grouped in backward order into buckets of "
                    "about this many bytes; a complete bucket goes out as one PushPull RPC per shard (0 = per parameter)", "hidden": "MLP hidden width",
    "pull_codec": "codec for parameter deltas sent back by pulls: auto (follows --codec), none, or a spec",
    "min_compress_bytes": "tensors smaller than this go uncompressed",
    "compress_warmup_steps": "send uncompressed for the first N steps",
    "fallback_factor": "roll back to codec none when smoothed loss exceeds this factor of its minimum (0 = off)",
    "fallback_warmup_steps": "steps before the loss-rise fallback check starts",
    "fallback_loss_floor": "loss minimum used by the fallback check is at least this",
    "layers": "MLP hidden layers", "seed": "random seed (model init, data order)",
    "timeout_s": "longest a push/pull/barrier may wait, seconds",
    "reconnect_deadline_s": "fail with an error naming the shard after it was unreachable this long, seconds",
    "replay_steps": "keep at most this many steps of not-yet-checkpointed pushes per shard for replay after a restart",
    "progress": "show a tqdm progress bar",
    "log_every": "log the loss every N steps (0 = never)",
    "save_model": "rank 0 saves the final model state_dict to this path (torch.save)",
    "workload": "model/data: mlp (digits MLP) or ctr (synthetic click-through model with a large embedding table)",
    "ps_params": "hybrid mode: modules kept on the PS row-sparse: embedding (every nn.Embedding) or fnmatch patterns",
    "embedding_rows": "ctr workload: embedding table rows", "embedding_dim": "ctr workload: embedding width",
    "embedding_fields": "ctr workload: categorical fields per sample (sharing the table)",
    "embedding_optimizer": "embedding table optimizer: sgd, adagrad or adam (row-wise lazy on the PS)",
    "embedding_lr": "embedding table learning rate", "zipf_a": "ctr workload: Zipf exponent of the ids",
    "pipeline_stages": "pipeline mode: stages per pipeline replica (workers must be a multiple of it)",
    "microbatches": "pipeline mode: micro-batches per step (must divide --batch-size)",
    "pipeline_schedule": "pipeline mode: schedule, gpipe or 1f1b",
}


WORKER_EXCLUDED = ("servers", "workers")  # a worker gets addresses and --world-size instead


def add_train_args(p: argparse.ArgumentParser, exclude: tuple = ()) -> None:
    p.add_argument("--config", help="YAML file with any of the keys below (flags override it)")
    for f in fields(TrainConfig):
        if f.name == "extra" or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=_HELP[f.name])
        else:
            cast = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            p.add_argument(flag, dest=f.name, type=cast, default=None, help=_HELP[f.name])


def load_config(path: str | None, overrides: dict | None = None) -> TrainConfig:
    cfg = TrainConfig()
    known = {f.name for f in fields(TrainConfig)}
    if path:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown config keys: {', '.join(sorted(unknown))}")
        for k, v in data.items():
            setattr(cfg, k, v)
    for k, v in (overrides or {}).items():
        if v is not None and k in known:
            setattr(cfg, k, v)
    cfg.validate()
    return cfg


def config_from_args(args: argparse.Namespace, exclude: tuple = ()) -> TrainConfig:
    return load_config(getattr(args, "config", None), {k: v for k, v in vars(args).items() if k not in exclude})
