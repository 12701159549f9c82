"""The openings of streams a peer opens toward us: bounded in count, size and time.

A stream the peer opens that is not a lane (the per-stream path's) carries length-prefixed
frames, the first of which is its opening: what it is for (for the per-stream path, the
16 bytes naming the anchor and session). Until that first frame is whole, the receiver
above can do nothing with the stream but hold what arrived, and a hostile peer could open
thousands of streams, announce a large first frame on each and never finish it. So the
transport watches the first frame of each such stream, and no more:

* at most ``max_stream_openings`` streams per connection may be unfinished at once;
* a first frame may announce at most ``max_stream_opening_size`` bytes;
* it must arrive whole within ``stream_opening_timeout`` of the stream's first bytes.

A stream past a bound is refused (the connection sends STOP_SENDING, counts the reason and
tells the receiver the stream is over). From its opening on, a stream is the receiver's
alone: its later bytes cost one set lookup here.

:class:`StreamOpenings` is sans-IO: it decides, the connection acts.
"""

from __future__ import annotations

import struct
from typing import Final

from .framing import FRAME_HEADER_SIZE

__all__ = ["StreamOpenings"]

_HEADER: Final = struct.Struct(">I")

REFUSED_COUNT: Final = "stream_openings"
REFUSED_SIZE: Final = "stream_opening_size"
REFUSED_TIMEOUT: Final = "stream_opening_timeout"
DROP: Final = ""
"""The verdict for more data on a stream already refused: drop it, count nothing more."""


class _Opening:
    """One stream whose first frame is not whole yet."""

    __slots__ = ("deadline", "head", "length", "received")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.head = b""
        self.length = -1
        self.received = 0


class StreamOpenings:
    """The streams of one connection: opened, still opening, or refused."""

    __slots__ = ("_limit", "_max_size", "_pending", "_refused", "_timeout", "opened")

    def __init__(self, limit: int, max_size: int, timeout: float) -> None:
        self._limit = limit
        self._max_size = max_size
        self._timeout = timeout
        self.opened: set[int] = set()
        """Streams whose opening arrived whole: the receiver's alone from then on."""
        self._pending: dict[int, _Opening] = {}
        """Unfinished openings, oldest first (their deadlines are in order)."""
        self._refused: set[int] = set()

    @property
    def pending(self) -> int:
        """Streams whose opening has not arrived whole yet."""
        return len(self._pending)

    def admit(self, stream_id: int, data: bytes, now: float) -> str | None:
        """None: hand ``data`` on to the stream's receiver. Otherwise the reason to refuse
        the stream (or :data:`DROP` for data on one already refused)."""
        if stream_id in self.opened:
            return None
        opening = self._pending.get(stream_id)
        if opening is None:
            if stream_id in self._refused:
                return DROP
            if len(self._pending) >= self._limit:
                self._refused.add(stream_id)
                return REFUSED_COUNT
            opening = self._pending[stream_id] = _Opening(now + self._timeout)
        opening.received += len(data)
        if opening.length < 0:
            head = opening.head + data[: FRAME_HEADER_SIZE - len(opening.head)]
            if len(head) < FRAME_HEADER_SIZE:
                opening.head = head
                return None
            (opening.length,) = _HEADER.unpack(head)
            opening.head = b""
            if opening.length > self._max_size:
                self._refuse(stream_id)
                return REFUSED_SIZE
        if opening.received >= FRAME_HEADER_SIZE + opening.length:
            del self._pending[stream_id]
            self.opened.add(stream_id)
        return None

    def _refuse(self, stream_id: int) -> None:
        self._pending.pop(stream_id, None)
        self._refused.add(stream_id)

    def next_deadline(self) -> float | None:
        """When the oldest unfinished opening times out (None: none is unfinished)."""
        for opening in self._pending.values():
            return opening.deadline
        return None

    def expire(self, now: float) -> list[int]:
        """The streams whose opening timed out by ``now``: refused from here on."""
        expired = []
        for stream_id, opening in self._pending.items():
            if opening.deadline > now:
                break
            expired.append(stream_id)
        for stream_id in expired:
            self._refuse(stream_id)
        return expired

    def ended(self, stream_id: int) -> None:
        """The stream is over (finished, reset, or refused by its receiver): forget it."""
        self.opened.discard(stream_id)
        self._pending.pop(stream_id, None)
        self._refused.discard(stream_id)

    def clear(self) -> None:
        self.opened.clear()
        self._pending.clear()
        self._refused.clear()
