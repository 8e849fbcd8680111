"""Chaos in hybrid mode with real processes: kill -9 an embedding shard mid-run, restart it with --restore on
the same port; training completes and the embedding rows, the dense (DDP) parameters, the losses and the CTR
AUC equal those of the same job without the crash (bsp)."""
import json
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from helpers import server_proc, start_program

from deltaps.tools.launch import free_port
from protos import pb, rpc
from ps.checkpoint import load_latest

pytestmark = pytest.mark.slow
STEPS, KILL_AT = 40, 14
JOB = ["--mode", "hybrid", "--workload", "ctr", "--steps", str(STEPS), "--batch-size", "64", "--embedding-rows",
       "20000", "--embedding-dim", "8", "--hidden", "32", "--layers", "1", "--timeout-s", "60",
       "--reconnect-deadline-s", "60", "--no-progress"]
SERVER = ["--checkpoint-every-steps", "5", "--embedding-memory-cap", "64MiB", "--worker-timeout", "30"]


def _emb_version(addr):
    try:
        rep = rpc.ParameterServerStub(grpc.insecure_channel(addr)).EmbeddingStats(pb.EmbeddingStatsRequest(),
                                                                                timeout=2)
    except grpc.RpcError:
        return None
    return json.loads(rep.json)["version"]


def _wait(cond, what, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        time.sleep(0.01)
    raise TimeoutError(what)


def _run(tmp: Path, kill_at=None):
    """2 shards + 2 hybrid workers; optionally kill -9 shard 1 once its tables reached version kill_at and
    restart it from its checkpoints. Returns (worker results, {shard: final checkpoint}, dense state, outage)."""
    tmp.mkdir()
    logs = {n: open(tmp / f"{n}.log", "a") for n in ("server0", "server1", "server1-restored", "worker0", "worker1")}
    ports = [free_port(), free_port()]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    ckpt = tmp / "ckpt"
    procs = []
    try:
        servers = [server_proc(i, ports[i], logs[f"server{i}"], *SERVER, "--checkpoint-dir", str(ckpt)) for i in range(2)]
        procs += servers
        master = str(free_port())
        save = ["--save-model", str(tmp / "model.pt")]       # rank 0's dense parameters
        workers = [start_program(["worker", "--servers", ",".join(addrs), "--rank", str(r), "--world-size", "2",
                                  "--master-addr", "127.0.0.1", "--master-port", master, "--result-json",
                                  str(tmp / f"w{r}.json"), *JOB, *(save if r == 0 else [])], logs[f"worker{r}"])
                   for r in range(2)]
        procs += workers
        outage = None
        if kill_at is not None:
            seen = []

            def due() -> bool:      # a kill before shard 1's first checkpoint leaves nothing to restore (found once)
                has_checkpoint = any(ckpt.glob("shard1-*.ckpt"))    # looked at first: its version <= the one read next
                seen.append(_emb_version(addrs[1]) or 0)
                return has_checkpoint and seen[-1] >= kill_at
            _wait(due, f"shard 1 at version {kill_at} with a checkpoint written")
            servers[1].send_signal(signal.SIGKILL)
            servers[1].wait(10)
            t_kill = time.monotonic()
            servers[1] = server_proc(1, ports[1], logs["server1-restored"], *SERVER, "--restore", str(ckpt))
            procs.append(servers[1])
            _wait(lambda: (_emb_version(addrs[1]) or 0) > kill_at, "training to move on after the restart")
            outage = (seen[-1], time.monotonic() - t_kill)
        for w in workers:
            assert w.wait(120) == 0, _tail(tmp)
        for s in servers:                       # SIGTERM: a final checkpoint of every shard
            s.send_signal(signal.SIGTERM)
            assert s.wait(30) == 0, _tail(tmp)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs.values():
            f.close()
    results = [json.loads((tmp / f"w{r}.json").read_text()) for r in range(2)]
    final = {i: load_latest(str(ckpt), i)[0] for i in range(2)}
    dense = torch.load(tmp / "model.pt", weights_only=True)
    return results, final, dense, outage


def _tail(tmp):
    return "\n".join(f"--- {f.name}\n" + "".join(f.read_text().splitlines(True)[-15:]) for f in sorted(tmp.glob("*.log")))


def _rows(final):
    """{global row id: (value, adagrad state)} of the table over both shards' final checkpoints."""
    out = {}
    for state in final.values():
        t = state["embedding"]["tables"]["emb"]
        for k, i in enumerate(t["ids"].tolist()):
            out[i] = (t["values"][k], t["state"][0][k])
    return out


def test_kill9_an_embedding_shard_mid_run_and_restore_it(tmp_path):
    t0 = time.monotonic()
    ref, ref_final, ref_dense, _ = _run(tmp_path / "ref")
    got, final, dense, outage = _run(tmp_path / "crash", kill_at=KILL_AT)
    took = time.monotonic() - t0
    ref_rows, rows = _rows(ref_final), _rows(final)
    diff_rows = max(max((a - b).abs().max().item() for a, b in zip(rows[i], ref_rows[i])) for i in ref_rows)
    diff_dense = max((dense[k] - ref_dense[k]).abs().max().item() for k in ref_dense)
    auc, ref_auc = got[0]["final_test_auc"], ref[0]["final_test_auc"]
    log = (tmp_path / "crash" / "server1-restored.log").read_text()
    wlog = "".join((tmp_path / "crash" / f"worker{r}.log").read_text() for r in range(2))
    restored_at = int(re.search(r"embedding tables at version (\d+)", log).group(1))
    replayed = [int(n) for n in re.findall(r"replaying (\d+) buffered embedding pushes", wlog)]
    print(f"\nhybrid, 2 shards x 2 workers, {STEPS} bsp steps; shard 1 kill -9 at embedding version {outage[0]}, "
          f"restored from its checkpoint at version {restored_at}; pushes replayed per worker {replayed}; "
          f"training moved on after {outage[1]:.2f}s")
    print(f"embedding rows compared: {len(rows)} (reference {len(ref_rows)}), max |diff| value/adagrad state "
          f"{diff_rows:g}; dense tensors compared: {len(dense)}, max |diff| {diff_dense:g}")
    print(f"test AUC {auc:.6f} (without the crash {ref_auc:.6f}); final train loss {got[0]['final_train_loss']:.6f} "
          f"(without {ref[0]['final_train_loss']:.6f}); versions {[s['embedding']['version'] for s in final.values()]}; "
          f"both runs took {took:.1f}s")
    assert "restored from" in log and restored_at <= outage[0] and len(replayed) == 2
    assert wlog.count("restarted (server_id") == 2, wlog     # each worker replayed to the restored shard
    assert all(s["embedding"]["version"] == STEPS for s in final.values())
    assert rows.keys() == ref_rows.keys() and diff_rows == 0.0     # 0 lost, 0 applied twice: bit-identical
    assert dense.keys() == ref_dense.keys() and diff_dense == 0.0
    for r in range(2):
        assert got[r]["losses"] == ref[r]["losses"], r
    assert auc == ref_auc and 0.5 < auc <= 1.0
