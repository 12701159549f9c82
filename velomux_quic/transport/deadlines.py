"""A connection's deadlines, sans-IO, and the one loop timer that serves them all.

A connection waits on several clocks of its own beside its QUIC engine's: the dial's
handshake deadline, the reaping of an inbound handshake whose peer went silent, the
keep-alive PING, the openings of the peer's streams (:mod:`.openings`), the sweep for
stalled unfinished frames and the path MTU search (:mod:`.pmtu`). Each used to be a loop
handle of its own. :class:`Deadlines` holds them as plain times instead, so the
connection decides what is due from a ``now`` it is given (a test drives it on a clock
of its own, without a loop or a socket), and reports one next deadline.

:class:`LoopTimer` is the shell's half: one ``call_at`` handle on the event loop, moved
only when the next deadline moves, and the coalescing ``call_soon`` of the transmit.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Protocol

__all__ = ["Cancellable", "ConnectionClock", "Deadline", "Deadlines", "LoopTimer"]


class Deadline(enum.Enum):
    """The connection's own deadlines (the engine's timer is kept apart: it moves per batch)."""

    HANDSHAKE = "handshake"
    """The dial's or the accept's whole handshake (``handshake_timeout``)."""
    HALF_OPEN = "half_open"
    """An inbound handshake's peer silent for ``half_open_idle_timeout``: reap it."""
    KEEP_ALIVE = "keep_alive"
    """A PING every ``keep_alive_interval`` on an established connection."""
    OPENINGS = "openings"
    """The earliest unfinished stream opening's ``stream_opening_timeout``."""
    PARTIAL_SWEEP = "partial_sweep"
    """The next look for a lane's unfinished frame on which nothing arrived."""
    PMTU = "pmtu"
    """The path MTU search's next step: a probe due, or one overdue."""
    UNACKED_STALL = "unacked_stall"
    """The next look at whether the peer has held the connection above half its
    unacknowledged-bytes cap for ``unacked_timeout``."""


class Deadlines:
    """The times at which each :class:`Deadline` is due (none set: not waiting on it)."""

    __slots__ = ("_at", "next_at")

    def __init__(self) -> None:
        self._at: dict[Deadline, float] = {}
        self.next_at: float | None = None
        """The earliest deadline set (kept current, so reading it costs nothing)."""

    def set(self, which: Deadline, at: float | None) -> None:
        """Be due at ``at``, in place of any earlier setting; None forgets the deadline."""
        if at is None:
            if self._at.pop(which, None) is None:
                return
        else:
            self._at[which] = at
        self.next_at = min(self._at.values(), default=None)

    def get(self, which: Deadline) -> float | None:
        return self._at.get(which)

    def due(self, now: float) -> list[Deadline]:
        """Forget and return the deadlines due at ``now``, in :class:`Deadline`'s order."""
        if self.next_at is None or self.next_at > now:
            return []
        fired = [which for which in Deadline if self._at.get(which, now + 1.0) <= now]
        for which in fired:
            del self._at[which]
        self.next_at = min(self._at.values(), default=None)
        return fired

    def clear(self) -> None:
        self._at.clear()
        self.next_at = None


class Cancellable(Protocol):
    """A call the clock will make unless it is cancelled first (``asyncio.Handle``)."""

    def cancel(self) -> None: ...


class ConnectionClock(Protocol):
    """What a connection asks of the loop it runs on: the time, one timer and a call soon."""

    def time(self) -> float:
        """Now, on the clock every deadline and the engine's timer are read on."""

    def wake_at(self, when: float | None) -> None:
        """Call the connection's ``on_timer`` at ``when`` (in place of the earlier time);
        None: nothing to wake for."""

    def soon(self, callback: Callable[[], None]) -> Cancellable:
        """Run ``callback`` once the loop has handed over what arrived at once."""


class LoopTimer:
    """One re-armable deadline on an asyncio loop, one ``call_at`` handle: a connection's
    :class:`ConnectionClock`, and a mux batcher's linger timer.

    ``fire`` is passed the time the timer was armed for when the loop runs it early (a loop
    runs a timer up to its clock's resolution early, and uvloop's clock counts whole
    milliseconds): a caller that compared the loop's own time with its deadline would find
    it not due, arm the same past deadline again, and run at every loop iteration until
    the clock moved on."""

    __slots__ = ("_at", "_fire", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[float], None]) -> None:
        self._loop = loop
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None
        self._at: float | None = None

    def time(self) -> float:
        return self._loop.time()

    def wake_at(self, when: float | None) -> None:
        if when == self._at:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._at = when
        if when is not None:
            self._handle = self._loop.call_at(when, self._wake)

    def soon(self, callback: Callable[[], None]) -> Cancellable:
        return self._loop.call_soon(callback)

    def _wake(self) -> None:
        # The loop runs a timer up to its clock resolution early: what was armed for
        # ``_at`` is due, so it is passed the later of the two.
        at = self._at
        self._handle = None
        self._at = None
        now = self._loop.time()
        self._fire(now if at is None or at < now else at)
