"""Shard checkpoints: atomic (temp file, fsync, rename), checksummed, newest valid one wins.

File layout: MAGIC (8 bytes) | sha256 of body (32) | body length (8, little endian) | body (torch.save).
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import struct

import torch

log = logging.getLogger("deltaps.checkpoint")
MAGIC = b"DPSCKPT1"
_NAME = re.compile(r"^shard(\d+)-(\d{10})\.ckpt$")


class CheckpointError(RuntimeError):
    pass


def _path(directory: str, shard_id: int, seq: int) -> str:
    return os.path.join(directory, f"shard{shard_id}-{seq:010d}.ckpt")


def list_checkpoints(directory: str, shard_id: int) -> list[tuple[int, str]]:
    """(seq, path) of this shard's checkpoint files, newest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m and int(m.group(1)) == shard_id:
            found.append((int(m.group(2)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def write_checkpoint(directory: str, shard_id: int, state: dict, keep: int = 3) -> str:
    """Write state atomically as the next checkpoint; prune all but the newest `keep`."""
    os.makedirs(directory, exist_ok=True)
    existing = list_checkpoints(directory, shard_id)
    seq = existing[0][0] + 1 if existing else 1
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    path = _path(directory, shard_id, seq)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(body).digest() + struct.pack("<Q", len(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    for _, old in list_checkpoints(directory, shard_id)[keep:]:
        os.remove(old)
    return path


def read_checkpoint(path: str) -> dict:
    """Load one checkpoint; CheckpointError if it is truncated or its checksum does not match."""
    with open(path, "rb") as f:
        head = f.read(48)
        if len(head) < 48 or head[:8] != MAGIC:
            raise CheckpointError(f"{path}: not a deltaps checkpoint or truncated header")
        digest, (length,) = head[8:40], struct.unpack("<Q", head[40:48])
        body = f.read()
    if len(body) != length:
        raise CheckpointError(f"{path}: truncated ({len(body)} of {length} body bytes)")
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt)")
    return torch.load(io.BytesIO(body), weights_only=True)


def intact_checkpoints(directory: str, shard_id: int):
    """(state, path) of each checkpoint that reads back intact, newest first; corrupt ones are skipped with a
    log line."""
    for _, path in list_checkpoints(directory, shard_id):
        try:
            state = read_checkpoint(path)
        except (CheckpointError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            log.error("skipping checkpoint %s: %s; trying the previous one", path, e)
            continue
        yield state, path


def load_latest(directory: str, shard_id: int) -> tuple[dict, str] | None:
    """Newest checkpoint that reads back intact (None when there is none)."""
    return next(intact_checkpoints(directory, shard_id), None)
