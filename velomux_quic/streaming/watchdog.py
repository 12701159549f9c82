"""The consumer's stream watchdog decision, sans-IO: is this remote sender dead yet, and
when to look again.

The manager runs one timer per remote sender and asks :func:`check` what to do each time
it fires; everything here is arithmetic on the times it is given, so the rules are tested
with a fake clock (``tests/unit/test_watchdog.py``).

The rules, and why:

- **Silence is counted from a reference**: the last arrival, or the moment the sender
  stopped being exempt, whichever is later. A sender that holds no data credit (the
  consumer is behind) cannot heartbeat, so its silence is not its own: while the probe
  says *exempt*, nothing is counted (one check a window), and the first check that finds
  the exemption over counts from half a window after the last check that saw it: the
  exemption ended somewhere in that window, and its middle is within half a window of
  the truth. A dead producer is then detected 3 to 4 windows after the consumer resumed
  reading. (Counting from the check that found it over, as before, put detection up to
  4.5 windows after: 4.3 was measured.)
- **A deadline with slack, not a strict per-window test**: the heartbeat period equals
  the window, so a check that runs exactly one window after the last arrival races the
  next heartbeat. The stream is dead once the silence reaches
  ``DETECTION_MULTIPLIER`` windows plus :data:`DETECTION_SLACK` of a window: a heartbeat
  that arrives on the boundary, or up to half a window late, never ends a stream, and
  detection still lands within the chapter's bound of 3 to 4 windows after the last
  arrival.
- **Never re-armed in the past**: the next check is at most one window away (the chapter's
  "wakes once per heartbeat window") and at least :data:`MIN_CHECK_FRACTION` of a window
  away, so a stale reference can never make the timer fire on every loop iteration.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DETECTION_MULTIPLIER",
    "DETECTION_SLACK",
    "EXEMPTION_END_ESTIMATE",
    "MIN_CHECK_FRACTION",
    "WatchdogClock",
    "check",
    "deadline_windows",
]

DETECTION_MULTIPLIER = 3
"""Dead heartbeat windows before a watchdog ends a stream (a protocol constant)."""

DETECTION_SLACK = 0.5
"""Fraction of a window a heartbeat may be late without costing its stream."""

EXEMPTION_END_ESTIMATE = 0.5
"""Where in the window between two checks an exemption is taken to have ended."""

MIN_CHECK_FRACTION = 0.05
"""The shortest re-arm, as a fraction of the window: bounds wake-ups per window."""


def deadline_windows() -> float:
    """Silence, in windows, after which a sender is dead (3.5 at the defaults)."""
    return DETECTION_MULTIPLIER + DETECTION_SLACK


@dataclass(slots=True)
class WatchdogClock:
    """One remote sender's watchdog state: where silence is counted from."""

    reference: float
    """The later of the bind time and the end of the last exemption seen."""
    exempt: bool = False
    """Whether the previous check found the sender exempt (holding no credit)."""
    exempt_seen: float = 0.0
    """When a check last found it exempt."""


def check(
    clock: WatchdogClock, *, now: float, last_arrival: float, exempt: bool, window: float
) -> float | None:
    """One watchdog wake-up: the delay until the next check, or None (the sender is dead).

    ``last_arrival`` is the newest time the ingress delivered anything for the sender;
    ``exempt`` is the transport's view that the silence is the consumer's.
    """
    floor = window * MIN_CHECK_FRACTION
    if exempt:
        clock.exempt = True
        clock.exempt_seen = now
        return window
    if clock.exempt:
        # The exemption ended somewhere since the previous check (a window ago): count
        # from the middle of that window.
        clock.exempt = False
        ended = min(now, clock.exempt_seen + window * EXEMPTION_END_ESTIMATE)
        clock.reference = max(clock.reference, ended)
    reference = max(clock.reference, last_arrival)
    deadline = reference + window * deadline_windows()
    if now >= deadline:
        return None
    return max(floor, min(window, deadline - now))
