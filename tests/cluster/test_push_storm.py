"""Push storm: 16 concurrent workers against a real server process (asp, SGD lr=1), with injected client-side
resends of already-delivered pushes. The final state is exactly init - sum(acknowledged pushes) / W."""
import random
import threading
import time

import pytest
import torch
from helpers import client, start_program

from deltaps.optimizer_config import OptimizerConfig
from deltaps.tools.launch import free_port
from deltaps.wire import chunk_from_tensor
from protos import pb

pytestmark = pytest.mark.slow
W, N, SECONDS = 16, 256, 8.0


def _grad(r: int, step: int) -> torch.Tensor:
    """Small integers: every partial sum / 16 is exact in float32, so the check can be exact."""
    j = torch.arange(N)
    return (((r * 7 + step * 3 + j) % 5) - 2).to(torch.float32)


def test_push_storm_exactly_once(tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        srv = start_program(["server", "--port", str(port), "--shard-id", "0", "--num-shards", "1", "--worker-timeout",
                             "0"], log)
    try:
        init = torch.arange(N, dtype=torch.float32)
        clients = [client([addr], r, W, sync="asp", opt=OptimizerConfig("sgd", lr=1.0), reconnect_deadline_s=30)
                   for r in range(W)]
        clients[0].setup([("w", init)])
        for cl in clients[1:]:
            cl.setup([("w", init)])
        acked = [torch.zeros(N, dtype=torch.float64) for _ in range(W)]
        counts = [{"acked": 0, "resent": 0} for _ in range(W)]
        stop = time.monotonic() + SECONDS
        errors = []

        def storm(r):
            cl, rng = clients[r], random.Random(r)
            key = cl.by_param["w"][0].key
            step = 0
            try:
                while time.monotonic() < stop:
                    g = _grad(r, step)
                    req = pb.PushRequest(worker_id=r, step=step, seq=cl._next_seq(), grads=[chunk_from_tensor(key, g)])
                    rep = cl.sessions[0].push(req, 30.0)
                    assert list(rep.duplicate) == [False]
                    acked[r] += g.double()
                    counts[r]["acked"] += 1
                    if rng.random() < 0.25:          # a retry of a push that was in fact delivered
                        again = cl.stubs[0].Push(req, timeout=30.0)
                        assert list(again.duplicate) == [True]
                        counts[r]["resent"] += 1
                    step += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=storm, args=(r,)) for r in range(W)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 60)
        wall = time.perf_counter() - t0
        assert not errors, errors[0]
        total = sum(c["acked"] for c in counts)
        resent = sum(c["resent"] for c in counts)
        final = clients[0].pull(min_version=0)["w"]
        expected = (init.double() - sum(acked) / W).to(torch.float32)
        stats = clients[0].server_stats()[0]
        print(f"\npush storm: {W} workers, {wall:.1f}s, {total} acknowledged pushes + {resent} resends = "
              f"{(total + resent) / wall:.0f} push RPCs/s ({total / wall:.0f} applied/s); "
              f"server duplicates {stats['duplicates']}")
        assert torch.equal(final, expected)                       # 0 lost, 0 double-applied
        assert stats["duplicates"] == resent and stats["grads_applied"] == total
        assert stats["pushes"] == total + resent and total > W * 10
        for cl in clients:
            cl.close()
    finally:
        srv.terminate()
        srv.wait(10)
