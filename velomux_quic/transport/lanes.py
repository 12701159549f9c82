"""The two ends of a lane: what a dialed connection writes, what an accepted one reads.

A lane is one client-initiated unidirectional QUIC stream; its writer feeds the lane's
admission gate, its reader decodes frames and counts what the layer above consumed (which is
what the receive window is granted from).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Protocol

from ..errors import ChannelClosed
from .admission import ADMITTED, InflightBound, LaneGate, SendOutcome
from .config import MAX_LANES
from .framing import FRAME_HEADER_SIZE, FrameDecoder, frame_header
from .metrics import TransportStats
from .seam import QuicEngine

__all__ = [
    "CONTROL_LANE",
    "FIRST_EXTRA_STREAM",
    "InboundLane",
    "OutboundStream",
    "StreamHost",
    "lane_of_stream",
    "stream_of_lane",
]


class StreamHost(Protocol):
    """What an outbound stream needs from its connection, and no more."""

    @property
    def quic(self) -> QuicEngine: ...

    @property
    def established(self) -> bool: ...

    @property
    def stats(self) -> TransportStats: ...

    @property
    def inflight(self) -> InflightBound:
        """This node's cap on what the connection's lanes hold unacknowledged."""

    def stream_blocked(self, stream: OutboundStream) -> None:
        """A send of ``stream`` waits: poll its gate when room may have opened."""

    def stream_done(self, stream: OutboundStream) -> None:
        """``stream`` was finished or aborted: forget it."""

    def transmit_soon(self) -> None:
        """Transmit what was written, once per loop iteration."""


_SMALL_FRAME = 64 * 1024
"""Below this a frame's header and body are joined into one write; above, written apart."""


def stream_of_lane(lane: int) -> int:
    """Lane k rides the k-th client-initiated unidirectional stream (ids 2, 6, 10, ...)."""
    return 4 * lane + 2


CONTROL_LANE = MAX_LANES - 1
"""The lane control messages ride (stream attaches and their answers, cancels, stops),
kept as its own QUIC stream whatever the configured lane count, so they never wait
behind the megabytes of data batches a lane may have queued: QUIC orders bytes only
within a stream, and aioquic serves its streams in turn, packet by packet. Lanes below
the configured count carry data; this one is the last stream of the lane range (with
16 lanes it is also data lane 15, so it shares that lane's queue). A peer that predates
it takes frames on any lane below 16 and answers on the lane a request came on."""

FIRST_EXTRA_STREAM = 4 * MAX_LANES + 2
"""The first client unidirectional stream id that is not a lane (the per-stream path's)."""


def lane_of_stream(stream_id: int) -> int | None:
    """The lane a stream carries, or None for any stream that is not a lane."""
    if stream_id & 0x3 != 0x2:
        return None
    lane = stream_id >> 2
    return lane if lane < MAX_LANES else None


class OutboundStream:
    """The write side of one unidirectional stream: what its admission gate asks of QUIC.

    Lanes are such streams (ids ``4k + 2``, k < MAX_LANES); so is every stream of the per-stream
    path (ids from ``4 * MAX_LANES + 2`` up), each with its own gate and ``send_buffer``.
    """

    __slots__ = (
        "_conn",
        "_opened",
        "_quic",
        "aborted",
        "finished",
        "gate",
        "lane",
        "send_buffer",
        "stream_id",
        "written",
    )

    def __init__(self, conn: StreamHost, stream_id: int, send_buffer: int, lane: int = -1) -> None:
        self._conn = conn
        self._quic = conn.quic
        self._opened = False
        self.lane = lane
        self.stream_id = stream_id
        self.send_buffer = send_buffer
        self.finished = False
        self.aborted = False
        """Reset rather than finished: what it wrote is abandoned, never acknowledged."""
        self.written = 0
        """Bytes written on the stream so far (frame headers included): the stream offset
        the next frame starts at, which is what an acknowledgement is compared against."""
        self.gate = LaneGate(self.room, self.idle, self.write)

    def send(self, body: bytes) -> SendOutcome:
        """Queue one frame; ``ADMITTED`` or a pending admission (see LaneGate)."""
        outcome = self.gate.send(body)
        if outcome is not ADMITTED:
            self._conn.stream_blocked(self)
        return outcome

    @property
    def unsent_bytes(self) -> int:
        """Bytes admitted to the stream that have not been transmitted yet (waiting for the
        peer's window, the connection's window or the congestion controller)."""
        return self._quic.stream_unsent(self.stream_id)

    @property
    def held_by_peer_window(self) -> bool:
        """A send waits that only the peer's reader can release.

        True when the bytes written beyond the peer's window for this stream, which leave
        only when the peer grants more, leave no room for the first waiting frame: nothing
        the connection transmits admits it. A send that waits on the connection (its
        congestion window, a transmit not yet run) instead shows ``False`` here.
        """
        gate = self.gate
        if not gate.pending_count:
            return False
        beyond = self._quic.stream_beyond_window(self.stream_id)
        return beyond > 0 and beyond + gate.head_size > self.send_buffer

    def finish(self) -> None:
        """End the stream (FIN) after everything admitted; later sends are refused."""
        if self.finished:
            return
        self.finished = True
        self.gate.close(ChannelClosed("the stream was finished"))
        if self._opened or self._conn.established:
            self._ensure_open()
            with contextlib.suppress(Exception):  # reset by the peer meanwhile: nothing to finish
                self._quic.send_stream_data(self.stream_id, b"", end_stream=True)
            self._conn.transmit_soon()
        self._conn.stream_done(self)

    def abort(self) -> None:
        """Reset the stream (RESET_STREAM): queued and unacknowledged data are dropped."""
        if self.finished:
            return
        self.finished = self.aborted = True
        self.gate.close(ChannelClosed("the stream was aborted"))
        if self._opened:
            with contextlib.suppress(Exception):  # already reset or finished by the peer
                self._quic.reset_stream(self.stream_id, 0x101)
            self._conn.transmit_soon()
        self._conn.stream_done(self)

    def room(self) -> int:
        if not self._conn.established:
            return -1
        room = self._quic.stream_room(self.stream_id, self.send_buffer)
        if self.lane >= 0:  # a lane: also this node's own cap on unacknowledged bytes
            cap = self._conn.inflight.room()
            if cap < room:
                return cap
        return room

    def idle(self) -> bool:
        if not self._conn.established:
            return False
        if self.lane >= 0 and self._conn.inflight.room() <= 0:
            return False  # the cap is reached: even a frame larger than any room waits
        return self._quic.stream_idle(self.stream_id)

    def _ensure_open(self) -> None:
        if not self._opened:  # only ever once the connection is established
            self._quic.open_send_stream(self.stream_id)
            self._opened = True

    def write(self, body: bytes) -> None:
        quic = self._quic
        if not self._opened:
            self._ensure_open()
        size = len(body)
        if size <= _SMALL_FRAME:
            quic.send_stream_data(self.stream_id, frame_header(size) + body)
        else:  # avoid copying a large body just to prepend four bytes
            quic.send_stream_data(self.stream_id, frame_header(size))
            quic.send_stream_data(self.stream_id, body)
        self.written += size + FRAME_HEADER_SIZE
        conn = self._conn
        if self.lane >= 0:
            conn.inflight.written(size + FRAME_HEADER_SIZE)
        else:
            conn.inflight.stream_written(size + FRAME_HEADER_SIZE)
        stats = conn.stats
        stats.frames_out += 1
        stats.bytes_out += size + FRAME_HEADER_SIZE
        conn.transmit_soon()


class InboundLane:
    """The read side of one lane: decoder, consumption count and pause state."""

    __slots__ = (
        "backlog",
        "consumed",
        "decoder",
        "held",
        "lane",
        "partial",
        "paused",
        "stream_id",
        "swept",
    )

    def __init__(self, lane: int, stream_id: int, max_message_size: int, paused: bool) -> None:
        self.lane = lane
        self.stream_id = stream_id
        self.decoder = FrameDecoder(max_message_size)
        self.consumed = 0
        self.partial = 0
        """Bytes of the unfinished frame in the decoder, as the connection last counted them."""
        self.swept = -1
        """``consumed`` at the connection's last sweep for stalled frames."""
        self.paused = paused
        self.held: deque[bytes] = deque()  # decoded frames not yet delivered (paused mid-batch)
        self.backlog: deque[bytes] = deque()  # raw stream data received while paused

    def consumed_bytes(self) -> int:
        return self.consumed
