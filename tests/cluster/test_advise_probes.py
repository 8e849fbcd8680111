"""deltaps advise's calibration probes against real processes (gRPC servers, gloo, network namespaces)."""

from deltaps.tools import advise, netns


def test_probes_measure_real_processes(tmp_path):
    """The gRPC and PS-step probes run real `deltaps server` + worker processes; the allreduce probe
    real gloo ranks. One round each: the minimum over rounds is a floor for the calibration, not what this checks."""
    g = advise.probe_grpc(cycles=3, big_bytes=256 << 10, codecs=["int8"], rounds=1)
    assert 0 < g["cycle_small_s"] < 5 and 0 < g["cycle_big_s"] < 5 and g["grpc_Bps"] > 0
    assert 0 < g["cycle_codec_s"]["int8"] < 5
    ar = advise.probe_allreduce(64 << 10, procs=(2,), prefix="dpst", repeats=3, rounds=1)
    assert set(ar) == {2} and 0 < ar[2] < 5
    tensors = [("w", 32 << 10), ("b", 64)]
    ps = advise.probe_ps_host(tensors, ["int8"], procs=(2,), shards=2, prefix="dpst", steps=3,
                               rounds=1)
    assert set(ps) == {"int8"} and set(ps["int8"]) == {2} and 0 < ps["int8"][2] < 5
    prof = {"model": {"grad_bytes": 4 * (32 << 10) + 256}, "ps_host_s": ps, "ps_host_shards": 2}
    cal = advise.calibration_for(prof, "1gbit", cores=2)
    assert cal.ps_host_s == ps and cal.ps_host_shards == 2
    assert netns.list_leftovers("dpst") == {"netns": [], "links": []}      # namespaces torn down
