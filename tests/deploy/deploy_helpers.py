"""Rendering and reading the deploy/ manifests and images for the deploy tests."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deltaps.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ["base", "overlays/cuda", "overlays/allreduce", "overlays/allreduce-cuda"]
KUBE_VERSION = "1.30.0"   # oldest version we claim (gRPC probes GA in 1.27, pod-index label 1.28)


# ---- helpers ---------------------------------------------------------------------------------------
def kubectl_path() -> str:
    exe = shutil.which("kubectl")
    if not exe:
        pytest.skip("kubectl not installed (make kubectl: apt-get install kubectl); cannot render with kustomize")
    return exe


_RENDERED: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    if overlay not in _RENDERED:
        out = subprocess.run([kubectl_path(), "kustomize", str(K8S / overlay)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _RENDERED[overlay]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind, name=None):
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"want one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def container(workload, name):
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == name)


def env_of(c) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def entrypoint_argv(c) -> list[str]:
    """What runs in the container: the image ENTRYPOINT (deltaps) + args, unless command overrides it."""
    return list(c.get("command") or ["deltaps"]) + list(c.get("args") or [])


def deltaps_args(c) -> list[str]:
    """The argv after `deltaps` (or after `torchrun ... -m ps`)."""
    argv = entrypoint_argv(c)
    if argv[0] == "deltaps":
        return argv[1:]
    if argv[0] == "torchrun":
        i = argv.index("-m")
        assert argv[i + 1] == "deltaps", argv
        return argv[i + 2:]
    raise AssertionError(f"container {c['name']} runs {argv[0]!r}, not deltaps/torchrun")


def parse(argv: list[str]):
    """deltaps.cli.build_parser() on argv; an unknown flag fails the test (argparse exits)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"deltaps rejects {argv}: exit {e.code}") from None


def flag(argv, name):
    return argv[argv.index(name) + 1]


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_port(c, name_or_number):
    for p in c.get("ports", []):
        if name_or_number in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    raise AssertionError(f"container {c['name']} has no port {name_or_number!r}")


def expand_env_refs(value: str, env: dict) -> str:
    """Kubernetes $(VAR) expansion in command/args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def pod_env(docs, c, pod_name: str, annotations: dict | None = None) -> dict:
    """The env a container gets in a pod named pod_name: values, fieldRefs, secretKeyRefs resolved."""
    out = {"HOSTNAME": pod_name}
    for name, e in env_of(c).items():
        if "value" in e:
            out[name] = e["value"]
            continue
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            if path == "metadata.name":
                out[name] = pod_name
            else:
                m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
                assert m and annotations and m.group(1) in annotations, f"unresolvable fieldRef {path}"
                out[name] = annotations[m.group(1)]
        elif "secretKeyRef" in ref:
            sec = one(docs, "Secret", ref["secretKeyRef"]["name"])
            data = sec.get("stringData") or {}
            assert ref["secretKeyRef"]["key"] in data or ref["secretKeyRef"]["key"] in sec.get("data", {})
            out[name] = data.get(ref["secretKeyRef"]["key"], "")
        else:
            raise AssertionError(f"unexpected env source {ref}")
    return out


class EnvVars:
    def __init__(self, env: dict):
        self.env, self.saved = env, None

    def __enter__(self):
        self.saved = dict(os.environ)
        for k in ("DELTAPS_SERVERS", "DELTAPS_SERVERS_PATTERN", "DELTAPS_NUM_SHARDS", "DELTAPS_SHARD_ID", "RANK",
                  "WORLD_SIZE", "JOB_COMPLETION_INDEX", "HOSTNAME"):
            os.environ.pop(k, None)
        os.environ.update(self.env)

    def __exit__(self, *exc):
        os.environ.clear()
        os.environ.update(self.saved)


# ---- Dockerfiles -------------------------------------------------------------------------------------
