"""The two ends of a lane: what a dialed connection writes, what an accepted one reads.

A lane is one client-initiated unidirectional QUIC stream; its writer feeds the lane's
admission gate, its reader decodes frames and counts what the layer above consumed (which is
what the receive window is granted from).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .admission import LaneGate
from .config import MAX_LANES
from .framing import FRAME_HEADER_SIZE, FrameDecoder, frame_header

if TYPE_CHECKING:
    from .connection import PeerConnection

__all__ = ["InboundLane", "OutboundLane", "lane_of_stream", "stream_of_lane"]

_SMALL_FRAME = 64 * 1024
"""Below this a frame's header and body are joined into one write; above, written apart."""


def stream_of_lane(lane: int) -> int:
    """Lane k rides the k-th client-initiated unidirectional stream (ids 2, 6, 10, ...)."""
    return 4 * lane + 2


def lane_of_stream(stream_id: int) -> int | None:
    """The lane a stream carries, or None for any stream that is not a lane."""
    if stream_id & 0x3 != 0x2:
        return None
    lane = stream_id >> 2
    return lane if lane < MAX_LANES else None


class OutboundLane:
    """The write side of one lane: what the lane's gate asks of the QUIC stream."""

    __slots__ = ("_conn", "_opened", "_quic", "gate", "lane", "stream_id")

    def __init__(self, conn: PeerConnection, lane: int) -> None:
        self._conn = conn
        self._quic = conn.quic
        self._opened = False
        self.lane = lane
        self.stream_id = stream_of_lane(lane)
        self.gate = LaneGate(self.room, self.idle, self.write)

    def room(self) -> int:
        if not self._conn.established:
            return -1
        return self._quic.stream_room(self.stream_id, self._conn.send_buffer)

    def idle(self) -> bool:
        if not self._conn.established:
            return False
        return self._quic.stream_idle(self.stream_id)

    def write(self, body: bytes) -> None:
        quic = self._quic
        if not self._opened:  # first write happens only once the connection is established
            quic.open_send_stream(self.stream_id)
            self._opened = True
        size = len(body)
        if size <= _SMALL_FRAME:
            quic.send_stream_data(self.stream_id, frame_header(size) + body)
        else:  # avoid copying a large body just to prepend four bytes
            quic.send_stream_data(self.stream_id, frame_header(size))
            quic.send_stream_data(self.stream_id, body)
        conn = self._conn
        stats = conn.transport.stats
        stats.frames_out += 1
        stats.bytes_out += size + FRAME_HEADER_SIZE
        conn.transmit_soon()


class InboundLane:
    """The read side of one lane: decoder, consumption count and pause state."""

    __slots__ = ("backlog", "consumed", "decoder", "held", "lane", "paused", "stream_id")

    def __init__(self, lane: int, stream_id: int, max_message_size: int, paused: bool) -> None:
        self.lane = lane
        self.stream_id = stream_id
        self.decoder = FrameDecoder(max_message_size)
        self.consumed = 0
        self.paused = paused
        self.held: deque[bytes] = deque()  # decoded frames not yet delivered (paused mid-batch)
        self.backlog: deque[bytes] = deque()  # raw stream data received while paused

    def consumed_bytes(self) -> int:
        return self.consumed
