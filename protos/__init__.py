"""Generated gRPC code for protos/deltaps.proto (built by protos/build.py; generated on first import if missing)."""
import os as _os

if not _os.path.exists(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "deltaps_pb2_grpc.py")):
    from protos import build as _build  # written last by the recipe: its absence means "not generated"
    _build.generate()

from protos import deltaps_pb2 as pb  # noqa: E402
from protos import deltaps_pb2_grpc as rpc  # noqa: E402

PROTOCOL_VERSION = 2   # 2: key roles (model buffers), elastic worker bounds, live sets in replies
__all__ = ["pb", "rpc", "PROTOCOL_VERSION"]
