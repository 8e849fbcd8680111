"""Generated gRPC code for protos/deltaps.proto (built by protos/build.py; generated on first import if missing)."""
from protos import build as _build

if not _build.generated():
    _build.generate()

from protos import deltaps_pb2 as pb  # noqa: E402
from protos import deltaps_pb2_grpc as rpc  # noqa: E402

PROTOCOL_VERSION = 1
__all__ = ["pb", "rpc", "PROTOCOL_VERSION"]
