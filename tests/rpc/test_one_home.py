"""Rules that used to be written twice now have one home; these pin every user to it.

The cost model (deltaps/tools/costmodel.py) predicts what the runtime does; here the runtime runs for
real (a DistributedOptimizer against loopback shards) and the model's figures must equal what it did.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compression.base import available_codecs
from deltaps import units
from deltaps.cli import build_parser
from deltaps.config import load_config
from deltaps.layout import build_layout
from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import resolve_pull_codec
from deltaps.tools import costmodel as cm
from worker.client import PSClient
from worker.optimizer import DistributedOptimizer
from worker.workloads.mlp import make_mlp

HIDDEN, LAYERS = 96, 2


@pytest.mark.parametrize("bucket_bytes,chunk_bytes,shards", [(25 << 20, 4 << 20, 2), (16 << 10, 8 << 10, 3),
                                                              (0, 4 << 20, 2), (40 << 10, 8 << 10, 2)])
def test_cost_model_buckets_and_rpcs_equal_the_runtime(cluster_factory, bucket_bytes, chunk_bytes, shards):
    cluster = cluster_factory(shards)
    model = make_mlp(64, HIDDEN, LAYERS, 10, seed=0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, servers=cluster.addrs,
                               bucket_bytes=bucket_bytes, chunk_bytes=chunk_bytes, max_message_bytes=4 * chunk_bytes + (1 << 20),
                               timeout_s=20.0)
    try:
        tensors = cm.mlp_tensors(HIDDEN, LAYERS)
        assert [n for n, _ in tensors] == [n for n, _ in model.named_parameters()]
        assert cm.buckets(tensors, bucket_bytes) == opt.buckets
        job = cm.Job(tensors, workers=1, shards=shards, chunk_bytes=chunk_bytes, bucket_cap_bytes=bucket_bytes,
                     max_message_bytes=4 * chunk_bytes + (1 << 20))
        assert job.fused_bytes == opt.client.fused_bytes
        layout = build_layout([(n, k, "float32") for n, k in tensors], shards, chunk_bytes)
        assert layout == opt.client.layout
        before = opt.client.stats.snapshot().get("push_pull_rpcs", 0)
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sent = opt.client.stats.snapshot()["push_pull_rpcs"] - before
        assert sent == sum(cm.fused_rpcs(tensors, layout, shards, bucket_bytes, job.fused_bytes))
    finally:
        opt.client.close()


def test_message_limits_have_one_home():
    with pytest.raises(ValueError, match="too large for max message"):
        PSClient(["127.0.0.1:1"], 0, 1, optimizer=OptimizerConfig("sgd", lr=0.1), chunk_bytes=40 << 20,
                 max_message_bytes=64 << 20)


def test_auto_pull_codec_is_the_runtime_rule():
    for name in available_codecs():
        spec = "topk:ratio=0.01" if name in ("topk", "randk", "dgc") else name
        assert cm.pull_codec_for(spec) == resolve_pull_codec("auto", spec), spec


@pytest.mark.parametrize("spelling", ["64MB", "64MiB", "64M", "64mb", "67108864"])
def test_byte_sizes_parse_the_same_everywhere(spelling, tmp_path):
    want = 64 << 20
    assert units.parse_bytes(spelling) == want
    p = build_parser()
    assert p.parse_args(["launch", "--bucket-bytes", spelling]).bucket_bytes == want
    assert p.parse_args(["worker", "--chunk-bytes", spelling]).chunk_bytes == want
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"max_message_bytes: {spelling}\nbucket_bytes: '{spelling}'\n")
    c = load_config(str(cfg))
    assert c.max_message_bytes == want and c.bucket_bytes == want
    from deltaps.tools.bench_codecs import main as bench_main  # --size goes through the same parser
    assert bench_main(["--size", "4KB", "--codecs", "none", "--repeats", "1", "--json", str(tmp_path / "b.json")]) in (0, None)
    import json
    assert json.loads((tmp_path / "b.json").read_text())["size_bytes"] == 4096


def test_rates_and_durations():
    assert units.parse_rate("1gbit") == 1e9 and units.parse_rate("50mbit") == 50e6 and units.parse_rate("10mbps") == 80e6
    assert units.parse_time_ms("500us") == 0.5 and units.parse_time_ms("2s") == 2000.0
    for bad, fn in (("fast", units.parse_rate), ("64X", units.parse_bytes), ("soon", units.parse_time_ms)):
        with pytest.raises(ValueError):
            fn(bad)
