"""Replies held, as bytes, while the return dial to their peer is in its handshake.

A node answers a peer on the connection it dialed to that peer (lanes are the dialer's
streams), so the first requests of a new peer arrive before the way back exists. A reply
queued in the lane's admission gate then costs about 470 bytes beyond its payload (its
envelope object, a SendAdmission, the hook that uncharges it), so a peer's honest burst
of small requests filled ``max_pending_reply_bytes`` with a few thousand replies and the
rest were dropped. Held here instead, a reply costs its encoded envelope plus
:data:`RECORD_OVERHEAD` bytes in one buffer per peer, and the whole buffer is handed to
the gates once the dial completes (in order, before any later reply).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

__all__ = ["RECORD_OVERHEAD", "HeldReplies"]

_RECORD = struct.Struct(">BI")
RECORD_OVERHEAD = _RECORD.size
"""What a held reply is charged beyond its encoded envelope: its lane and its length.
The buffer may over-allocate by up to an eighth of what it holds (a ``bytearray``)."""


class HeldReplies:
    """One peer's held replies, back to back in one buffer: (lane, length, envelope)."""

    __slots__ = ("_buffer", "count")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.count = 0

    @property
    def charged(self) -> int:
        """What the held replies are charged together (their bytes in the buffer)."""
        return len(self._buffer)

    def add(self, lane: int, body: bytes) -> int:
        """Hold one reply; returns what it is charged."""
        self._buffer += _RECORD.pack(lane, len(body))
        self._buffer += body
        self.count += 1
        return RECORD_OVERHEAD + len(body)

    def drain(self) -> Iterator[tuple[int, bytes]]:
        """Every held reply, oldest first, as (lane, envelope); empties the buffer."""
        buffer, self._buffer, self.count = self._buffer, bytearray(), 0
        view = memoryview(buffer)
        offset = 0
        try:
            while offset < len(buffer):
                lane, size = _RECORD.unpack_from(buffer, offset)
                offset += RECORD_OVERHEAD
                yield lane, bytes(view[offset : offset + size])
                offset += size
        finally:
            view.release()
