"""The DDP peer as its users run it on a failing cluster (bench compare's `ddp-elastic`): every node's worker under
torchrun's elastic agent (c10d rendezvous), rank 0 checkpointing (worker/elastic.py). A kill -9 of a
worker's whole tree, restarted 1 s later as a supervisor would: torchrun restarts every rank, they resume from the
checkpoint, the job reaches its target, and its clock counts what the failure cost."""
import glob
import json
import shutil

import pytest

from deltaps.tools import bench_compare as bc

pytestmark = pytest.mark.slow


def test_a_killed_ddp_job_restarts_under_torchrun_resumes_and_pays_for_it(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bc.main(["--workers", "2", "--steps", "800", "--workload", "clf", "--eval-every", "16",
                  "--target-accuracy", "0.85", "--modes", "ddp-elastic", "--kill", "1@1.5:restart=1", "--no-shaping",
                  "--keep-logs", "--json", str(out)])
    assert rc == 0
    m = json.loads(out.read_text())["modes"]["ddp-elastic"]
    assert [e.get("killed") or e.get("restarted") for e in m["kills"]] == [True, True]
    assert m["time_to_target_s"] > m["healthy_time_to_target_s"] + 1.0   # the restart and the lost steps count
    assert 0 < m["goodput"] < 1
    assert m["steps"] >= m["steps_to_target"]          # every rank ran to the target's step ...
    # ... but its last incarnation trained only the steps since the checkpoint it resumed from
    assert len(m["steps_per_worker"]) == 2 and 0 < min(m["steps_per_worker"]) < m["steps_to_target"]
    logs = capsys.readouterr().out.split("logs: ")[1].split()[0]
    resumed = [path for path in glob.glob(f"{logs}/seed0faulty/ddp-elastic/worker*.log")
               if "resumed from the checkpoint" in open(path).read()]
    shutil.rmtree(logs)         # kept (--keep-logs) for this test to read
    assert resumed, "no rank resumed from the checkpoint"
