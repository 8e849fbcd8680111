"""Quorum rounds with inner=adaptive (worker/local_updates.py RoundPace): a worker slower than the quorum takes the
inner steps that fit in the quorum's round; the workers that set the pace keep H, so rounds never shrink in turn."""
import pytest

from deltaps.sync import parse_sync
from worker.local_updates import ADAPT_BELOW, RoundPace, check_pace

H = 32


def _rounds(pace: RoundPace, step_s: float, period_s: float, rounds: int = 8) -> list[int]:
    """A worker taking step_s per inner step beside a quorum that closes a round every period_s: a delta in time
    for its round waits for that round's close; a late one's pull returns at once, some rounds later."""
    sizes, now, version = [], 0.0, 0
    for _ in range(rounds):
        steps = pace.next_round()
        sizes.append(steps)
        pace.stepped(steps * step_s, steps)
        done = now + steps * step_s
        if done <= (version + 1) * period_s + 1e-12:
            now, version = (version + 1) * period_s, version + 1
        else:
            now, version = done, int(done / period_s)
        pace.observed(now, version)
    return sizes


def test_a_worker_at_half_speed_takes_half_the_steps_and_the_fast_ones_keep_h():
    assert _rounds(RoundPace(H), step_s=0.02, period_s=H * 0.01)[2:] == [16] * 6
    assert _rounds(RoundPace(H), step_s=0.01, period_s=H * 0.01) == [H] * 8      # a worker that sets the pace
    assert _rounds(RoundPace(H), step_s=0.0099, period_s=H * 0.01) == [H] * 8
    slow = _rounds(RoundPace(H), step_s=0.01 / ADAPT_BELOW * 1.05, period_s=H * 0.01, rounds=12)
    assert slow[-1] < H * ADAPT_BELOW           # slower than ADAPT_BELOW x the quorum: it shortens its rounds


def test_the_pace_starts_at_h_and_never_leaves_1_h():
    pace = RoundPace(H)
    assert pace.next_round() == H
    pace.stepped(100.0, 1)           # a worker 10,000 x slower than the quorum still makes a step a round
    pace.observed(0.0, 0)
    pace.observed(0.01, 1)
    assert pace.next_round() == 1
    assert parse_sync("quorum:3:inner=adaptive").weight(0, 8, 32) == 0.25
    assert parse_sync("quorum:3:late=discount:inner=adaptive").weight(1, 16, 32) == 0.25
    assert str(parse_sync("quorum:3:inner=adaptive")) == "quorum:3:grace=0.25:inner=adaptive"
    with pytest.raises(ValueError, match="inner=fixed|adaptive"):
        parse_sync("quorum:3:inner=sometimes")
    with pytest.raises(ValueError, match="one fragment and no overlap"):
        check_pace("adaptive", 2, 0)
    check_pace("fixed", 2, 1)


def _grace_rounds(pace: RoundPace, step_s: float, span_s: float, grace: float, told_span: bool,
                  rounds: int = 16) -> tuple[list[int], list[float]]:
    """A straggler beside a quorum that arrives span_s after each round opens (ps/rounds.py): a round closes at the
    quorum if the straggler is in by then, at the straggler's arrival within the grace window (every live worker in),
    else at the window's end. told_span: the pulls carry the shards' span (PullResponse.quorum_pace_s).
    Returns the straggler's round sizes and the rounds' lengths."""
    sizes, periods, now = [], [], 0.0
    for version in range(1, rounds + 1):
        steps = pace.next_round()
        sizes.append(steps)
        pace.stepped(steps * step_s, steps)
        arrival = steps * step_s
        period = span_s if arrival <= span_s else min(arrival, span_s * (1 + grace))
        periods.append(period)
        now += period
        pace.observed(now, version, 0.0, span_s if told_span else 0.0)
    return sizes, periods


def test_a_straggler_fits_its_round_to_the_quorum_not_to_the_grace_window_it_stretches():
    span = H * 0.01                             # the quorum's workers take 10 ms a step
    told, told_periods = _grace_rounds(RoundPace(H), 0.02, span, 0.25, told_span=True)
    assert told[2:] == [16] * 14 and told_periods[2:] == [span] * 14       # in at the quorum: no round waits
    seen, seen_periods = _grace_rounds(RoundPace(H), 0.02, span, 0.25, told_span=False)
    # fitted to the close-to-close pace it sees, it arrives late in the window and every round stretches to its end
    assert max(seen_periods[4:]) > 1.2 * span and seen[-1] > 16
