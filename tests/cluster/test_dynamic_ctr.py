"""Dynamic tables end to end: `deltaps bench compare` runs the click-through model on a drifting id stream with a
fixed table (sized for every id) and dynamic ones (rows made on first touch, TTL eviction), real worker and shard
processes on loopback; and a table larger than a worker's memory limit trains through the shards while DDP, which
holds the table in every worker, fails with the allocation error."""
import json
import shutil

import pytest

from deltaps.tools import bench_compare as bc
from deltaps.tools.launch import launch
from worker.trainers.strategy import load_job

SMALL = ["--no-shaping", "--workers", "2", "--servers", "2", "--batch-size", "64", "--hidden", "16",
         "--embedding-dim", "8"]


def test_ttl_eviction_holds_the_rows_flat_on_a_drifting_stream_where_a_fixed_table_grows(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bc.main([*SMALL, "--steps", "120", "--embedding-rows", "20000", "--id-drift", "0.5", "--drift-every", "20",
                  "--eval-every", "20", "--modes", "hybrid,hybrid:dynamic,hybrid:dynamic:ttl=20", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    modes = json.loads(out.read_text())["modes"]
    live = {spec: [p["table_rows_live"] for p in m["evals"]] for spec, m in modes.items()}
    fixed, dyn, ttl = live["hybrid"], live["hybrid:dynamic"], live["hybrid:dynamic:ttl=20"]
    assert len(fixed) == 6 and fixed == sorted(fixed) and fixed[-1] > 2.5 * fixed[0]      # every id seen stays
    # without eviction a dynamic table holds what a fixed one does (at the end; during the run the other workers'
    # pulls of the next step may be in or not when rank 0 reads the count)
    assert modes["hybrid:dynamic"]["shard_rows_held"] == modes["hybrid"]["shard_rows_held"]
    assert all(abs(d - f) < 0.1 * f for d, f in zip(dyn, fixed))
    assert max(ttl[2:]) < 1.3 * min(ttl[2:]) and ttl[-1] < 0.5 * fixed[-1]                # flat
    # same init (a row's init is a function of its id), same updates: no eviction -> the same model
    assert modes["hybrid:dynamic"]["final_test_auc"] == pytest.approx(modes["hybrid"]["final_test_auc"], abs=1e-6)
    assert modes["hybrid:dynamic:ttl=20"]["final_test_auc"] == pytest.approx(modes["hybrid"]["final_test_auc"], abs=0.02)
    assert modes["hybrid"]["shard_table_bytes"] > modes["hybrid:dynamic:ttl=20"]["shard_table_bytes"]


def _job(mode: str, limit: str) -> dict:
    # 2M x 64 floats: 488 MiB of values + as much Adagrad state in every DDP worker, more than `limit` leaves
    return dict(mode=mode, workload="ctr", workers=2, servers=2, steps=6, batch_size=64, hidden=16,
                embedding_rows=2_000_000, embedding_dim=64, worker_memory_limit=limit, progress=False, timeout_s=60.0)


LIMIT = "1GiB"     # data memory: a hybrid worker of this job allocates ~0.5 GiB


def test_a_table_past_the_worker_memory_limit_trains_through_the_shards():
    summary = launch(load_job(None, _job("hybrid", LIMIT)), quiet=True)
    assert summary["steps"] == 6 and 0.4 < summary["per_worker"][0]["final_test_auc"] <= 1.0
    assert max(w["peak_rss_bytes"] for w in summary["per_worker"]) < 2 << 30
    with pytest.raises(RuntimeError, match="(?s)worker.*failed.*out of memory \\(--worker-memory-limit 1GiB\\)") as e:
        launch(load_job(None, _job("allreduce", LIMIT)), quiet=True)
    shutil.rmtree(str(e.value).split("(logs in ")[1].split(")")[0])    # the failed job's directory, kept for its logs
