"""gRPC channel and server options both ends use (message limits, reconnect backoff), and the workers'
channels to the shards (client_channels)."""
from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# Reconnect quickly after a shard restarts: gRPC's default backoff grows to minutes.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


def client_channels(security, servers: list[str], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list:
    """One channel per shard, as every worker-side client (PSClient, EmbeddingClient) opens them: the message
    limits and the quick reconnect. security: a deltaps.security.Security (TLS, token)."""
    options = grpc_options(max_message_bytes) + RECONNECT_OPTIONS
    return [security.channel(s, options) for s in servers]
