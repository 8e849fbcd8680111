"""Model buffers on a shard (BatchNorm running statistics, any registered buffer): keys whose role
(deltaps/layout.py) is a buffer one. Their pushes carry the worker's current values (never compressed) and
are assigned, never given to the server optimizer:

- bsp: a step's pushes are collected in the key's aggregate like gradients and, once every live worker
  pushed, the key takes the value of the lowest-id worker that pushed (`buffer:broadcast`: rank 0's, as
  DDP's broadcast_buffers) or the mean of the pushers' values (`buffer:average`);
- asp/ssp, on arrival: broadcast takes the pushes of the lowest-id live worker and ignores the others';
  average moves the value 1/W of the way to the pushed one (W live workers: an exponential average of
  the workers' buffers, as asp scales each gradient by 1/W).

A push skipped as non-finite (--nonfinite skip) counts as the key's current value. Buffer keys have no
pull view: pulls always return their exact values. The functions run with the key's lock (ks.cond) held.
"""
from __future__ import annotations

import torch

from compression.wire import MAX_NUMEL
from deltaps.errors import ShardError
from deltaps.layout import BUFFER_ROLES, PARAM, Key
from ps.state import KeyState

AVERAGE = BUFFER_ROLES["average"]


def key_from_spec(k) -> Key:
    """A layout Key from a KeySpec message (an empty role is a parameter); unknown roles are refused."""
    role = k.role or PARAM
    if role != PARAM and role not in BUFFER_ROLES.values():
        raise ShardError("INVALID_ARGUMENT", f"key {k.key!r}: unknown role {role!r} (want {PARAM} or one of "
                                             f"{', '.join(BUFFER_ROLES.values())})")
    if not 0 <= k.numel <= MAX_NUMEL:
        raise ShardError("INVALID_ARGUMENT", f"key {k.key!r}: numel={k.numel} is not in [0, {MAX_NUMEL}]")
    if k.cols < 0 or (k.cols and (role != PARAM or k.numel % k.cols)):
        raise ShardError("INVALID_ARGUMENT", f"key {k.key!r}: cols={k.cols} must be 0 or, for a parameter, divide its "
                                             f"{k.numel} elements (whole rows of a matrix)")
    return Key(k.key, k.param, k.offset, k.numel, k.dtype, k.shard, role, k.cols)


def _add(out: torch.Tensor, g, current: torch.Tensor) -> None:
    if g is None:
        out.add_(current)
    else:
        g.add_to(out)


def take(ks: KeyState, worker: int, g) -> None:
    """bsp: fold `worker`'s pushed values (a Decoded, None if skipped) into the step's aggregate ks.agg;
    called before the worker joins ks.agg_from."""
    if ks.spec.role == AVERAGE:
        _add(ks.agg, g, ks.value)
    elif not ks.agg_from or worker < min(ks.agg_from):
        ks.agg.zero_()
        _add(ks.agg, g, ks.value)


def finish(ks: KeyState) -> None:
    """bsp: every live worker pushed this step: assign the broadcast value or the mean."""
    ks.value.copy_(ks.agg / len(ks.agg_from) if ks.spec.role == AVERAGE else ks.agg)


def assign(ks: KeyState, worker: int, g, live: set[int]) -> None:
    """asp/ssp: apply `worker`'s pushed values on arrival."""
    if g is None:
        return
    pushed = torch.zeros_like(ks.value)
    g.add_to(pushed)
    if ks.spec.role == AVERAGE:
        ks.value.add_(pushed - ks.value, alpha=1.0 / max(1, len(live)))
    elif worker <= min(live, default=worker):
        ks.value.copy_(pushed)
