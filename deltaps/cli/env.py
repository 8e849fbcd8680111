"""Addresses, ranks and shard ids from flags or the environment (Kubernetes StatefulSet / Indexed Job,
torchrun); flags always win."""
from __future__ import annotations

import argparse
import os
import re


def server_list(value: str) -> list[str]:
    addrs = [a.strip() for a in value.split(",") if a.strip()]
    if not addrs:
        raise argparse.ArgumentTypeError("need at least one host:port")
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"bad server address {a!r} (want host:port)")
    return addrs


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"${name}={value!r} is not an integer") from None
    return None


def _ordinal(name: str) -> int | None:
    """Trailing ordinal of a StatefulSet pod name: 'deltaps-ps-3' -> 3; a plain integer is itself."""
    m = re.fullmatch(r"(?:.*-)?(\d+)", name.strip())
    return int(m.group(1)) if m else None


def resolve_server_env(args) -> None:
    """--shard-id / --num-shards when absent: $DELTAPS_SHARD_ID (an integer or a pod name ending in
    -<ordinal>), else the ordinal of $HOSTNAME when $DELTAPS_NUM_SHARDS is set; $DELTAPS_NUM_SHARDS."""
    if args.num_shards is None:
        args.num_shards = _env_int("DELTAPS_NUM_SHARDS")
    if args.shard_id is None:
        raw = os.environ.get("DELTAPS_SHARD_ID", "").strip()
        if raw:
            args.shard_id = _ordinal(raw)
            if args.shard_id is None:
                raise ValueError(f"$DELTAPS_SHARD_ID={raw!r}: want an integer or a name ending in -<ordinal>")
        elif os.environ.get("DELTAPS_NUM_SHARDS", "").strip():
            args.shard_id = _ordinal(os.environ.get("HOSTNAME", ""))
    if args.shard_id is None or args.num_shards is None:
        raise ValueError("server needs --shard-id and --num-shards (or $DELTAPS_SHARD_ID, a HOSTNAME ending in "
                         "-<ordinal>, and $DELTAPS_NUM_SHARDS)")


def resolve_worker_env(args) -> None:
    """--servers: $DELTAPS_SERVERS, else --servers-pattern / $DELTAPS_SERVERS_PATTERN expanded for i in
    0..num_shards-1 (--num-shards / $DELTAPS_NUM_SHARDS); --rank: $RANK, else $JOB_COMPLETION_INDEX;
    --world-size: $WORLD_SIZE; --master-addr / --master-port: $MASTER_ADDR / $MASTER_PORT, else 127.0.0.1:29500."""
    if not args.servers and os.environ.get("DELTAPS_SERVERS", "").strip():
        try:
            args.servers = server_list(os.environ["DELTAPS_SERVERS"])
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"$DELTAPS_SERVERS: {e}") from None
    pattern = args.servers_pattern or os.environ.get("DELTAPS_SERVERS_PATTERN", "").strip()
    if not args.servers and pattern:
        n = args.num_shards if args.num_shards is not None else _env_int("DELTAPS_NUM_SHARDS")
        if not n or n < 1:
            raise ValueError("--servers-pattern needs --num-shards or $DELTAPS_NUM_SHARDS")
        if "{i}" not in pattern:
            raise ValueError(f"--servers-pattern {pattern!r} must contain {{i}}")
        try:
            args.servers = server_list(",".join(pattern.replace("{i}", str(i)) for i in range(n)))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--servers-pattern: {e}") from None
    if args.rank is None:
        args.rank = _env_int("RANK", "JOB_COMPLETION_INDEX")
    if args.world_size is None:
        args.world_size = _env_int("WORLD_SIZE")
    # torch.distributed's rendezvous (torchrun's variables), for the strategies that run a process group
    args.master_addr = args.master_addr or os.environ.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    if args.master_port is None:
        args.master_port = _env_int("MASTER_PORT") or 29500
