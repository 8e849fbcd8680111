# deltaps — setup / demo / test / bench / proto
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTO_SRC := protos/deltaps.proto
PROTO_OUT := protos/deltaps_pb2.py protos/deltaps_pb2_grpc.py

.PHONY: setup demo test test-unit lint bench bench-peers bench-peers-quick proto clean prometheus kubectl advise-validate gpu-check

setup: $(STAMP) $(PROTO_OUT)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,peers]'
	touch $(STAMP)

# the one protoc recipe (protos/build.py; the Dockerfiles and the first import of `protos` run it too)
proto: $(STAMP)
	$(BIN)/python protos/build.py

$(PROTO_OUT): $(PROTO_SRC) | $(STAMP)
	$(MAKE) proto

demo: setup
	$(BIN)/deltaps launch --config configs/demo.yaml --json demo-summary.json

# ruff first (lint + import order, configured in pyproject.toml), then every test
test: setup lint prometheus kubectl
	$(BIN)/python -m pytest -q --durations=15

# tests/unit: no sockets, no processes; under a minute
test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .

# Real Prometheus + promtool for tests/rpc/test_metrics.py and tests/cluster/test_metrics_prometheus.py (Debian package). Never fails the build: without
# it those tests skip and say why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  ( $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	      --no-install-recommends prometheus ) >/dev/null 2>&1 \
	  && echo "make prometheus: installed $$(prometheus --version 2>&1 | head -1)" \
	  || echo "make prometheus: could not install the prometheus package; the Prometheus tests will skip"; }

# kubectl (with its built-in kustomize) for tests/deploy, Debian package; never fails the build: without
# it the manifest-rendering tests skip and say why.
kubectl:
	@command -v kubectl >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  ( $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	      --no-install-recommends kubectl ) >/dev/null 2>&1 \
	  && echo "make kubectl: installed $$(kubectl version --client 2>&1 | head -1)" \
	  || echo "make kubectl: could not install the kubectl package; the manifest tests will skip"; }

bench: setup
	$(BIN)/deltaps bench codecs --size 16MiB --json bench-codecs.json
	# short allreduce-vs-PS comparison on 1 Gbit/s namespace links (loopback when not root); a few minutes
	$(BIN)/deltaps bench compare --workers 4 --bandwidth 1gbit --hidden 1024 --steps 30 \
		--modes allreduce,ps:none,ps:int8,ps:topk:ratio=0.01 --json bench-compare.json --plot bench-compare.png

# time to accuracy against the DDP peers (docs/compare.md#time-to-accuracy): every mode races to 90 % test
# accuracy on the clf workload (MLP 64-768x2-10), at 1 Gbit/s and at 100 Mbit/s; ~14 minutes here, root for the
# shaped links. BENCH_PEERS_EXTRA: more mode specs, comma-separated (the best deltaps local-update modes).
BENCH_PEERS_EXTRA ?= ps-local8:int8,ps-local32:int8,ps-local32x4:int8,ps-local32x4o4:int8
# torchft's own DiLoCo / Streaming DiLoCo (docs/compare.md#torchft-the-diloco-peer): the peer for slow links
TORCHFT_PEERS = torchft:diloco:sync=8,torchft:diloco:sync=32,torchft:diloco:sync=32:fragments=2:delay=4,torchft:localsgd:sync=32
BENCH_PEERS_MODES = ddp,ddp:fp16,ddp:bf16,ddp:powersgd:rank=4,ddp:localsgd:period=8,ddp:localsgd:period=32,$(TORCHFT_PEERS),ps:int8,ps:topk:ratio=0.01,$(BENCH_PEERS_EXTRA)
bench-peers: setup
	$(BIN)/deltaps bench compare --workers 4 --workload clf --eval-every 10 --target-accuracy 0.9 --steps 600 \
		--bandwidth 1gbit --modes $(BENCH_PEERS_MODES) --json bench-peers-1gbit.json --plot bench-peers-1gbit.png
	$(BIN)/deltaps bench compare --workers 4 --workload clf --eval-every 10 --target-accuracy 0.9 --steps 600 \
		--bandwidth 100mbit --modes $(BENCH_PEERS_MODES) --json bench-peers-100mbit.json --plot bench-peers-100mbit.png

# the race in a few minutes: one seed, clf, 100 Mbit/s, fp32 DDP, the best DDP hook and torchft peers, the best deltaps modes
bench-peers-quick: setup
	$(BIN)/deltaps bench compare --workers 4 --workload clf --eval-every 10 --target-accuracy 0.9 --steps 600 \
		--bandwidth 100mbit --modes ddp,ddp:localsgd:period=32,torchft:diloco:sync=32,torchft:diloco:sync=32:fragments=2:delay=4,ps-local32:int8,ps-local32x4o4:int8 \
		--json bench-peers-quick.json --plot bench-peers-quick.png

# deltaps advise: predicted vs measured step time on the bench compare grid (2 and 4 workers x 100mbit,
# 1gbit, 10gbit x 4 modes; needs root for the shaped namespaces; ~25 minutes; reports kept in /tmp/deltaps-advise-validate)
advise-validate: setup
	$(BIN)/python -m deltaps.tools.advise validate --workers 2,4 --bandwidths 100mbit,1gbit,10gbit --steps 30 --dir /tmp/deltaps-advise-validate

# The GPU path end to end on a machine with a CUDA GPU (docs/gpu.md; ~5 minutes on one H200): the gpu extra
# (cupy) unless a cupy build is already there, then one script (deltaps/tools/gpu_check.py: pytest -m gpu, bench
# codecs on the GPU, GPU launches against CPU ones, NCCL ddp), everything in gpu-check/. GPU_PY: an interpreter that
# already has a CUDA torch (a CUDA image's python3), used instead of .venv (whose torch comes from `make setup`).
GPU_PY ?=
GPU_CHECK_ARGS ?= --out gpu-check
GPU_PYTHON = $(or $(GPU_PY),$(BIN)/python)
gpu-check: $(if $(GPU_PY),,setup)
	$(if $(GPU_PY),$(GPU_PY) -m pip install -q --no-build-isolation -e '.[check]')
	$(GPU_PYTHON) -m deltaps.tools.gpu_check --cupy-present || $(GPU_PYTHON) -m pip install -q -e '.[gpu]'
	$(GPU_PYTHON) -m deltaps.tools.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
