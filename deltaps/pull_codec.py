"""Compressed pulls: the shard serves each new version as a compressed delta against a shared view.

All workers of a job hold the same "view" of a key (the sum of the deltas they were sent). When the
key's version advances, the shard compresses `value - view` once, adds its decoded form to the view and
serves that one payload to every worker that holds the previous version; the error it leaves stays in
`value - view` and is sent with later deltas (error feedback for free). A worker further behind, or a
new one, gets the whole view — unless it offers the digest of the values it already holds (values_digest,
PullRequest.have_digests) and they are the bytes the whole view would carry: then nothing is sent. So workers
built from the job's seed do not download the model rank 0 just uploaded (at 10 Mbit/s, 2 s per 2.6 MB model
and worker, before their clocks start: the spread it left between the ranks' starts was waited out in the first
round). `exact` pulls (final evaluation, checkpoints) always get the true value.
"""
from __future__ import annotations

import hashlib

import torch

from compression import get_codec
from compression.base import Codec, CodecError, parse_spec

FULL, DELTA, UNCHANGED = 0, 1, 2
DIGEST_BYTES = 16


def values_digest(values: torch.Tensor) -> bytes:
    """The digest a worker offers for the float32 values it holds of a key, and the shard compares with the
    values a full answer would carry (BLAKE2b: ~1 GB/s, so a 2.6 MB model costs ~3 ms on either side)."""
    flat = values.detach().reshape(-1).to("cpu", torch.float32).contiguous()
    return hashlib.blake2b(memoryview(flat.numpy()).cast("B"), digest_size=DIGEST_BYTES).digest()


def own_view(named) -> dict[str, torch.Tensor]:
    """The shared view a worker starts from, name -> flat float32 CPU copy of its own values: where they are the
    job's (a model built from its seed, as rank 0's), its first delta pull offers their digests and downloads nothing."""
    return {n: t.detach().reshape(-1).to("cpu", torch.float32, copy=True) for n, t in named}


def offered_digests(held: list[torch.Tensor | None]) -> list[bytes]:
    """PullRequest.have_digests: per key the values_digest of the values a worker holds (None: no offer; nor for a
    buffer not float32, which a full answer would overwrite with rounded values); [] when no key has one."""
    digests = [values_digest(t) if t is not None and t.dtype == torch.float32 else b"" for t in held]
    return digests if any(digests) else []


# 'auto': a deterministic codec (the shared view gives error feedback): casts stay casts, everything
# else int8. Sparse or 1-bit parameter deltas cost accuracy: `bench compare` on the 4.3M-parameter MLP,
# 40 steps, lost 7.8 points with topk pushes + sign pulls vs +0.3 with int8 pulls.
AUTO = {"none": "none", "fp16": "fp16", "bf16": "bf16"}
# a round codec (local-update jobs) pulls as it pushes (what the view leaves behind: resolve_pull_residual)
ROUND_CODECS = ("chunktopk", "lowrank", "lowbit")
# ... and those of them whose pulls drop what they leave behind under 'auto' (measured per codec, below)
DROP_UNDER = ("chunktopk",)


def resolve_pull_residual(pull_residual: str, pull_spec: str, local_updates: bool = True) -> str:
    """carry or drop, for a job's outer steps under the pull codec in force (OptimizerConfig.pull_residual). 'auto':
    drop in a local-update job pulling through chunktopk, whose sparse pulls leave most of a step behind (measured on
    clf, chunktopk 1/8: +1 to +4 points on the workers' view; x2.04 vs x1.90 sooner than torchft's best at 10 Mbit/s,
    3 seeds); else carry, the down-link's error feedback (measured equal under int8; better under lowrank rank 16:
    91.1 vs 89.2 % at step 512, clf validation, 3 seeds, +1.1 to +1.9 per seed, docs/local-updates.md) — always
    where steps are gradients (OptimizerConfig.from_torch says carry)."""
    if pull_residual != "auto":
        return pull_residual
    return "drop" if local_updates and parse_spec(pull_spec or "none")[0] in DROP_UNDER else "carry"


def matrix_codec(push_codec: str, pull_codec: str) -> Codec | None:
    """The codec whose way the job's layout cuts matrices (Codec.matrix_keys): the push codec, else the pull codec;
    None: flat keys."""
    push, pull = get_codec(push_codec or "none"), get_codec(resolve_pull_codec(pull_codec, push_codec))
    return push if push.matrix_keys else (pull if pull.matrix_keys else None)


def resolve_pull_codec(pull_codec: str, push_codec: str) -> str:
    """The pull codec in force for a given push codec ('auto' follows it, see AUTO)."""
    spec = (pull_codec or "auto").strip()
    if spec == "auto":
        name = parse_spec(push_codec)[0]
        return get_codec(push_codec).spec() if name in ROUND_CODECS else AUTO.get(name, "int8")
    if get_codec(spec).stateful:
        raise CodecError(f"pull codec {spec!r} is stateful per sender; use e.g. int8, fp16, topk")
    return spec
