"""Generated gRPC code for protos/deltaps.proto (built by `make proto`; generated on first import if missing)."""
import os as _os

_HERE = _os.path.dirname(_os.path.abspath(__file__))


def _generate() -> None:
    from grpc_tools import protoc  # dev dependency; `make setup` installs it

    rc = protoc.main(["protoc", f"-I{_HERE}", f"--python_out={_HERE}", f"--grpc_python_out={_HERE}",
                      _os.path.join(_HERE, "deltaps.proto")])
    if rc != 0:
        raise RuntimeError("protoc failed on protos/deltaps.proto")
    path = _os.path.join(_HERE, "deltaps_pb2_grpc.py")
    with open(path) as f:
        src = f.read().replace("import deltaps_pb2 as", "from protos import deltaps_pb2 as")
    with open(path, "w") as f:
        f.write(src)


if not _os.path.exists(_os.path.join(_HERE, "deltaps_pb2_grpc.py")):
    _generate()

from protos import deltaps_pb2 as pb  # noqa: E402
from protos import deltaps_pb2_grpc as rpc  # noqa: E402

PROTOCOL_VERSION = 1
__all__ = ["pb", "rpc", "PROTOCOL_VERSION"]
