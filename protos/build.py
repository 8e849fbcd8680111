"""The one protoc recipe: generate deltaps_pb2.py / deltaps_pb2_grpc.py next to deltaps.proto.

`make proto`, both Dockerfiles and the first import of `protos` (when the generated files are missing)
all run this: `python protos/build.py` (a plain script, so the package is not imported half-built).
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATED = ("deltaps_pb2.py", "deltaps_pb2_grpc.py")


def generated() -> bool:
    return all(os.path.exists(os.path.join(HERE, f)) for f in GENERATED)


def generate() -> None:
    from grpc_tools import protoc  # build-time dependency (dev extra; the Dockerfiles install it)

    rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={HERE}", f"--grpc_python_out={HERE}",
                      os.path.join(HERE, "deltaps.proto")])
    if rc != 0:
        raise RuntimeError("protoc failed on protos/deltaps.proto")
    # protoc writes a top-level `import deltaps_pb2`; the generated module lives in the protos package.
    path = os.path.join(HERE, "deltaps_pb2_grpc.py")
    with open(path) as f:
        src = f.read().replace("import deltaps_pb2 as", "from protos import deltaps_pb2 as")
    with open(path, "w") as f:
        f.write(src)


if __name__ == "__main__":
    generate()
    print("protos: generated " + ", ".join(GENERATED))
