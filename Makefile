# deltaps — setup / demo / test / bench / proto
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTO_SRC := protos/deltaps.proto
PROTO_OUT := protos/deltaps_pb2.py protos/deltaps_pb2_grpc.py

.PHONY: setup demo test bench proto clean

setup: $(STAMP) $(PROTO_OUT)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --grpc_python_out=protos $(PROTO_SRC)
	sed -i 's/^import deltaps_pb2 as/from protos import deltaps_pb2 as/' protos/deltaps_pb2_grpc.py

$(PROTO_OUT): $(PROTO_SRC) | $(STAMP)
	$(MAKE) proto

demo: setup
	$(BIN)/deltaps launch --config configs/demo.yaml --json demo-summary.json

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/deltaps bench codecs --size 16MiB --json bench-codecs.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
