"""Every worker-side client opens its shard channels through one factory (deltaps.transport.client_channels),
so their gRPC options cannot drift apart: the embedding client once copied PSClient's channel setup without
the quick reconnect, and gRPC's default backoff grew to minutes after a shard restart."""
from deltaps.embedding import TableSpec
from deltaps.optimizer_config import OptimizerConfig
from deltaps.security import Security
from deltaps.transport import RECONNECT_OPTIONS, grpc_options
from worker.client import PSClient
from worker.embedding import EmbeddingClient

SERVERS = ["127.0.0.1:1", "127.0.0.1:2"]   # never called: building a client only opens (lazy) channels
MAX_MESSAGE = 32 << 20


class RecordingSecurity:
    """Plaintext Security that records the (target, options) of every channel a client opens."""

    def __init__(self):
        self.opened: list[tuple[str, list]] = []

    def channel(self, target, options=()):
        self.opened.append((target, list(options)))
        return Security().channel(target, options)


def _opened(make) -> list[tuple[str, list]]:
    security = RecordingSecurity()
    make(security).close()
    return security.opened


def test_ps_and_embedding_clients_open_their_channels_alike():
    ps = _opened(lambda sec: PSClient(SERVERS, 0, 1, optimizer=OptimizerConfig("sgd", lr=0.1), security=sec,
                                      max_message_bytes=MAX_MESSAGE))
    emb = _opened(lambda sec: EmbeddingClient(SERVERS, 0, 1, [TableSpec("emb", 100, 4, "sgd", lr=0.1)],
                                              security=sec, max_message_bytes=MAX_MESSAGE))
    assert [t for t, _ in ps] == [t for t, _ in emb] == SERVERS
    assert ps == emb
    for _, options in emb:
        assert set(grpc_options(MAX_MESSAGE)) <= set(options)
        assert set(RECONNECT_OPTIONS) <= set(options)   # the embedding client's backoff stays bounded too
