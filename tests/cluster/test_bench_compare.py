"""Namespace/tbf network builder and `deltaps bench compare`."""
import importlib.util
import json
import subprocess
import tempfile
import time

import pytest

from deltaps.tools import bench_compare as bc
from deltaps.tools import netns
from deltaps.tools.bench_nodes import Nodes, topology_nodes

OK, WHY = netns.shaping_available()
needs_root = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
TORCHFT = importlib.util.find_spec("torchft") is not None      # the optional `peers` extra
TEST_PREFIX = "dpst"        # not the bench's prefix, so a running bench is never touched


def test_parse_rate_and_modes():
    assert bc.parse_mode("allreduce") == {"mode": "allreduce"}
    assert bc.parse_mode("ps") == {"mode": "ps", "sync": "bsp", "codec": "none"}
    assert bc.parse_mode("ps:topk:ratio=0.01")["codec"] == "topk:ratio=0.01"     # first colon only
    assert bc.parse_mode("ps-asp:int8") == {"mode": "ps", "sync": "asp", "codec": "int8"}
    with pytest.raises(ValueError):
        bc.parse_mode("horovod")


def test_model_sizing():
    assert bc.mlp_params(256, 2) == 85002          # what worker.workloads.mlp.make_mlp builds
    h = bc.hidden_for_params(4_000_000, 2)
    assert bc.mlp_params(h, 2) >= 4_000_000 > bc.mlp_params(h - 1, 2)


@needs_root
def test_namespace_link_is_shaped_and_torn_down():
    netns.cleanup(TEST_PREFIX)
    subprocess.run(["ip", "netns", "add", f"{TEST_PREFIX}-7"], check=True)      # a "crashed run" leftover
    topo = netns.Topology(2, rate="50mbit", prefix=TEST_PREFIX)
    try:
        topo.up()
        assert f"{TEST_PREFIX}-7" not in netns.list_leftovers(TEST_PREFIX)["netns"]   # stale one removed
        assert any("leftovers" in n for n in topo.notes)
        bps = netns.measure_throughput(topo, 0, 1, nbytes=3 << 20, port=5301)
        assert 0.5 * 50e6 <= bps <= 1.2 * 50e6, f"{bps / 1e6:.1f} Mbit/s through a 50mbit link"
        back = netns.measure_throughput(topo, 1, 0, nbytes=3 << 20, port=5302)       # other direction too
        assert 0.5 * 50e6 <= back <= 1.2 * 50e6, f"{back / 1e6:.1f} Mbit/s"
        tx, rx = topo.link_bytes(0)
        assert tx > 3 << 20 and rx > 3 << 20
        with pytest.raises(netns.PrefixInUse):        # a live run's namespaces are never "stale"
            netns.Topology(2, rate="50mbit", prefix=TEST_PREFIX).up()
        assert len(netns.list_leftovers(TEST_PREFIX)["netns"]) == 3
    finally:
        topo.down()
    assert netns.list_leftovers(TEST_PREFIX) == {"netns": [], "links": []}


@needs_root
def test_a_small_message_after_idle_is_shaped_too():
    """A compressed round (~160 KB) sent after the link was idle takes its size / rate: the token bucket holds 1 ms
    of traffic, not 128 KiB (which sent it at 38.8 Mbit/s on a 10 Mbit/s link: rounds mostly unshaped, a megabyte
    allreduce not)."""
    with netns.Topology(2, rate="10mbit", prefix=TEST_PREFIX) as topo:
        time.sleep(1.0)                                   # idle: the bucket refills
        nbytes = 160_000
        seconds = netns.stream_seconds(topo, [(0, 1)], 5303, nbytes)[0]
        assert seconds >= 0.9 * nbytes * 8 / 10e6, f"{nbytes * 8 / seconds / 1e6:.1f} Mbit/s through a 10mbit link"


@needs_root
def test_every_node_has_a_host_name_of_its_own_that_every_node_resolves_to_its_address():
    # torchft's checkpoint server advertises gethostname(): a restarted replica heals from http://<peer's name>:port
    with netns.Topology(2, rate="50mbit", prefix=TEST_PREFIX) as topo:
        def run(node, *cmd):
            return subprocess.run(topo.exec_prefix(node) + list(cmd), capture_output=True, text=True, check=True).stdout
        assert [run(i, "hostname").strip() for i in range(2)] == [topo.ns(0), topo.ns(1)]
        assert run(1, "getent", "hosts", topo.ns(0)).split()[0] == topo.addr(0)
        assert run(0, "getent", "hosts", topo.ns(1)).split()[0] == topo.addr(1)


@needs_root
def test_topology_cleans_up_when_setup_fails():
    netns.cleanup(TEST_PREFIX)
    with pytest.raises(RuntimeError):
        with _BrokenTopology(2, rate="50mbit", prefix=TEST_PREFIX):
            pass
    assert netns.list_leftovers(TEST_PREFIX) == {"netns": [], "links": []}


class _BrokenTopology(netns.Topology):
    def _shape(self, ns, dev, netem):
        raise RuntimeError("tc exploded")


@pytest.mark.slow
def test_bench_compare_small(tmp_path, monkeypatch):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    rc = bc.main(["--workers", "2", "--servers", "2", "--steps", "15", "--hidden", "64",
                  "--modes", "allreduce,ps:int8,ps:int8:shards=1", "--bandwidth", "200mbit", "--json", str(out),
                  "--plot", str(png), "--netns-prefix", "dpsu"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["workers"] == 2 and r["bandwidth"] == "200mbit" and r["shaped"] is OK
    assert r["model_params"] == bc.mlp_params(64, 2)
    assert list(r["modes"]) == ["allreduce", "ps:int8", "ps:int8:shards=1"]
    assert [m.get("shards") for m in r["modes"].values()] == [None, 2, 1]     # shards=N: that mode's own shard count
    with pytest.raises(ValueError, match=r"shards=3 is more than --servers 2"):
        bc.main(["--workers", "2", "--servers", "2", "--modes", "ps:int8:shards=3", "--netns-prefix", "dpsu"])
    for m in r["modes"].values():
        for k in ("median_step_s", "final_test_accuracy", "bytes_per_step", "compute_share", "comm_share",
                  "wait_share", "speedup_vs_allreduce", "accuracy_delta_vs_allreduce"):
            assert k in m, k
        assert m["compute_share"] + m["comm_share"] + m["wait_share"] == pytest.approx(1.0)
    assert r["modes"]["allreduce"]["speedup_vs_allreduce"] == pytest.approx(1.0)
    assert r["modes"]["ps:int8"]["bytes_per_step"] < r["modes"]["allreduce"]["bytes_per_step"]
    if OK:
        assert r["network"]["teardown_clean"] is True
        assert netns.list_leftovers("dpsu") == {"netns": [], "links": []}
    assert png.stat().st_size > 1000
    assert not list((tmp_path / "scratch").glob("deltaps-*"))     # logs, evaluations, zygotes: removed without --keep-logs


def test_a_failed_run_keeps_its_logs_and_its_error_names_them(tmp_path, monkeypatch):
    """A shard that exits before listening fails its mode with the shard's log named (and its tail quoted); the
    scratch directory that holds the log stays though --keep-logs was not given."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spawn = Nodes.spawn

    def broken_shards(self, i, argv, *rest, **kw):
        return spawn(self, i, argv + ["--no-such-flag"] if argv[0] == "server" else argv, *rest, **kw)
    monkeypatch.setattr(Nodes, "spawn", broken_shards)
    out = tmp_path / "r.json"
    rc = bc.main(["--workers", "2", "--servers", "1", "--steps", "5", "--hidden", "64", "--modes", "ps:int8",
                  "--no-shaping", "--json", str(out)])
    assert rc == 1
    error = json.loads(out.read_text())["modes"]["ps:int8"]["error"]
    assert "server exited with code 2 before listening" in error and "--no-such-flag" in error
    log = error.split("(log ")[1].split(")")[0]
    assert log.endswith("server0.log") and "unrecognized arguments: --no-such-flag" in open(log).read()
    assert len(list(tmp_path.glob("deltaps-compare-*"))) == 1      # kept


@pytest.mark.slow
def test_bench_compare_time_to_accuracy(tmp_path):
    """Both modes race to a (low) test accuracy on the clf workload and stop there; the report leads with it."""
    out = tmp_path / "t.json"
    rc = bc.main(["--workers", "2", "--servers", "1", "--steps", "80", "--workload", "clf", "--hidden", "64",
                  "--eval-every", "5", "--target-accuracy", "0.3", "--modes", "ddp,ps:int8,ps-local6x2o2:int8,", "--no-shaping",
                  "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["target"] == 0.3 and r["best_peer"] == "ddp" and list(r["modes"]) == ["ddp", "ps:int8", "ps-local6x2o2:int8"]
    for m in r["modes"].values():
        assert m["time_to_target_s"] > 0 and 5 <= m["steps_to_target"] < 80
        assert m["steps"] == m["steps_to_target"]                  # stopped at the evaluation that reached it
        assert m["evals"][-1]["test_accuracy"] >= 0.3 > m["evals"][0]["test_accuracy"]
        assert m["evals"][-1]["time_s"] == pytest.approx(m["time_to_target_s"])
        for k in ("final_test_accuracy", "median_step_s", "bytes_per_step", "speedup_vs_best_peer", "speedup_vs_ddp"):
            assert k in m, k
    assert r["modes"]["ddp"]["speedup_vs_best_peer"] == pytest.approx(1.0)
    # a local-update job stopped at the target: its result is the global model that reached it (no flush round)
    local = r["modes"]["ps-local6x2o2:int8"]
    assert local["final_test_accuracy"] == pytest.approx(local["evals"][-1]["test_accuracy"])


def test_colocated_nodes_put_shard_i_on_worker_i_mod_w():
    net = Nodes(None, servers=3, workers=2, colocate=True)
    assert [net.host(i) for i in range(5)] == [3, 4, 3, 3, 4]
    assert [net.topology_index(i) for i in range(5)] == [0, 1, 0, 0, 1]
    apart = Nodes(None, servers=3, workers=2)
    assert [apart.topology_index(i) for i in range(5)] == [0, 1, 2, 3, 4]
    assert topology_nodes(3, 2, True) == 2 and topology_nodes(3, 2, False) == 5


@pytest.mark.slow
@needs_root
def test_bench_compare_colocated_uses_the_workers_links_only(tmp_path):
    """--colocate: 2 namespaces for 2 workers + 2 shards (+ the Lighthouse); the ps and torchft modes run there."""
    out = tmp_path / "c.json"
    modes = "ps-local4:chunktopk:density=0.125" + (",torchft:diloco:sync=4" if TORCHFT else "")
    rc = bc.main(["--workers", "2", "--servers", "2", "--steps", "12", "--workload", "clf", "--hidden", "32",
                  "--modes", modes, "--bandwidth", "200mbit", "--colocate", "--json", str(out), "--netns-prefix", "dpsc"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["network"]["colocated"] is True and r["network"]["description"].startswith("2 namespaces")
    assert all(m["steps"] == 12 for m in r["modes"].values()) and len(r["modes"]) == len(modes.split(","))
    assert r["network"]["teardown_clean"] is True and netns.list_leftovers("dpsc") == {"netns": [], "links": []}
