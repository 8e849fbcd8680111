"""Quorum rounds across evictions and shard restores: an evicted worker's in-flight delta still folds in; a restored
shard keeps the heartbeat intervals (a worker dead meanwhile goes after its beats) and the job's stop; a round whose
first delta comes long after it opened (a pause held every worker) does not close on that one delta."""
import time
from collections import deque

import torch
from test_quorum_rounds import AVG, N, _job

from deltaps.layout import Key
from deltaps.sync import parse_sync
from ps.durability import restore, snapshot
from ps.rounds import STARVED_MIN_S, QuorumRounds
from ps.shard import Shard
from ps.state import KeyState


def test_a_worker_evicted_with_its_delta_in_flight_still_folds_it_in(cluster_factory):
    """Evicted by mistake (a dropped Attend stream, a stall) while its round-0 delta was on its way: the client
    registers again and re-sends it; it folds into the open round as a late delta, not acknowledged as a duplicate
    and lost (its counts were raised to the version), and a joiner still starts at the open round."""
    c, (w0, w1, w2) = _job(cluster_factory, 3, "quorum:2:grace=0")
    one = torch.ones(N)
    w0.push({"w": one}, 0)
    w1.push({"w": one}, 0)                               # round 0 closes without worker 2
    shard = c.shards[0]
    assert shard.keys["w#0"].version == 1 and shard.evict(2, "a test: evicted by mistake")
    w2.setup([("w", torch.zeros(N))], pull=False)        # what recover() sends after NOT_LIVE_MEMBER
    assert w2.start_step == 1                            # where a (re)joining process starts: the open round
    w2.push({"w": torch.full((N,), 8.0)}, 0)             # its round-0 delta, re-sent
    ks = shard.keys["w#0"]
    stats = shard.stats()
    assert stats["duplicates"] == 0 and stats["late_contributions"] == 1
    assert ks.agg_weight == 1.0 and torch.equal(ks.agg, torch.full((N,), 8.0))
    for cl in (w0, w1, w2):
        cl.close()


def _quorum_shard(beat_s: float, sync: str = "quorum:2") -> Shard:
    shard = Shard(0, 1)
    key = Key("w#0", "w", 0, N, "float32", 0)
    for w in range(3):
        shard.register(w, 3, 1, sync, AVG, [key], "d", "none", local_steps=4, heartbeat_s=beat_s)
    shard.init([("w#0", torch.zeros(N))])
    return shard


def test_a_restored_shard_keeps_heartbeats_and_the_stop():
    """A worker that died while the shard was down is evicted after its heartbeats (4 x 0.2 s), not after
    --worker-timeout (here none: it would hold the rounds for good); a stopped job stays stopped."""
    shard = _quorum_shard(0.2)
    shard.stop(0, 7, 1.5, "target reached")
    state = snapshot(shard)
    fresh = Shard(0, 1)
    restore(fresh, state)
    assert fresh.beat_s == {0: 0.2, 1: 0.2, 2: 0.2} and fresh.stopped == shard.stopped
    deadline = time.monotonic() + 5
    while fresh.live and time.monotonic() < deadline:    # nobody heartbeats the restored shard
        time.sleep(0.1)
    assert fresh.live == set() and fresh.counters["evictions"] == 3


def test_a_rounds_first_delta_long_after_it_opened_does_not_starve_it_at_once():
    rounds = QuorumRounds(parse_sync("quorum:2"), close=lambda ks: None)
    ks = KeyState(Key("w#0", "w", 0, N, "float32", 0), torch.zeros(N))
    rounds.spans["w#0"] = deque([0.5])
    rounds.opened_at["w#0"] = time.monotonic() - 100.0   # every worker held by a pause
    t0 = time.monotonic()
    rounds.contributed(ks)
    assert rounds.starve_at["w#0"] >= t0 + max(0.5, STARVED_MIN_S)


def test_a_replayed_push_waiting_for_a_later_round_is_not_waited_for():
    """After a restore, a worker's replayed push of a round it had skipped ahead to waits for that round; the round
    open now must not wait for it (quorum = every worker): it closes with the others, then the push goes in. Before,
    each waited for the other until --wait-timeout (300 s) and every replay failed."""
    shard = _quorum_shard(0.0, "quorum:3")           # Q = all: only counted_live lets round 0 close
    shard.wait_timeout_s = 5.0
    ks = shard.keys["w#0"]
    ks.pushed[2] = 1                                 # restored: worker 2 is past round 0 (it skipped ahead)
    one = torch.ones(N)
    shard.push(0, 0, [("w#0", one)], [0])
    shard.push(1, 0, [("w#0", one)], [0])
    assert ks.version == 0                           # round 0 waits for worker 2 (Q = all)
    t0 = time.monotonic()
    shard.push(2, 1, [("w#0", one)], [1])            # waits for round 0 to close: it must not hold it
    assert time.monotonic() - t0 < 2.0 and ks.version == 1 and 2 in ks.agg_from
