"""Refusal log lines are rate-limited per (peer, reason) and say how many were held back."""
import logging

from deltaps.ratelimit import RefusalLog


def test_one_line_per_peer_and_reason_with_the_held_back_count(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("deltaps.ratelimit.time.monotonic", lambda: clock[0])
    rl = RefusalLog(logging.getLogger("test.refusals"), every_s=10.0, max_keys=3)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        assert rl.refused("a", "bad token", "refused from a")
        assert not any(rl.refused("a", "bad token", "refused from a") for _ in range(50))
        assert rl.refused("a", "undecodable", "other reason, same peer")
        assert rl.refused("b", "bad token", "other peer")
        clock[0] += 10.0
        assert rl.refused("a", "bad token", "refused from a again")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and rl.suppressed == 50
    assert lines[-1] == "refused from a again (+50 more from a not logged)"
    for peer in range(10):             # many peers: the table stays bounded (least recent forgotten)
        rl.refused(f"p{peer}", "bad token", "x")
    assert len(rl._last) == 3
