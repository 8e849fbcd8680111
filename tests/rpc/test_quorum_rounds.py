"""Quorum rounds (--sync quorum:Q[:grace=G], ps/rounds.py) through real loopback shards: all present and no
grace = bsp; a straggler's late delta folds into the open round (nothing lost, each contribution weight 1 / the
round's contributions); the grace window; skipping to the open round; a dead worker costs its contribution;
the job stop (Stop RPC) wakes waiting pulls and travels in every pull answer."""
import threading
import time

import grpc
import pytest
import torch
from helpers import client
from test_local_updates import max_diff, train_deltaps

from deltaps.errors import PSError
from deltaps.optimizer_config import outer_optimizer_config
from protos import pb, rpc
from ps.state import KeyState

AVG = outer_optimizer_config("avg")     # SGD lr 1 on the mean delta: value -= mean, easy to follow exactly
N = 12


def test_all_present_and_no_grace_equals_bsp(cluster_factory):
    bsp, _ = train_deltaps(cluster_factory, 12, 0.1, local_steps=3, outer=AVG)
    quorum, c = train_deltaps(cluster_factory, 12, 0.1, local_steps=3, outer=AVG, sync="quorum:2:grace=0")
    assert max_diff(bsp[0], quorum[0]) == 0.0 and max_diff(quorum[0], quorum[1]) == 0.0
    st = c.shards[0].stats()
    assert st["sync"] == "quorum:2:grace=0" and st["late_contributions"] == 0
    assert st["step_contributors"][-1] == st["outer_updates"] > 0 and len(st["step_contributors"]) == 3


def test_a_long_grace_window_never_delays_a_round_everyone_is_in(cluster_factory):
    t0 = time.monotonic()
    bsp, _ = train_deltaps(cluster_factory, 12, 0.1, local_steps=3, outer=AVG)
    quorum, _ = train_deltaps(cluster_factory, 12, 0.1, local_steps=3, outer=AVG, sync="quorum:1:grace=30s")
    assert max_diff(bsp[0], quorum[0]) == 0.0
    assert time.monotonic() - t0 < 20      # no round waited for its 30 s grace window


def _job(cluster_factory, world, sync, **kw):
    c = cluster_factory(1)
    init = [("w", torch.zeros(N))]
    clients = [client(c.addrs, r, world, sync=sync, opt=AVG, local_steps=4, **kw) for r in range(world)]
    for cl in clients:
        cl.setup(init)
    return c, clients


def _value(cl) -> torch.Tensor:
    return cl.pull(min_version=0)["w"].clone()


def test_a_late_delta_folds_into_the_open_round_and_nothing_is_lost(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    d = {k: torch.full((N,), float(v)) for k, v in {"a": 1, "b": 3, "late": 8, "a1": 2, "b1": 6}.items()}
    w0.push({"w": d["a"]}, 0)
    w1.push({"w": d["b"]}, 0)               # the quorum of round 0: it closes without worker 2
    v1 = _value(w0)
    assert torch.equal(v1, -(d["a"] + d["b"]) / 2)
    w2.push({"w": d["late"]}, 0)            # worker 2's round-0 delta, late: round 1 takes it
    w0.push({"w": d["a1"]}, 1)              # its second contribution: round 1 closes with 2 of them
    v2 = _value(w0)
    assert torch.equal(v2, v1 - (d["late"] + d["a1"]) / 2)
    w1.push({"w": d["b1"]}, 1)              # late too now: round 2 opens with it
    st = c.shards[0].stats()
    # staleness = the open round - the version a delta was computed on (worker 1 never pulled: 2 rounds)
    assert st["late_contributions"] == 2 and st["max_version"] == 2 and st["staleness_counts"] == [3, 1, 1]
    # every delta is in the model or in the open round's sum, once: sent = applied means + what is pending
    ks = next(iter(c.shards[0].keys.values()))
    assert ks.agg_weight == 1.0 and torch.equal(ks.agg, d["b1"])
    for cl in (w0, w1, w2):
        cl.close()


def test_late_discount_weighs_a_late_delta_by_one_over_one_plus_its_staleness(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0:late=discount")
    w0.push({"w": torch.full((N,), 1.0)}, 0)
    w1.push({"w": torch.full((N,), 3.0)}, 0)      # round 0: mean 2
    w0.pull(min_version=1)
    w2.push({"w": torch.full((N,), 8.0)}, 0)      # computed on version 0, lands in round 1: staleness 1, weight 1/2
    w0.push({"w": torch.full((N,), 2.0)}, 1)      # on time: weight 1
    expected = -2.0 - (0.5 * 8.0 + 2.0) / 1.5     # the weighted mean of round 1
    assert torch.allclose(_value(w0), torch.full((N,), expected))
    assert c.shards[0].stats()["sync"] == "quorum:2:grace=0:late=discount"
    for cl in (w0, w1, w2):
        cl.close()


def test_a_worker_skips_to_the_open_round_but_never_past_it(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    for step in range(3):                    # workers 0 and 1 run three rounds without worker 2
        w0.push({"w": torch.ones(N)}, step)
        w1.push({"w": torch.ones(N)}, step)
    w2.pull(min_version=3)
    with pytest.raises(PSError) as e:
        w2.push({"w": torch.ones(N)}, 4)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "next step is 3" in str(e.value)
    w2.push({"w": torch.ones(N)}, 3)         # its delta lands on round 3, on time
    st = c.shards[0].stats()
    assert st["late_contributions"] == 0 and st["max_version"] == 3
    w2.push({"w": torch.ones(N)}, 3)         # a retry of an acknowledged push is a duplicate, applied once
    assert c.shards[0].stats()["duplicates"] == 1
    for cl in (w0, w1, w2):
        cl.close()


def _push_pull(cl, value: float, step: int, view: dict) -> None:
    """A round's PushPull, as a local-update worker sends it: the delta up, the next version into `view`."""
    keys = cl.keys_by_shard(["w"])[0]
    cl.push_pull_keys(0, keys, {"w": torch.full((N,), value)}, step, step + 1, view)


def test_a_worker_whose_delta_landed_late_waits_to_be_back_in_phase(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.full((N,), 3.0)}, 0)        # round 0 closes without worker 2 (quorum 2): version 1
    views = [{"w": _value(cl)} for cl in (w0, w2)]
    # worker 2's round-0 delta lands late, in round 1: worker 2 is in round 1 now, so its pull waits for round 1 to
    # close instead of handing it version 1, which the others are halfway through (trained on, its delta would land
    # late again, and so on: a round behind for good)
    late = threading.Thread(target=_push_pull, args=(w2, 8.0, 0, views[1]))
    late.start()
    time.sleep(0.5)
    assert late.is_alive() and c.shards[0].stats()["max_version"] == 1
    _push_pull(w0, 2.0, 1, views[0])                # round 1 closes: the late delta and this one
    late.join(5)
    assert not late.is_alive()
    assert torch.equal(views[1]["w"], views[0]["w"]) and torch.equal(views[0]["w"], torch.full((N,), -2.0 - 5.0))
    on_time = threading.Thread(target=_push_pull, args=(w0, 1.0, 2, views[0]))
    on_time.start()
    _push_pull(w2, 3.0, 2, views[1])                # back in phase: its round-2 delta is on time
    on_time.join(5)
    st = c.shards[0].stats()
    assert st["max_version"] == 3 and st["late_contributions"] == 1
    assert torch.equal(views[1]["w"], torch.full((N,), -7.0 - 2.0))
    for cl in (w0, w1, w2):
        cl.close()


def test_a_replayed_late_push_waits_as_the_original_did(cluster_factory):
    """A PushPull retried after its answer was lost is a duplicate push, acknowledged and not applied again; its pull
    still waits for the round the original delta landed in (handed the current model, the worker would train the
    round the others are halfway through and stay a round behind, as without realignment)."""
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.full((N,), 3.0)}, 0)        # round 0 closes without worker 2: version 1
    views = [{"w": _value(cl)} for cl in (w0, w2)]
    w2.push({"w": torch.full((N,), 8.0)}, 0)        # the original: late, in round 1; its answer never arrived
    replay = threading.Thread(target=_push_pull, args=(w2, 8.0, 0, views[1]))
    replay.start()
    deadline = time.monotonic() + 10
    while c.shards[0].stats()["duplicates"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)                                 # in its pull's wait now: it must still be there
    assert replay.is_alive() and c.shards[0].stats()["max_version"] == 1 and c.shards[0].stats()["duplicates"] == 1
    ks = next(iter(c.shards[0].keys.values()))     # where it landed survives a checkpoint and restore
    assert ks.landed == {2: 1} and KeyState.from_state_dict(ks.state_dict(), c.shards[0].job.optimizer, "none").landed == {2: 1}
    _push_pull(w0, 2.0, 1, views[0])                # round 1 closes: the late delta (once) and this one
    replay.join(5)
    assert not replay.is_alive()
    assert torch.equal(views[1]["w"], views[0]["w"]) and torch.equal(views[0]["w"], torch.full((N,), -2.0 - 5.0))
    # back in phase, a replay of an on-time push is answered at once
    on_time = threading.Thread(target=_push_pull, args=(w0, 1.0, 2, views[0]))
    on_time.start()
    _push_pull(w2, 3.0, 2, views[1])
    on_time.join(5)
    t0 = time.monotonic()
    _push_pull(w2, 3.0, 2, views[1])
    assert time.monotonic() - t0 < 1.0 and c.shards[0].stats()["duplicates"] == 2
    assert c.shards[0].stats()["late_contributions"] == 1
    for cl in (w0, w1, w2):
        cl.close()


def test_the_grace_window_waits_for_a_straggler_then_closes_without_it(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0.6s")
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.ones(N)}, 0)
    time.sleep(0.2)
    w2.push({"w": torch.full((N,), 4.0)}, 0)       # within the window: round 0 takes all three
    assert c.shards[0].stats()["max_version"] == 1 and torch.equal(_value(w0), -torch.full((N,), 2.0))
    t0 = time.monotonic()
    w0.push({"w": torch.ones(N)}, 1)
    w1.push({"w": torch.ones(N)}, 1)
    w0.pull(min_version=2)                          # worker 2 never comes: the window closes round 1
    waited = time.monotonic() - t0
    assert 0.5 < waited < 3.0, waited
    for cl in (w0, w1, w2):
        cl.close()


def test_pulls_carry_the_quorums_pace_which_the_grace_window_does_not_enter(cluster_factory):
    """PullResponse.quorum_pace_s: the median open-to-quorum span a slow worker fits its round to (inner=adaptive)."""
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0.5s")
    _value(w2)
    assert w2.quorum_paces == {0: 0.0}               # no quorum yet
    w0.push({"w": torch.ones(N)}, 0)
    time.sleep(0.3)
    quorum0 = time.monotonic()
    w1.push({"w": torch.ones(N)}, 0)                # the job's first round: its span is the start-up skew
    w0.pull(min_version=1)                          # the grace window runs out without worker 2
    assert w0.quorum_paces == {0: 0.0}
    time.sleep(0.3)
    w0.push({"w": torch.ones(N)}, 1)
    w1.push({"w": torch.ones(N)}, 1)                # the quorum, 0.3 s after a close opened the round
    quorum1 = time.monotonic()
    w0.pull(min_version=2)
    # round 1 opened when round 0's window closed, no sooner than 0.5 s after its quorum: whatever the box's load,
    # a pace with the window in it would exceed this bound by ~0.5 s
    assert 0.25 <= w0.quorum_paces[0] <= quorum1 - (quorum0 + 0.5) + 0.02, (w0.quorum_paces, quorum1 - quorum0)
    for cl in (w0, w1, w2):
        cl.close()
    _, (b0, *_) = _job(cluster_factory, 2, "bsp")
    _value(b0)
    assert b0.quorum_paces == {0: 0.0}               # bsp rounds have no quorum


def test_the_first_round_opens_at_init_so_its_window_is_sized_by_a_round_not_by_start_up_skew(cluster_factory):
    # measured from its first delta, round 0's open-to-quorum span was the start-up skew between the workers' first
    # deltas; windows and starvation waits sized from it closed lm rounds of ~3 s within 1 s, each on one late delta
    # (70 outer steps in 19 rounds' time: the loss diverged). It opens at the key's Init instead
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=1")
    time.sleep(0.4)                                  # the workers' first round of compute
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.ones(N)}, 0)                 # its quorum: a window of 1 x (Init to now) >= 0.4 s opens
    time.sleep(0.1)
    w2.push({"w": torch.full((N,), 4.0)}, 0)         # 0.1 s on: within it (from the first delta: 0.1 s > its span)
    assert torch.equal(_value(w0), -torch.full((N,), 2.0))
    rounds = c.shards[0].rounds
    assert rounds.spans["w#0"][0] >= 0.4 and rounds.pace_s("w#0") == 0.0    # the workers' pace leaves start-up out
    for cl in (w0, w1, w2):
        cl.close()


def test_a_round_the_dead_keep_short_of_its_quorum_closes_with_what_it_has(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.ones(N)}, 0)              # round 0 at its quorum: the recent span is known
    t0 = time.monotonic()
    w0.push({"w": torch.full((N,), 3.0)}, 1)      # workers 1 and 2 are gone (not evicted): no quorum of 2
    w0.pull(min_version=2)
    waited = time.monotonic() - t0
    assert 0.9 < waited < 3.0, waited             # STARVED_MIN_S (1 s): a starving round waits, then goes on
    assert torch.equal(_value(w0), -torch.ones(N) - 3.0)
    assert c.shards[0].stats()["step_contributors"][1] == 1
    for cl in (w0, w1, w2):
        cl.close()


def test_quorum_needs_a_local_update_job(cluster_factory):
    c = cluster_factory(1)
    cl = client(c.addrs, 0, 2, sync="quorum:1")
    with pytest.raises(PSError) as e:
        cl.setup([("w", torch.zeros(N))])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--local-steps" in str(e.value)
    cl.close()


def test_stop_wakes_a_pull_waiting_for_a_round_and_reaches_every_puller(cluster_factory):
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:3:grace=0")
    w2.push({"w": torch.ones(N)}, 0)
    waited = []
    t = threading.Thread(target=lambda: (w2.pull(min_version=1), waited.append(w2.job_stop)), daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()                              # round 0 needs all three: the pull waits
    assert w0.stop(7, 1.25, "worker 0 reached the target") is True
    t.join(5)
    assert not t.is_alive() and waited == [{"worker_id": 0, "step": 7, "time_s": 1.25,
                                            "reason": "worker 0 reached the target"}]
    assert w1.stop(9, 2.0, "late") is False          # the first stop stands
    w1.pull(min_version=0)
    assert w1.job_stop["step"] == 7 and c.shards[0].stats()["stopped"]
    before = _value(w1)
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.ones(N)}, 0)                 # acknowledged, never applied: the judged model stays
    assert torch.equal(_value(w1), before) and c.shards[0].keys[next(iter(c.shards[0].keys))].version == 0
    stub = rpc.ParameterServerStub(grpc.insecure_channel(c.addrs[0]))
    with pytest.raises(grpc.RpcError) as e:
        stub.Stop(pb.StopRequest(worker_id=99, step=1, time_s=1.0), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker 99" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Stop(pb.StopRequest(worker_id=0, step=-1, time_s=1.0), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for cl in (w0, w1, w2):
        cl.close()


def test_a_worker_in_a_barrier_does_not_hold_up_the_last_one_training(cluster_factory):
    c, (w0, w1) = _job(cluster_factory, 2, "quorum:2:grace=0")
    done = []
    t = threading.Thread(target=lambda: done.append(w0.barrier("exit", 20)), daemon=True)
    t.start()                                        # worker 0 finished training and waits to leave
    time.sleep(0.2)
    w1.push({"w": torch.ones(N)}, 0)                 # worker 1's last round closes without worker 0's delta
    w1.pull(min_version=1)
    w1.barrier("exit", 20)
    t.join(5)
    assert done and c.shards[0].stats()["max_version"] == 1
    for cl in (w0, w1):
        cl.close()


def test_a_dead_worker_that_stops_beating_is_evicted_and_stops_holding_rounds(cluster_factory):
    # beats of 0.25 s (silent after 4: 1 s): the beats share this process with the shard and 3 clients, and a stall
    # of a few tenths of a second on a loaded box must not pass for a death
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:3:grace=0", heartbeat_s=0.25)
    time.sleep(1.5)                               # 6 beats of nothing but computing: nobody is evicted for it
    assert c.shards[0].live == {0, 1, 2}
    w0.push({"w": torch.ones(N)}, 0)
    w1.push({"w": torch.full((N,), 3.0)}, 0)
    t0 = time.monotonic()
    w2.close()                                    # worker 2 dies: no push, no beat (its round-0 delta never comes)
    assert torch.equal(w0.pull(min_version=1)["w"], -torch.full((N,), 2.0))   # round 0 closed with the other two
    waited = time.monotonic() - t0
    assert waited < 3.0, waited                   # 4 beats of 0.25 s and a reaper tick (no --worker-timeout here)
    st = c.shards[0].stats()
    assert st["evictions"] == 1 and c.shards[0].live == {0, 1}
    back = client(c.addrs, 2, 3, sync="quorum:3:grace=0", opt=AVG, local_steps=4, heartbeat_s=0.25)
    back.setup([("w", torch.zeros(N))])           # the restarted worker rejoins while round 1 is open
    assert c.shards[0].live == {0, 1, 2} and back.start_step == 1
    for cl in (w0, w1):
        cl.push({"w": torch.ones(N)}, 1)            # round 1 does not wait for a worker that joined after it opened
    assert torch.equal(w0.pull(min_version=2)["w"], -torch.full((N,), 3.0))
    back.push({"w": torch.full((N,), 4.0)}, 1)      # its delta for the round it pulled: late, it folds into round 2
    for cl in (w0, w1):
        cl.push({"w": torch.ones(N)}, 2)            # round 2 waits for all three and takes the three deltas
    assert torch.equal(back.pull(min_version=3)["w"], -torch.full((N,), 3.0 + 2.0))
    assert c.shards[0].stats()["late_contributions"] == 1
    for cl in (w0, w1, back):
        cl.close()


def test_heartbeats_refuse_what_is_not_a_worker_of_the_job(cluster_factory):
    c, (w0,) = _job(cluster_factory, 1, "quorum:1", heartbeat_s=0.1)
    with pytest.raises(grpc.RpcError) as e:
        w0.stubs[0].Heartbeat(pb.HeartbeatRequest(worker_id=7), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker 7" in e.value.details()
    assert w0.stubs[0].Heartbeat(pb.HeartbeatRequest(worker_id=0), timeout=5).live
    bad = client(c.addrs, 0, 1, sync="quorum:1", opt=AVG, local_steps=4, heartbeat_s=float("nan"))
    with pytest.raises(PSError) as e:
        bad.setup([("w", torch.zeros(N))])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "heartbeat_s" in str(e.value)
    for cl in (w0, bad):
        cl.close()


def _push_steps(cl, value: float, step: int, inner_steps: int) -> None:
    """A round's delta covering inner_steps (PushRequest.inner_steps), through the client's PushPull."""
    cl.push_pull_keys(0, cl.layout, {"w": torch.full((N,), value)}, step, 0, {"w": torch.zeros(N)}, inner_steps)


def test_a_delta_is_weighted_by_the_inner_steps_it_covers(cluster_factory):
    c, (w0, w1) = _job(cluster_factory, 2, "quorum:2:grace=0:inner=adaptive")
    _push_steps(w0, 3.0, 0, 4)                     # a full round (local_steps 4): weight 1
    _push_steps(w1, 6.0, 0, 1)                     # a slow worker's round of 1 step: weight 1/4
    assert torch.allclose(_value(w0), -torch.full((N,), (3.0 + 6.0 / 4) / 1.25))
    for bad in (5, -1):
        with pytest.raises(PSError) as e:
            _push_steps(w0, 1.0, 1, bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "inner_steps" in str(e.value)
    for cl in (w0, w1):
        cl.close()


def test_a_live_worker_that_registers_again_keeps_its_late_delta(cluster_factory):
    """A connection drop makes the client register again before it re-sends: a live worker's counts are kept, so
    its late delta still folds into the open round (raised to the version, it was acknowledged as a duplicate and
    lost)."""
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    one = torch.ones(N)
    w0.push({"w": one}, 0)
    w1.push({"w": one}, 0)                  # round 0 closes without worker 2
    assert c.shards[0].keys["w#0"].version == 1
    w2.setup([("w", torch.zeros(N))], pull=False)     # what recover() sends: Register again, still live
    w2.push({"w": torch.full((N,), 8.0)}, 0)          # its round-0 delta, re-sent
    ks = c.shards[0].keys["w#0"]
    assert c.shards[0].stats()["duplicates"] == 0 and ks.agg_weight == 1.0 and torch.equal(ks.agg, torch.full((N,), 8.0))
    for cl in (w0, w1, w2):
        cl.close()
