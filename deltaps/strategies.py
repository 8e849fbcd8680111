"""Training-mode specs: the one grammar of `deltaps bench compare --modes`, `deltaps advise --strategies` and the
cost model's strategies (deltaps/tools/costmodel.py), and of DDP comm-hook specs (`--ddp-hook`, `ddp:<hook>`).

Mode specs (`parse_mode_spec`; the first colon separates the head from its argument):
  ddp | allreduce                       fp32 DDP: torch's default averaging allreduce
  ddp:<hook>                            DDP with one of torch's comm hooks (hook specs below)
  ddp:sparse[:fp16|bf16]                DDP with nn.Embedding(sparse=True) tables (--sparse-embeddings, --workload
                                        ctr), its dense buckets optionally through the fp16 / bf16 hook
  ddp-elastic[:fp16|bf16]               DDP as a user runs it on a failing cluster: under torchrun's elastic agent
                                        (restarts every rank when one dies), resuming from rank 0's checkpoint
                                        (--ddp-checkpoint-dir; bench compare launches it so)
  ps[:<codec>] | ps-bsp[:<codec>]       synchronous PS, gradients through the codec (default none; the codec spec
                                        is all that follows the first colon: ps:topk:ratio=0.01 -> topk:ratio=0.01)
  ps-asp[:<codec>]                      asynchronous PS
  ... [:shards=N]                       (ps, ps-asp, ps-local) bench compare: this mode's PS shard count, at most
                                        --servers (fewer shard processes: less CPU beside the workers)
  ps-local<H>[x<F>][o<tau>][q<Q>][:<codec>][:grace=G][:late=W][:inner=I][:<outer>]
                                        PS local updates: --local-steps H, --stream-fragments F, --overlap-steps
                                        tau (docs/local-updates.md), the deltas through the codec; q<Q>: quorum
                                        rounds, --sync quorum:Q[:grace=G][:late=equal|discount][:inner=fixed|adaptive]
  hybrid[:fp16|bf16][:dynamic[:ttl=N][:min_count=M]]
                                        embeddings row-sparse on the PS, the dense part allreduced (--workload
                                        ctr), optionally through the fp16 / bf16 hook; dynamic: tables without a
                                        row count (--embedding-dynamic), rows evicted after N idle table steps
                                        (--embedding-ttl-steps), made at their Mth sighting (--embedding-min-count)
  torchft:diloco:sync=H[:fragments=F][:delay=tau][:alpha=a][:wire=fp32|fp16|bf16][:min_replicas=N][:timeout=S][:<outer>]
                                        the peer: torchft's own DiLoCo (F > 1: Streaming DiLoCo, fragment delay
                                        tau, default 0; alpha: its fragment_update_alpha, default 0; wire: the
                                        dtype its pseudo-gradients are allreduced in, default fp32), the same
                                        outer optimizer settings as the ps-local modes; min_replicas: its
                                        quorum's minimum (default every worker), timeout: its Manager / gloo
                                        timeout in seconds (default the job's --timeout)
  torchft:localsgd:sync=H               torchft's LocalSGD (the models averaged every H steps)
  torchrec[:fp16|bf16][:sharding=S]     the embedding peer: TorchRec's DistributedModelParallel (--workload ctr),
                                        its dense DDP part optionally through the fp16 / bf16 hook; S: the
                                        sharding its planner must use (--torchrec-sharding; default its choice)
<outer> (local-update specs, any order among the parameters): outer=avg|sgd|nesterov, outer_lr=x,
outer_momentum=m — this mode's outer optimizer (--outer-optimizer / --outer-lr / --outer-momentum), else the
job's: ps-local32:int8:outer=avg, torchft:diloco:sync=32:outer_lr=0.7:outer_momentum=0.9; ps-local specs also
pull_residual=auto|carry|drop (--pull-residual: where an outer step starts under a lossy pull codec).
`ModeSpec.overrides()` gives the TrainConfig fields a spec sets; `str(ModeSpec)` its canonical spelling
(fp32 DDP is `allreduce`, as the cost model and `deltaps advise` name it). In a comma-separated list
(`split_mode_specs`) an item with `=` and no `:` continues the previous spec (ps:topk:ratio=0.01,chunk=4096).

Hook specs (`parse_ddp_hook`, `HookSpec`): their grammar is deltaps/hook_specs.py, re-exported here;
worker/trainers/ddp_hooks.py builds and runs the hooks. This module imports nothing of deltaps' packages but
the leaves deltaps.hook_specs, deltaps.optimizer_config and deltaps.sync.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from deltaps.hook_specs import HOOK_FORMS, LOCALSGD_START, POWERSGD_START, HookSpec, parse_ddp_hook
from deltaps.optimizer_config import OUTER_OPTIMIZERS, PULL_RESIDUALS
from deltaps.sync import parse_sync

__all__ = ["MODES", "FAMILIES", "MODE_FORMS", "HOOK_FORMS", "ModeSpec", "parse_mode_spec", "split_mode_specs",
           "ps_codecs", "HookSpec", "parse_ddp_hook", "POWERSGD_START", "LOCALSGD_START", "TORCHREC_SHARDINGS"]

MODES = ("ps", "allreduce", "hybrid", "pipeline", "torchft", "torchrec")     # TrainConfig.mode: the bare training modes
FAMILIES = ("ddp", "ps", "hybrid", "torchft", "torchrec")       # what a mode spec names (bench compare runs these)
PEER_FAMILIES = ("ddp", "torchft", "torchrec")                  # what users run instead of deltaps: the race's peers
HALF_HOOKS = ("fp16", "bf16")                         # the hooks ddp:sparse's and hybrid's dense buckets take
MODE_FORMS = ("ddp[:<hook>|:sparse[:fp16|bf16]] (or allreduce), ddp-elastic[:fp16|bf16], ps:<codec>, ps-asp:<codec>, "
              "ps-local<H>[x<F>][o<tau>][q<Q>]:<codec>[:grace=G][:outer=..], hybrid[:fp16|bf16][:dynamic[:ttl=N][:min_count=M]], "
              "torchft:diloco:sync=H[:fragments=F][:delay=tau][:alpha=a][:wire=fp32|fp16|bf16][:outer=..] "
              "or torchft:localsgd:sync=H, torchrec[:fp16|bf16][:sharding=S]")
TORCHFT_KEYS = {"sync": "local_steps", "fragments": "stream_fragments", "delay": "overlap_steps",
                "min_replicas": "min_replicas"}
OUTER_KEYS = {"outer": "outer_optimizer", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
              "pull_residual": "pull_residual"}
OUTER_ITEM = re.compile(r"(?:^|[:,])(outer(?:_lr|_momentum)?|pull_residual)=([^:,]*)")
TORCHREC_SHARDINGS = ("table_wise", "column_wise", "table_column_wise")   # torchrec:sharding= (CPU: no row-wise)
WIRE_DTYPES = ("fp32", "fp16", "bf16")     # torchft:diloco's wire=: the dtype its pseudo-gradients are allreduced in
LOCAL_HEAD = re.compile(r"ps-local(\d+)(?:x(\d+))?(?:o(\d+))?(?:q(\d+))?")
QUORUM_ITEM = re.compile(r"(?:^|[:,])(grace|late|inner)=([^:,]*)")
SHARDS_ITEM = re.compile(r"(?:^|[:,])shards=([^:,]*)")


@dataclass(frozen=True)
class ModeSpec:
    family: str                          # FAMILIES
    sync: str = "bsp"                    # ps: bsp | asp | quorum:Q:grace=G (ps-local<H>q<Q>)
    codec: str = "none"                  # ps: the codec spec, as written (compression/)
    local_steps: int | None = None       # ps-local<H>: inner steps per PS round (None: not a local-update mode)
    stream_fragments: int = 1            # ps-local<H>x<F>
    overlap_steps: int | None = None     # ps-local<H>o<tau> (None: TrainConfig's default, -1)
    ddp_hook: str | None = None          # ddp / hybrid: the canonical hook spec (None: DDP's default allreduce)
    algorithm: str | None = None         # torchft: diloco | localsgd
    sparse_embeddings: bool = False      # ddp:sparse
    elastic: bool = False                # ddp-elastic: under torchrun's elastic restarts, from checkpoints
    outer_optimizer: str | None = None   # local updates: this mode's outer optimizer (None: the job's)
    outer_lr: float | None = None
    outer_momentum: float | None = None
    pull_residual: str | None = None     # ps-local pull_residual= (None: the job's --pull-residual)
    fragment_alpha: float | None = None  # torchft:diloco alpha= (fragment_update_alpha; None: torchft's 0)
    wire_dtype: str | None = None        # torchft:diloco wire= (None: fp32)
    min_replicas: int | None = None      # torchft min_replicas= (None: every worker)
    ft_timeout_s: float | None = None    # torchft timeout= seconds (None: the job's --timeout)
    dynamic_table: bool = False          # hybrid:dynamic
    sharding: str | None = None          # torchrec:sharding=S (None: the planner's choice)
    ttl_steps: int = 0                   # hybrid:dynamic:ttl=N
    min_count: int = 0                   # hybrid:dynamic:min_count=M
    shards: int | None = None            # ps families' shards=N (None: bench compare's --servers)
    text: str = field(default="", compare=False)     # the spec as written

    def outer_overrides(self) -> dict:
        """The outer-optimizer TrainConfig fields this spec sets (none: the job's)."""
        return {f: getattr(self, f) for f in OUTER_KEYS.values() if getattr(self, f) is not None}

    def outer_text(self) -> str:
        return "".join(f":{k}={getattr(self, f)}" for k, f in OUTER_KEYS.items() if getattr(self, f) is not None)

    def overrides(self) -> dict:
        """The TrainConfig fields this spec sets."""
        hook = {"ddp_hook": self.ddp_hook} if self.ddp_hook else {}
        if self.family == "ddp":
            return {"mode": "allreduce", **({"sparse_embeddings": True} if self.sparse_embeddings else {}), **hook}
        if self.family in ("hybrid", "torchrec"):
            table = {"embedding_dynamic": True, "embedding_ttl_steps": self.ttl_steps,
                     "embedding_min_count": self.min_count} if self.dynamic_table else {}
            table.update({"torchrec_sharding": self.sharding} if self.sharding else {})
            return {"mode": self.family, "sync": "bsp", "codec": "none", "workload": "ctr", **hook, **table}
        if self.family == "torchft":
            extra = {k: v for k, v in (("torchft_alpha", self.fragment_alpha), ("torchft_wire", self.wire_dtype),
                                       ("torchft_min_replicas", self.min_replicas), ("torchft_timeout_s", self.ft_timeout_s))
                     if v is not None}
            return {"mode": "torchft", "sync": "bsp", "torchft_algorithm": self.algorithm, "local_steps": self.local_steps,
                    "stream_fragments": self.stream_fragments, "overlap_steps": self.overlap_steps or 0,
                    **extra, **self.outer_overrides()}
        out = {"mode": "ps", "sync": self.sync, "codec": self.codec}
        if self.local_steps is not None:
            out.update(local_steps=self.local_steps, stream_fragments=self.stream_fragments,
                       overlap_steps=-1 if self.overlap_steps is None else self.overlap_steps, **self.outer_overrides())
        return out

    def __str__(self) -> str:
        hook = f":{self.ddp_hook}" if self.ddp_hook else ""
        if self.family == "ddp":
            if self.elastic:
                return f"ddp-elastic{hook}"
            return f"ddp:sparse{hook}" if self.sparse_embeddings else f"ddp{hook}" if hook else "allreduce"
        if self.family in ("hybrid", "torchrec"):
            table = ":dynamic" * self.dynamic_table + f":ttl={self.ttl_steps}" * bool(self.ttl_steps) \
                + f":min_count={self.min_count}" * bool(self.min_count) + f":sharding={self.sharding}" * bool(self.sharding)
            return f"{self.family}{hook}{table}"
        if self.family == "torchft":
            extra = "".join(f":{k}={v}" for k, v in (("fragments", self.stream_fragments), ("delay", self.overlap_steps))
                            if v and (k != "fragments" or v != 1))
            extra += f":alpha={self.fragment_alpha}" if self.fragment_alpha is not None else ""
            extra += f":wire={self.wire_dtype}" if self.wire_dtype is not None else ""
            extra += f":min_replicas={self.min_replicas}" if self.min_replicas is not None else ""
            extra += f":timeout={self.ft_timeout_s:g}" if self.ft_timeout_s is not None else ""
            return f"torchft:{self.algorithm}:sync={self.local_steps}{extra}{self.outer_text()}"
        shards = f":shards={self.shards}" if self.shards else ""
        if self.local_steps is None:
            return f"{'ps-asp' if self.sync == 'asp' else 'ps'}:{self.codec}{shards}"
        fragments = f"x{self.stream_fragments}" if self.stream_fragments != 1 else ""
        overlap = f"o{self.overlap_steps}" if self.overlap_steps is not None else ""
        quorum, grace = "", ""
        if self.sync.startswith("quorum:"):
            _, q, grace = self.sync.split(":", 2)
            quorum, grace = f"q{q}", f":{grace}"
        return f"ps-local{self.local_steps}{fragments}{overlap}{quorum}:{self.codec}{grace}{self.outer_text()}{shards}"


def parse_mode_spec(text: str) -> ModeSpec:
    """A mode spec (the grammar above) -> ModeSpec; ValueError naming the spec and the accepted forms."""
    head, _, arg = text.strip().partition(":")
    if head in ("ddp", "allreduce"):
        try:
            return ModeSpec("ddp", **_ddp_fields(arg), text=text)
        except ValueError as e:
            raise ValueError(f"mode {text!r}: {e}") from None
    if head == "ddp-elastic":
        if arg not in ("", *HALF_HOOKS):
            raise ValueError(f"mode {text!r}: ddp-elastic takes fp16 or bf16 (hooks without state of their own, which "
                             f"a checkpoint would miss), or nothing")
        return ModeSpec("ddp", ddp_hook=arg or None, elastic=True, text=text)
    local = LOCAL_HEAD.fullmatch(head)
    if head in ("ps", "ps-bsp", "ps-asp") or local:
        arg, shards = _shards_field(arg, text)
    codec, outer = _outer_fields(arg, text)
    if head in ("ps", "ps-bsp", "ps-asp"):
        if outer:
            raise ValueError(f"mode {text!r}: outer optimizer settings need a local-update mode (ps-local<H>)")
        return ModeSpec("ps", sync="asp" if head == "ps-asp" else "bsp", codec=arg or "none", shards=shards, text=text)
    if local:
        codec, sync = _quorum_sync(local[4], codec, text)
        return ModeSpec("ps", sync=sync, codec=codec or "none", local_steps=int(local[1]), stream_fragments=int(local[2] or 1),
                        overlap_steps=int(local[3]) if local[3] else None, shards=shards, text=text, **outer)
    if head == "torchrec":
        items = [i for i in arg.split(":") if i]
        hook = items.pop(0) if items and items[0] in HALF_HOOKS else None
        sharding = items.pop(0).partition("=")[2] if items and items[0].startswith("sharding=") else None
        if items or (sharding is not None and sharding not in TORCHREC_SHARDINGS):
            raise ValueError(f"mode {text!r}: torchrec takes fp16 or bf16 (a DDP hook for its dense part), then "
                             f"sharding={'|'.join(TORCHREC_SHARDINGS)}")
        return ModeSpec(head, ddp_hook=hook, sharding=sharding, text=text)
    if head == "hybrid":
        return _hybrid_spec(arg, text)
    if head == "torchft":
        return _torchft_spec(arg, text)
    raise ValueError(f"unknown mode spec {text!r}; use {MODE_FORMS}")


def _outer_fields(arg: str, text: str) -> tuple[str, dict]:
    """A local-update spec's argument -> (the rest, its outer=/outer_lr=/outer_momentum= items as ModeSpec fields)."""
    fields = {}
    for key, value in OUTER_ITEM.findall(arg):
        try:
            fields[OUTER_KEYS[key]] = value if key in ("outer", "pull_residual") else float(value)
        except ValueError:
            raise ValueError(f"mode {text!r}: {key} must be a number, got {value!r}") from None
        if key == "outer" and value not in OUTER_OPTIMIZERS:
            raise ValueError(f"mode {text!r}: outer must be {', '.join(OUTER_OPTIMIZERS[:-1])} or {OUTER_OPTIMIZERS[-1]}, "
                             f"got {value!r}")
        if key == "pull_residual" and value not in PULL_RESIDUALS:
            raise ValueError(f"mode {text!r}: pull_residual must be {' or '.join(PULL_RESIDUALS)}, got {value!r}")
    return OUTER_ITEM.sub("", arg).lstrip(":,"), fields


def _shards_field(arg: str, text: str) -> tuple[str, int | None]:
    """A PS spec's argument -> (the rest, its shards=N or None)."""
    items = SHARDS_ITEM.findall(arg)
    if not items:
        return arg, None
    if len(items) > 1 or not items[0].isdigit() or int(items[0]) < 1:
        raise ValueError(f"mode {text!r}: shards= takes one positive integer, got {', '.join(items)}")
    return SHARDS_ITEM.sub("", arg).lstrip(":,"), int(items[0])


def _quorum_sync(quorum: str | None, arg: str, text: str) -> tuple[str, str]:
    """A local-update spec's q<Q>, grace=G, late=W and inner=I -> (the rest of its argument, its sync mode's canonical
    spelling)."""
    items = QUORUM_ITEM.findall(arg)
    if items and not quorum:
        raise ValueError(f"mode {text!r}: {items[0][0]}= needs quorum rounds (ps-local<H>q<Q>)")
    if not quorum:
        return arg, "bsp"
    try:
        sync = parse_sync(f"quorum:{quorum}" + "".join(f":{k}={v}" for k, v in items))
    except ValueError as e:
        raise ValueError(f"mode {text!r}: {e}") from None
    return QUORUM_ITEM.sub("", arg).lstrip(":,"), str(sync)


def _hybrid_spec(arg: str, text: str) -> ModeSpec:
    """`hybrid[:fp16|bf16][:dynamic[:ttl=N][:min_count=M]]`."""
    items = [i for i in arg.split(":") if i]
    hook = items.pop(0) if items and items[0] in HALF_HOOKS else None
    table: dict = {}
    for item in items:
        key, eq, value = item.partition("=")
        if item == "dynamic":
            table["dynamic_table"] = True
        elif eq and key in ("ttl", "min_count") and value.isdigit():
            table["ttl_steps" if key == "ttl" else "min_count"] = int(value)
        else:
            raise ValueError(f"mode {text!r}: hybrid takes fp16 or bf16 (a DDP hook for its dense part), then "
                             f"dynamic[:ttl=N][:min_count=M], not {item!r}")
    if (table.get("ttl_steps") or table.get("min_count")) and not table.get("dynamic_table"):
        raise ValueError(f"mode {text!r}: ttl= and min_count= apply to a dynamic table (hybrid:dynamic:ttl=N)")
    return ModeSpec("hybrid", ddp_hook=hook, text=text, **table)


def _torchft_spec(arg: str, text: str) -> ModeSpec:
    """`torchft:<algorithm>:sync=H[:fragments=F][:delay=tau][:alpha=a][:wire=dtype][:outer=..]`."""
    algorithm, _, rest = arg.partition(":")
    if algorithm not in ("diloco", "localsgd"):
        raise ValueError(f"mode {text!r}: torchft runs diloco or localsgd, e.g. torchft:diloco:sync=32")
    rest, fields = _outer_fields(rest, text)
    if "pull_residual" in fields:
        raise ValueError(f"mode {text!r}: torchft has no compressed pull view; pull_residual is for ps-local modes")
    if fields and algorithm == "localsgd":
        raise ValueError(f"mode {text!r}: torchft:localsgd averages the models: it has no outer optimizer")
    allowed = "sync=H, min_replicas=N (integers), timeout=S" if algorithm == "localsgd" else (
        "sync=H, fragments=F, delay=tau, min_replicas=N (integers), alpha=a in [0, 1], wire=fp32|fp16|bf16, timeout=S")
    for item in filter(None, rest.replace(",", ":").split(":")):
        key, _, value = item.partition("=")
        if algorithm == "diloco" and key == "wire" and value in WIRE_DTYPES:
            fields["wire_dtype"] = value
        elif algorithm == "diloco" and key == "alpha" and _fraction(value) is not None:
            fields["fragment_alpha"] = _fraction(value)
        elif key == "timeout" and _positive(value) is not None:
            fields["ft_timeout_s"] = _positive(value)
        elif key not in TORCHFT_KEYS or not value.isdigit() or (algorithm == "localsgd" and key not in ("sync", "min_replicas")):
            raise ValueError(f"mode {text!r}: torchft:{algorithm} takes {allowed}, not {item!r}")
        else:
            fields[TORCHFT_KEYS[key]] = int(value)
    if "local_steps" not in fields:
        raise ValueError(f"mode {text!r}: torchft:{algorithm} needs sync=H (a sync every H inner steps)")
    return ModeSpec("torchft", algorithm=algorithm, text=text, **fields)


def _positive(value: str) -> float | None:
    """value as a float > 0 (finite), else None."""
    try:
        x = float(value)
    except ValueError:
        return None
    return x if 0 < x < float("inf") else None


def _fraction(value: str) -> float | None:
    """A number in [0, 1] (torchft's fragment_update_alpha), or None."""
    try:
        v = float(value)
    except ValueError:
        return None
    return v if 0.0 <= v <= 1.0 else None


def _ddp_fields(arg: str) -> dict:
    """`ddp:<arg>`: a comm hook, or `sparse[:fp16|bf16]` (not a hook: DDP's default allreduce with sparse
    embedding gradients through gloo's sparse allreduce, its dense buckets optionally through fp16 / bf16)."""
    first, _, hook = arg.strip().lower().partition(":")
    if first == "sparse":
        if hook not in ("", *HALF_HOOKS):
            raise ValueError(f"ddp:sparse takes fp16 or bf16 for its dense buckets, got {arg!r}")
        return {"sparse_embeddings": True, "ddp_hook": hook or None}
    hook = str(parse_ddp_hook(arg or "none"))
    return {"ddp_hook": None if hook == "none" else hook}


def split_mode_specs(text: str) -> list[str]:
    """'allreduce,ps:topk:ratio=0.01,chunk=4096,ps:int8' -> the specs, stripped, empty items dropped; an item
    with '=' and no ':' continues the previous spec (a codec or hook parameter)."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def ps_codecs(specs) -> list[str]:
    """The codec specs the PS specs among `specs` use, each once, in order."""
    parsed = (parse_mode_spec(s) for s in specs)
    return list(dict.fromkeys(m.codec for m in parsed if m.family == "ps"))
