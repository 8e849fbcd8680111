"""What a training run is given besides its TrainConfig: who it is (rank, world), where the shards and the
rendezvous are, how it talks (security, backend) and what it reports to (metrics). Built once, by the CLI
(deltaps/cli/worker.py) or a test; the loop and the strategies read it and never see argparse."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class RunContext:
    rank: int
    world_size: int
    servers: list[str] = field(default_factory=list)   # every shard's host:port, in shard order
    master_addr: str = "127.0.0.1"                      # torch.distributed rendezvous (collective strategies)
    master_port: int = 29500
    backend: str = "auto"                               # auto = nccl with CUDA, else gloo
    bucket_cap_mb: float = 25.0                         # DDP's gradient bucket size
    lighthouse: str = ""                                # torchft's Lighthouse URL (--mode torchft)
    security: Any = None                                # deltaps.security.Security; None = from the environment
    metrics: Any = None                                 # worker.metrics.WorkerMetrics, fed once per step


@dataclass(frozen=True)
class ClientOptions:
    """The connection settings every client of the shards takes from the job's config (PSClient,
    EmbeddingClient, DistributedOptimizer): one copy of the config into client arguments, here."""
    sync: str
    timeout_s: float
    max_message_bytes: int
    chunk_bytes: int
    reconnect_deadline_s: float
    replay_steps: int
    security: Any = None

    @classmethod
    def from_config(cls, cfg, security=None) -> ClientOptions:
        return cls(sync=cfg.sync, timeout_s=cfg.timeout_s, max_message_bytes=cfg.max_message_bytes,
                   chunk_bytes=cfg.chunk_bytes, reconnect_deadline_s=cfg.reconnect_deadline_s,
                   replay_steps=cfg.replay_steps, security=security)

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}   # not asdict: it deep-copies security
