"""DDP comm-hook specs (`--ddp-hook`, bench compare's `ddp:<hook>`): the grammar, `parse_ddp_hook` -> `HookSpec`.
worker/trainers/ddp_hooks.py builds and runs the hooks; deltaps/strategies.py, the mode specs, embeds this grammar.
A leaf: it imports nothing of deltaps.

  none                          DDP's default: fp32 gradients, averaging allreduce
  fp16 | bf16                   torch's fp16_compress_hook / bf16_compress_hook (half the bytes)
  powersgd:rank=R[:start=S][:impl=auto|torch|deltaps]
                                PowerSGD (vanilla allreduce before step S, default 10, at least 2: DDP rebuilds
                                its buckets at step 1, and error feedback / warm start are kept per bucket)
  localsgd:period=H[:start=S]   torch's post-local-SGD (gradient allreduce before step S, default 1)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

POWERSGD_START = 10      # default start_powerSGD_iter (torch suggests ~10 % of the steps; >= 2 in DDP)
LOCALSGD_START = 1       # default start_localSGD_iter: step 0 allreduces gradients, local SGD from step 1 on
HOOK_FORMS = "none, fp16, bf16, powersgd:rank=R[:start=S][:impl=auto|torch|deltaps] or localsgd:period=H[:start=S]"


@dataclass(frozen=True)
class HookSpec:
    kind: str = "none"       # none | fp16 | bf16 | powersgd | localsgd
    rank: int = 1            # powersgd: matrix approximation rank
    start: int = 0           # powersgd: start_powerSGD_iter; localsgd: start_localSGD_iter
    period: int = 0          # localsgd: average the models every `period` steps
    impl: str = "auto"       # powersgd: auto | torch | deltaps

    def __str__(self) -> str:
        if self.kind == "powersgd":
            return f"powersgd:rank={self.rank}:start={self.start}" + ("" if self.impl == "auto" else f":impl={self.impl}")
        if self.kind == "localsgd":
            return f"localsgd:period={self.period}:start={self.start}"
        return self.kind


def parse_ddp_hook(spec: str | None) -> HookSpec:
    """'none' | 'fp16' | 'bf16' | 'powersgd:rank=R[:start=S][:impl=..]' | 'localsgd:period=H[:start=S]'."""
    head, *rest = re.split(r"[:,]", (spec or "none").strip().lower())
    head = {"": "none", "fp32": "none", "allreduce": "none"}.get(head, head)
    bad = f"ddp hook {spec!r}"
    allowed = {"powersgd": {"rank", "start", "impl"}, "localsgd": {"period", "start"}}.get(head)
    if head == "sparse":
        raise ValueError(f"{bad}: sparse is not a DDP comm hook; use --sparse-embeddings (bench compare's ddp:sparse)")
    if head not in ("none", "fp16", "bf16", "powersgd", "localsgd"):
        raise ValueError(f"unknown {bad}; use {HOOK_FORMS}")
    params = {}
    for item in filter(None, rest):
        key, eq, value = item.partition("=")
        if not eq or not allowed or key not in allowed:
            raise ValueError(f"{bad}: unexpected parameter {item!r}; use {HOOK_FORMS}")
        params[key] = value
    if head in ("none", "fp16", "bf16"):
        return HookSpec(head)

    def integer(key, default, low):
        try:
            v = int(params.get(key, default))
        except ValueError:
            raise ValueError(f"{bad}: {key} must be an integer, got {params[key]!r}") from None
        if v < low:
            raise ValueError(f"{bad}: {key} must be >= {low}, got {v}")
        return v
    if head == "powersgd":
        impl = params.get("impl", "auto")
        if impl not in ("auto", "torch", "deltaps"):
            raise ValueError(f"{bad}: impl must be auto, torch or deltaps, got {impl!r}")
        # >= 2: DDP rebuilds its buckets at step 1, and error feedback / warm start are kept per bucket
        return HookSpec("powersgd", rank=integer("rank", 1, 1), start=integer("start", POWERSGD_START, 2), impl=impl)
    if "period" not in params:
        raise ValueError(f"{bad}: localsgd needs period=H (average the models every H steps)")
    return HookSpec("localsgd", period=integer("period", 1, 1), start=integer("start", LOCALSGD_START, 0))
