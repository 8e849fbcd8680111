"""Job configuration: dataclass defaults < YAML file (--config) < command-line flags.

Each field carries its help text (and, for sizes, its parser) next to its default: the flags of
`deltaps launch` / `deltaps worker` are generated from these fields.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

import yaml

from deltaps.optimizer_config import DEFAULT_OUTER
from deltaps.units import parse_bytes

DEVICES = ("auto", "cpu", "cuda")     # --device (worker/trainers/devices.py resolves them)


def option(default, help: str, parse=None):   # noqa: A002 - argparse's own word
    """A config field with its help text and an optional value parser (applied to flags and YAML)."""
    return field(default=default, metadata={"help": help, "parse": parse})


@dataclass
class TrainConfig:
    mode: str = option(
        "ps",
        "training mode: ps (parameter servers), allreduce (DDP ring-allreduce baseline), hybrid (embeddings "
        "on the PS, rest allreduced), pipeline (pipeline stages x data-parallel replicas via the PS), torchft "
        "(the peer: torchft's own DiLoCo / LocalSGD) or torchrec (the embedding peer: TorchRec's "
        "DistributedModelParallel, --workload ctr)")
    ddp_hook: str = option(
        "none",
        "allreduce mode (hybrid: its dense part, fp16 / bf16): DDP communication hook, as torch ships them: "
        "none (fp32 average), fp16, bf16, "
        "powersgd:rank=R[:start=S] (PowerSGD with error feedback and warm start; plain allreduce before step S, "
        "default 10) or localsgd:period=H[:start=S] (post-local SGD: no gradient allreduce from step S, default 1; "
        "models averaged every H steps); see docs/compare.md")
    sync: str = option(
        "bsp",
        "bsp, asp, ssp:S or quorum:Q[:grace=G] (local-update rounds that close at Q workers plus a grace window: "
        "G x the recent rounds' time, or Gs seconds; docs/local-updates.md#quorum-rounds)")
    servers: int = option(2, "number of PS shards (launch)")
    workers: int = option(2, "number of workers / world size (launch)")
    min_workers: int = option(
        0,
        "elastic job: below this many live workers the job pauses (and says so) until workers join "
        "(0: never pauses; evicted workers just leave)")
    max_workers: int = option(
        0,
        "elastic job: workers with ids below this may join while it runs (0 = --workers: no joins)")
    device: str = option(
        "auto",
        "where a worker trains: cpu, cuda (this worker's GPU: $LOCAL_RANK, else the rank modulo the GPUs; the PS "
        "modes compress on it with CuPy, the shards stay on the CPU) or auto (cuda when torch sees a GPU); "
        "--mode torchft and pipeline train on the CPU")
    steps: int = option(300, "training steps per worker")
    batch_size: int = option(32, "batch size per worker")
    optimizer: str = option("adam", "server-side optimizer: sgd or adam")
    lr: float = option(1e-3, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "weight decay")
    codec: str = option("none", "gradient codec spec (none, fp16, int8, topk:ratio=0.01, ...)")
    chunk_bytes: int = option(4 << 20, "split tensors into keys of at most this many bytes", parse=parse_bytes)
    max_message_bytes: int = option(64 << 20, "gRPC max send/receive message size", parse=parse_bytes)
    buffer_sync: str = option(
        "broadcast",
        "model buffers (BatchNorm running statistics, ...) in --mode ps: broadcast (rank 0's to every worker at "
        "each step, as DDP's broadcast_buffers), average (the workers' mean) or local (never synchronised)")
    bucket_bytes: int = option(
        25 << 20,
        "gradient fusion (as DDP buckets): parameters are grouped in backward order into buckets of about "
        "this many bytes; a complete bucket goes out as one PushPull RPC per shard (0 = per parameter)", parse=parse_bytes)
    pull_codec: str = option(
        "auto",
        "codec for parameter deltas sent back by pulls: auto (follows --codec), none, or a spec")
    # ---- local-update training (DiLoCo-style; worker/local_updates.py, docs/local-updates.md) ----
    local_steps: int = option(
        0,
        "--mode ps: each worker takes this many inner steps with the local optimizer (--optimizer/--lr) "
        "between outer rounds, then pushes its parameter delta through --codec; the shards apply "
        "--outer-optimizer to the workers' mean delta (0 = push gradients every step)")
    outer_optimizer: str = option(
        DEFAULT_OUTER[0],
        "local-update jobs: the shards' outer optimizer on the mean delta: avg (the new model is the mean of "
        "the local models), sgd (--outer-lr, heavy-ball --outer-momentum) or nesterov (DiLoCo's)")
    pull_residual: str = option(
        "auto",
        "local-update jobs with a lossy pull codec: carry (what a pull did not carry stays in the shards' model and "
        "goes down later: error feedback on the down-link), drop (each outer step starts from the model the "
        "workers hold; the outer momentum carries the dropped part's direction) or auto (drop under chunktopk's "
        "pulls; else carry: measured per codec, deltaps/pull_codec.py)")
    torchft_algorithm: str = option(
        "diloco",
        "--mode torchft: torchft's DiLoCo (the outer optimizer on the averaged pseudo-gradient; Streaming DiLoCo with "
        "--stream-fragments and --overlap-steps as its fragment delay) or localsgd (its model average every "
        "--local-steps)")
    torchft_alpha: float = option(
        0.0,
        "--mode torchft diloco: torchft's fragment_update_alpha, in [0, 1] (0: a fragment takes the global "
        "values after its sync; a > 0 keeps that share of the local ones)")
    torchft_min_replicas: int = option(
        0,
        "--mode torchft: the fewest replicas a quorum may have (torchft's min_replica_size and the Lighthouse's "
        "--min_replicas): below the workers, rounds go on without a dead replica, which heals from a peer when it "
        "rejoins; 0 = every worker (synchronous: every replica in every round)")
    torchft_timeout_s: float = option(
        0.0,
        "--mode torchft: torchft's Manager, quorum and gloo timeout in seconds (how long a round waits for a dead "
        "replica); 0 = --timeout")
    torchft_first_quorum: bool = option(
        False,
        "--mode torchft: meet every replica at a quorum before the first step (torchft's Lighthouse and gloo set-up "
        "off the clock, as DDP's ranks meet at its constructor's broadcast); for a job's first start only: a replica "
        "restarted into a running job with it heals there and misses the collective the others run next")
    torchft_wire: str = option(
        "fp32",
        "--mode torchft diloco: the dtype the pseudo-gradients are allreduced in: fp32, fp16 or bf16 (cast before "
        "the allreduce and back to the parameters' dtype before the outer step)")
    outer_lr: float = option(DEFAULT_OUTER[1], "local-update jobs: outer learning rate (sgd, nesterov; avg is lr 1)")
    outer_momentum: float = option(DEFAULT_OUTER[2], "local-update jobs: outer momentum (sgd, nesterov)")
    stream_fragments: int = option(
        1,
        "local-update jobs: sync the model as this many fragments (groups of parameters) on staggered "
        "schedules, each every --local-steps (Streaming DiLoCo; 1 = the whole model at once)")
    overlap_steps: int = option(
        -1,
        "local-update jobs: each exchange runs in the background for this many inner steps before the worker "
        "adopts the new global values (keeping its progress meanwhile); must be < --local-steps / "
        "--stream-fragments; 0 = wait at once; -1 = 1 with --stream-fragments F > 1 and H >= 2F, else 0")
    min_compress_bytes: int = option(1024, "tensors smaller than this go uncompressed", parse=parse_bytes)
    compress_warmup_steps: int = option(0, "send uncompressed for the first N steps")
    fallback_factor: float = option(
        3.0,
        "roll back to codec none when smoothed loss exceeds this factor of its minimum (0 = off)")
    fallback_warmup_steps: int = option(50, "steps before the loss-rise fallback check starts")
    fallback_loss_floor: float = option(0.05, "loss minimum used by the fallback check is at least this")
    hidden: int = option(256, "MLP hidden width")
    layers: int = option(2, "MLP hidden layers")
    seed: int = option(0, "random seed (model init, data order)")
    timeout_s: float = option(120.0, "longest a push/pull/barrier may wait, seconds")
    heartbeat_s: float = option(
        -1.0,
        "--mode ps: send the shards a heartbeat every this many seconds, so a dead worker (silent for 4 beats) is "
        "evicted within seconds and rounds stop waiting for it; -1 = 0.5 under --sync quorum, else off; 0 = off")
    reconnect_deadline_s: float = option(
        60.0,
        "fail with an error naming the shard after it was unreachable this long, seconds")
    replay_steps: int = option(
        256,
        "keep at most this many steps of not-yet-checkpointed pushes per shard for replay after a restart")
    progress: bool = option(True, "show a tqdm progress bar")
    log_every: int = option(0, "log the loss every N steps (0 = never)")
    save_model: str = option("", "rank 0 saves the final model state_dict to this path (torch.save)")
    # ---- time to accuracy (worker/trainers/base.py RunRecorder; docs/compare.md#time-to-accuracy) ----
    eval_every: int = option(
        0,
        "--mode ps / allreduce: evaluate test accuracy every N steps (timed apart: not part of the step times or "
        "the training clock; local SGD and PS local-update rounds: at the first synced step from N on); 0 = off")
    target_accuracy: float = option(
        0.0,
        "stop at the first evaluation (--eval-every) reaching this test accuracy, or at --steps; every rank "
        "decides alike from the same model (not with --sync asp/ssp, where models differ per rank); 0 = off")
    target_loss: float = option(
        0.0,
        "a workload racing to a held-out loss (--workload lm: test bits per byte): stop at the first evaluation "
        "(--eval-every) at or below it, or at --steps; 0 = off")
    target_auc: float = option(
        0.0,
        "--workload ctr (--mode allreduce / hybrid): stop at the first evaluation (--eval-every) reaching this "
        "test AUC, or at --steps; 0 = off")
    eval_split: str = option(
        "test",
        "what evaluations (and targets) measure: test, or validation — held out of the training data, never the "
        "test set (tabular workloads: as many samples as the test set, stratified, no longer trained on; lm: its "
        "validation files) — to choose hyper-parameters without looking at the test set")
    common_step: int = option(
        0,
        "with a target: keep training past it until step S, where an evaluation is due (at the first synced step "
        "from S on), so every mode of a race has a metric at one common step; 0 = stop at the target")
    eval_log: str = option(
        "",
        "append every evaluation during training to this JSON-lines file as it happens, after a first line "
        "{\"started\": true, \"step\": S} when training begins ({rank} is replaced by the rank; bench compare's "
        "--time-cap, --kill and capped --straggler watch it); empty = off")
    eval_cache: str = option(
        "",
        "a directory the job's ranks on one host share: a model state they hold alike (a synced step) is evaluated "
        "once, by the first rank to get there, and the others read its result (worker/shared_evaluations.py; bench "
        "compare sets it per run); empty = every rank evaluates on its own")
    straggler: str = option(
        "",
        "RANK:FACTOR: that worker's compute takes FACTOR (>= 1) times as long — it sleeps (FACTOR - 1) x its measured "
        "compute after every step, in every mode alike (bench compare --straggler; docs/faults.md); empty = off")
    # ---- hybrid parallelism / embedding workload (worker/trainers/hybrid.py, docs/hybrid.md) ----
    workload: str = option(
        "mlp",
        "model and data: the name of a registered workload (worker/workloads/; docs/cli.md#workloads lists them; "
        "default mlp, the digits MLP)")
    ps_params: str = option(
        "embedding",
        "hybrid mode: modules kept on the PS row-sparse: embedding (every nn.Embedding) or fnmatch patterns")
    embedding_rows: int = option(1_000_000, "ctr workload: embedding table rows")
    embedding_dim: int = option(64, "ctr workload: embedding width")
    embedding_fields: int = option(8, "ctr workload: categorical fields per sample (sharing the table)")
    embedding_optimizer: str = option(
        "adagrad",
        "embedding table optimizer: sgd, adagrad or adam (row-wise lazy on the PS)")
    embedding_lr: float = option(0.05, "embedding table learning rate")
    zipf_a: float = option(1.1, "ctr workload: Zipf exponent of the ids")
    id_drift: float = option(
        0.0,
        "ctr workload: a drifting id stream — every --drift-every steps this share of each field's ids is replaced "
        "by new ids (new users and items; the test set follows the current ids); 0 = the same ids throughout")
    drift_every: int = option(100, "ctr workload with --id-drift: steps per id epoch")
    embedding_dynamic: bool = option(
        False,
        "hybrid mode: the table has no row count (ps/embedding/dynamic.py): rows are made on the shards at first "
        "touch, ids hashed to shards; a fixed table is sized for every id the run draws")
    embedding_ttl_steps: int = option(
        0, "dynamic table: evict a row untouched for this many table steps (0 = never)")
    embedding_min_count: int = option(
        0, "dynamic table: frequency filter, make a row only at its Nth sighting (0 or 1 = the first)")
    sparse_embeddings: bool = option(
        False,
        "allreduce mode, ctr workload: nn.Embedding(sparse=True) tables, their sparse gradients reduced by DDP over "
        "gloo and stepped by a sparse optimizer (bench compare's ddp:sparse; SparseAdam for adam)")
    ddp_checkpoint_dir: str = option(
        "",
        "--mode allreduce: resume from the checkpoint here if there is one, and rank 0 writes one (model, optimizers, "
        "step, training clock, evaluations) every --ddp-checkpoint-every steps — what a DDP job restarted by "
        "torchrun's elastic agent needs (bench compare's ddp-elastic); empty = off")
    ddp_checkpoint_every: int = option(16, "--mode allreduce with --ddp-checkpoint-dir: steps between checkpoints")
    torchrec_sharding: str = option(
        "auto",
        "--mode torchrec: how TorchRec's planner shards the tables — auto (its own choice) or the type it must use: "
        "table_wise, column_wise, table_column_wise (TorchRec 1.8 shards CPU tables no other way)")
    worker_memory_limit: str = option(
        "",
        "the worker caps the memory it allocates (RLIMIT_DATA: heap and private mappings, i.e. tensors and optimizer "
        "state; not code or shared libraries) at this size, e.g. 1GiB, before it builds the model: a "
        "model that does not fit fails with a clear error instead of taking the host down; empty = no limit")
    # ---- pipeline parallelism (worker/trainers/pipeline.py, docs/hybrid.md) ----
    pipeline_stages: int = option(2, "pipeline mode: stages per pipeline replica (workers must be a multiple of it)")
    microbatches: int = option(4, "pipeline mode: micro-batches per step (must divide --batch-size)")
    pipeline_schedule: str = option("gpipe", "pipeline mode: schedule, gpipe or 1f1b")
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """The config's own rules. The rules of a mode and of what it trains live in their registries
        (worker.trainers.strategy.check_job)."""
        from deltaps.sync import parse_sync
        parse_sync(self.sync)
        if self.device not in DEVICES:
            raise ValueError(f"unknown --device {self.device!r}; use one of {', '.join(DEVICES)}")
        if self.worker_memory_limit:
            if parse_bytes(self.worker_memory_limit) < 1 << 28:     # below 256 MiB not even torch imports
                raise ValueError(f"--worker-memory-limit {self.worker_memory_limit} is below 256MiB")
        self._validate_eval()
        self.straggler_of(0)
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use sgd or adam")
        for name in ("servers", "workers", "steps", "batch_size", "hidden", "layers", "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        lo, hi = self.min_workers or 1, self.max_workers or self.workers
        if not 1 <= lo <= self.workers <= hi:
            raise ValueError(f"want 1 <= --min-workers {lo} <= --workers {self.workers} <= --max-workers {hi}")
        if not 0 < self.timeout_s < float("inf"):      # a wait, and the end-of-job stack dump's delay (faulthandler)
            raise ValueError(f"--timeout-s must be a positive, finite number of seconds, got {self.timeout_s}")
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {self.bucket_bytes}")
        if not (self.heartbeat_s == -1 or 0 <= self.heartbeat_s < float("inf")):
            raise ValueError(f"--heartbeat-s must be -1 (auto), 0 (off) or a number of seconds, got {self.heartbeat_s}")
        self._validate_local_updates()
        from deltaps.layout import role_for_buffers
        role_for_buffers(self.buffer_sync)
        from compression import get_codec
        from deltaps.pull_codec import resolve_pull_codec
        get_codec(self.codec)
        resolve_pull_codec(self.pull_codec, self.codec)

    def _validate_local_updates(self) -> None:
        if self.local_steps < 0 or self.stream_fragments < 1:
            raise ValueError(f"want --local-steps >= 0 and --stream-fragments >= 1, got {self.local_steps} and "
                             f"{self.stream_fragments}")
        if self.stream_fragments > 1 and not self.local_steps:
            raise ValueError("--stream-fragments needs --local-steps > 0")
        from deltaps.optimizer_config import outer_optimizer_config, overlap_steps
        if self.overlap_steps != -1:
            if not self.local_steps:
                raise ValueError("--overlap-steps needs --local-steps > 0")
            overlap_steps(self.local_steps, self.stream_fragments, self.overlap_steps)
        outer_optimizer_config(self.outer_optimizer, self.outer_lr, self.outer_momentum, self.pull_residual)
        if self.pull_residual != "auto" and not (self.local_steps and self.mode == "ps"):
            raise ValueError(f"--pull-residual {self.pull_residual} needs --mode ps --local-steps > 0: it says where "
                             f"an outer step starts (there is no outer step without local updates on the shards)")

    @property
    def heartbeat(self) -> float:
        """Seconds between a PS worker's heartbeats (0: none): --heartbeat-s, where -1 means 0.5 under --sync quorum
        (a round must not wait long for the dead) and off otherwise (--worker-timeout alone evicts)."""
        if self.heartbeat_s != -1:
            return self.heartbeat_s
        return 0.5 if self.sync.startswith("quorum") else 0.0

    def straggler_of(self, rank: int) -> float:
        """The compute slow-down factor of `rank` under --straggler (1.0: not the straggler)."""
        if not self.straggler:
            return 1.0
        who, factor = parse_straggler(self.straggler, max(self.workers, self.max_workers))
        return factor if who == rank else 1.0

    def _validate_eval(self) -> None:
        if self.eval_every < 0 or not 0.0 <= self.target_accuracy <= 1.0 or not 0.0 <= self.target_auc <= 1.0:
            raise ValueError(f"want --eval-every >= 0 and targets in [0, 1], got --eval-every {self.eval_every}, "
                             f"--target-accuracy {self.target_accuracy}, --target-auc {self.target_auc}")
        if self.target_loss < 0:
            raise ValueError(f"want --target-loss >= 0, got {self.target_loss}")
        for flag, target in (("--target-accuracy", self.target_accuracy), ("--target-auc", self.target_auc),
                             ("--target-loss", self.target_loss)):
            if target and not self.eval_every:
                raise ValueError(f"{flag} needs --eval-every N (the evaluations that can reach it)")
        if self.eval_split not in ("test", "validation"):
            raise ValueError(f"--eval-split must be test or validation, got {self.eval_split!r}")
        if not 0 <= self.common_step <= self.steps:
            raise ValueError(f"want 0 <= --common-step <= --steps {self.steps}, got {self.common_step}")
        if self.common_step and not self.eval_every:
            raise ValueError("--common-step needs --eval-every N (the evaluations it waits for)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


WORKER_EXCLUDED = ("servers", "workers")  # a worker gets addresses and --world-size instead


def add_train_args(p: argparse.ArgumentParser, exclude: tuple = ()) -> None:
    p.add_argument("--config", help="YAML file with any of the keys below (flags override it)")
    for f in fields(TrainConfig):
        if f.name == "extra" or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            cast = f.metadata["parse"] or {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            p.add_argument(flag, dest=f.name, type=cast, default=None, help=help_text)


def load_config(path: str | None, overrides: dict | None = None) -> TrainConfig:
    cfg = TrainConfig()
    known = {f.name: f for f in fields(TrainConfig)}
    if path:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        unknown = set(data) - set(known)
        if unknown:
            raise ValueError(f"{path}: unknown config keys: {', '.join(sorted(unknown))}")
        for k, v in data.items():
            parse = known[k].metadata.get("parse")
            setattr(cfg, k, parse(v) if parse else v)   # YAML sizes may be spelled '4MiB' too
    for k, v in (overrides or {}).items():
        if v is not None and k in known:
            setattr(cfg, k, v)
    cfg.validate()
    return cfg


def save_config(cfg: TrainConfig, path: str) -> None:
    """cfg as a YAML file load_config reads back (a child process's --config); `extra` is in-process only."""
    with open(path, "w") as fh:
        yaml.safe_dump({k: v for k, v in cfg.to_dict().items() if k != "extra"}, fh)


def config_from_args(args: argparse.Namespace, exclude: tuple = ()) -> TrainConfig:
    return load_config(getattr(args, "config", None), {k: v for k, v in vars(args).items() if k not in exclude})


def parse_straggler(text: str, workers: int) -> tuple[int, float]:
    """--straggler RANK:FACTOR -> (rank, factor) of a job of `workers` ranks; ValueError names what is wrong."""
    who, _, factor = text.partition(":")
    try:
        who, factor = int(who), float(factor)
    except ValueError:
        who, factor = -1, 0.0
    if not (0 <= who < workers and 1.0 <= factor < float("inf")):
        raise ValueError(f"bad --straggler {text!r}: want RANK:FACTOR, a rank of the job (0 .. "
                         f"{workers - 1}) and a factor >= 1, e.g. 3:2")
    return who, factor
