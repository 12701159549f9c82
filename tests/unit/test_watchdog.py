"""The stream watchdog's decision on a fake clock: heartbeats on or near the window
boundary never end a stream, silence beyond the bound always does, and an exempt sender
never makes the watchdog re-arm in the past."""

from __future__ import annotations

import pytest

from velomux_quic.streaming.watchdog import (
    DETECTION_MULTIPLIER,
    MIN_CHECK_FRACTION,
    WatchdogClock,
    check,
    deadline_windows,
)

WINDOW = 5.0


def run(
    heartbeats: list[float], *, until: float, exempt: tuple[float, float] | None = None
) -> tuple[float | None, int]:
    """Drive one watchdog from t=0 (the bind) to ``until``: arrivals at ``heartbeats``,
    exempt during ``exempt`` (start, end). Returns (time it fired or None, checks)."""
    clock = WatchdogClock(reference=0.0)
    now, checks = WINDOW, 0  # armed one window after the bind
    while now <= until:
        checks += 1
        last = max([0.0, *(t for t in heartbeats if t <= now)])
        is_exempt = exempt is not None and exempt[0] <= now < exempt[1]
        delay = check(clock, now=now, last_arrival=last, exempt=is_exempt, window=WINDOW)
        if delay is None:
            return now, checks
        assert delay >= WINDOW * MIN_CHECK_FRACTION
        assert delay <= WINDOW
        now += delay
    return None, checks


@pytest.mark.parametrize("late", [0.0, 1e-9, 0.1, 1.0, 2.0, 2.49])
def test_a_heartbeat_on_the_boundary_or_a_little_late_never_drops_the_stream(
    late: float,
) -> None:
    # The producer heartbeats every window, each one `late` seconds after its due time:
    # the race the strict test lost (the check ran exactly when the heartbeat was due).
    heartbeats = [k * WINDOW + late for k in range(1, 200)]
    fired, _ = run(heartbeats, until=190 * WINDOW)
    assert fired is None


def test_a_check_at_exactly_the_heartbeat_time_before_it_arrives_is_not_a_miss() -> None:
    clock = WatchdogClock(reference=0.0)
    # Three checks in a row see exactly one window of silence: the next heartbeat is due.
    last = 0.0
    for k in range(1, 4):
        now = k * WINDOW
        delay = check(clock, now=now, last_arrival=last, exempt=False, window=WINDOW)
        assert delay is not None
        last = now + 1e-6  # it arrives just after the check
    assert clock.exempt is False


@pytest.mark.parametrize("last", [0.0, 3.0, 17.2])
def test_silence_beyond_the_bound_always_drops_within_three_to_four_windows(
    last: float,
) -> None:
    fired, checks = run([last] if last else [], until=100.0)
    assert fired is not None
    silence = fired - last
    assert DETECTION_MULTIPLIER * WINDOW <= silence <= (DETECTION_MULTIPLIER + 1) * WINDOW
    assert silence >= deadline_windows() * WINDOW
    assert checks <= 2 * (DETECTION_MULTIPLIER + 1) + 2


def test_an_exempt_sender_costs_one_check_per_window_and_its_count_restarts_after() -> None:
    # Silent from t=0, exempt (no credit: the consumer stopped reading) from 1 s to 60 s,
    # then dead: the watchdog wakes about once a window and fires 3 to 4 windows after
    # the exemption ended, not 2.
    fired, checks = run([], until=200.0, exempt=(1.0, 60.0))
    assert fired is not None
    assert DETECTION_MULTIPLIER * WINDOW <= fired - 60.0 <= (DETECTION_MULTIPLIER + 1) * WINDOW
    assert checks <= (fired / WINDOW) * 2 + 2


@pytest.mark.parametrize("resumed", [60.0, 60.01, 61.0, 62.5, 63.0, 64.99])
def test_a_reader_stalled_stream_whose_producer_died_ends_3_to_4_windows_after_it_resumed(
    resumed: float,
) -> None:
    # The producer's last frame at 10 s, then it dies; the reader held no credit for it
    # from 5 s and resumes at ``resumed``, anywhere between two of the watchdog's checks.
    fired, _ = run([10.0], until=200.0, exempt=(5.0, resumed))
    assert fired is not None
    windows = (fired - resumed) / WINDOW
    assert DETECTION_MULTIPLIER <= windows <= DETECTION_MULTIPLIER + 1, windows


def test_an_old_reference_is_never_re_armed_in_the_past() -> None:
    clock = WatchdogClock(reference=0.0)
    # An exemption seen at 1000 s with the last arrival at 0: the old code re-armed at
    # last + window - now, a large negative delay (a spin).
    assert check(clock, now=1000.0, last_arrival=0.0, exempt=True, window=WINDOW) == WINDOW
    delay = check(clock, now=1005.0, last_arrival=0.0, exempt=False, window=WINDOW)
    assert delay == WINDOW
