"""The per-stream QUIC path (``quic-stream-v1``): one QUIC stream per stream.

Each stream gets its own unidirectional QUIC stream on the producer's outbound connection:
length-prefixed frames, the first of which is the 16-byte opening
``[u64 anchor_local_id][u64 routing_session_id]`` that claims the bind the attach made,
then FIN after the terminal. It serves peers
without the mux, and it is the baseline the mux is measured against.

Flow control is QUIC's, per stream: the consumer's anchor reads the receiver's buffer
directly (:class:`PerStreamReceiver` is its feed), and only what it takes opens the
producer's window. A consumer that stops reading therefore stops its producer, and only it.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from typing import TYPE_CHECKING

from ..ids import InstanceId
from ..transport import AdmissionError, SendAdmission
from ..transport.connection import CloseCode, PeerConnection
from ..transport.framing import FrameDecoder, FrameTooLarge
from ..transport.lanes import OutboundStream
from .errors import ChannelClosed
from .frames import encode_transport_error, is_terminal_sentinel

if TYPE_CHECKING:
    from .metrics import StreamingMetrics

__all__ = ["OPENING", "PerStreamChannel", "PerStreamReceiver"]

logger = logging.getLogger(__name__)

OPENING = struct.Struct(">QQ")
"""The 16 bytes that open a per-stream QUIC stream: anchor local id, routing session id."""


class PerStreamChannel:
    """The producer's end: frames onto a QUIC stream of its own, backpressure by awaiting."""

    __slots__ = ("_closed", "_metrics", "_stream")

    def __init__(
        self, stream: OutboundStream, local_id: int, session_id: int, metrics: StreamingMetrics
    ) -> None:
        self._stream = stream
        self._metrics = metrics
        self._closed = False
        # The opening is the stream's first frame, ahead of every record (FIFO gate).
        stream.send(OPENING.pack(local_id, session_id))

    @property
    def closed(self) -> bool:
        return self._closed or self._stream.gate.closed

    def try_send(self, body: bytes) -> bool:
        if self.closed or not self._stream.can_send_now(len(body)):
            return False
        self._stream.send(body)
        self._metrics.frames_written += 1
        return True

    async def send(self, body: bytes) -> None:
        if self.closed:
            raise ChannelClosed("the stream's channel is closed")
        outcome = self._stream.send(body)
        self._metrics.frames_written += 1
        if isinstance(outcome, SendAdmission):
            self._metrics.producer_send_backpressure += 1
            try:
                await outcome
            except AdmissionError as exc:
                raise ChannelClosed(f"the stream's channel closed: {exc}") from exc

    def send_terminal(self, body: bytes, done: asyncio.Future[bool]) -> None:
        self._closed = True
        stream = self._stream
        outcome = stream.send(body)
        self._metrics.frames_written += 1
        if isinstance(outcome, SendAdmission):

            def resolved(admission: SendAdmission) -> None:
                admitted = admission.error is None
                if admitted:
                    stream.finish()
                if not done.done():
                    done.set_result(admitted)

            outcome.on_resolved(resolved)
        else:
            stream.finish()
            if not done.done():
                done.set_result(True)

    def abort(self) -> None:
        self._closed = True
        self._stream.abort()


class PerStreamReceiver:
    """The consumer's end of one per-stream QUIC stream, and the anchor's feed.

    Frames are decoded as data arrives and wait here until the anchor takes them; the
    QUIC window granted is what the anchor took plus ``window``, so this buffer is bounded.
    """

    __slots__ = (
        "_connection",
        "_decoder",
        "_frames",
        "_loop",
        "_metrics",
        "_window",
        "consumed",
        "ended",
        "last_arrival",
        "opening",
        "stream_id",
        "terminal",
        "withdrawn",
    )

    def __init__(
        self,
        connection: PeerConnection,
        stream_id: int,
        window: int,
        max_message_size: int,
        metrics: StreamingMetrics,
    ) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self._window = window
        self._decoder = FrameDecoder(max_message_size)
        self._frames: deque[bytes] = deque()
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self.consumed = 0
        self.opening: tuple[int, int] | None = None
        self.terminal: bytes | None = None
        self.ended = False
        self.withdrawn = False
        self.last_arrival = self._loop.time()
        connection.quic.manage_receive_window(stream_id, self._consumed, window)

    def _consumed(self) -> int:
        return self.consumed

    @property
    def peer(self) -> InstanceId | None:
        return self._connection.peer

    def data(self, data: bytes, end_stream: bool) -> bool:
        """New stream data; returns True when frames became readable."""
        self.last_arrival = self._loop.time()
        if self.withdrawn:
            return False
        readable = False
        if data:
            try:
                bodies = self._decoder.feed(data)
            except FrameTooLarge as exc:
                self._frames.extend(exc.frames)
                self._frames.append(encode_transport_error(f"per-stream frame refused: {exc}"))
                self.ended = True
                self._connection.stop_receiving(self.stream_id, CloseCode.FRAME_TOO_LARGE)
                return True
            if bodies and self.opening is None:
                first = bodies.pop(0)
                self.consumed += len(first) + 4
                if len(first) != OPENING.size:
                    self.ended = True
                    self._connection.stop_receiving(self.stream_id)
                    return False
                self.opening = OPENING.unpack(first)
            if bodies:
                last = bodies[-1]
                if is_terminal_sentinel(last):
                    self.terminal = last
                self._frames.extend(bodies)
                self._metrics.frames_received += len(bodies)
                readable = True
        if end_stream:
            self.ended = True
            readable = True
        return readable

    def lost(self) -> None:
        """The stream was reset or its connection died: whatever is buffered is all there is."""
        self.ended = True

    # -- Feed ----------------------------------------------------------------------------

    def take(self) -> bytes | None:
        frames = self._frames
        if not frames:
            return None
        body = frames.popleft()
        before = self.consumed
        self.consumed = before + len(body) + 4
        # Let QUIC grant the next quarter window promptly, without a transmit per record.
        quarter = self._window >> 2
        if before // quarter != self.consumed // quarter:
            self._connection.transmit_soon()
        return body

    @property
    def exhausted(self) -> bool:
        return self.ended and not self._frames

    def withdraw(self) -> None:
        if self.withdrawn:
            return
        self.withdrawn = True
        self._frames.clear()
        if not self.ended:
            self.ended = True
            try:
                self._connection.stop_receiving(self.stream_id)
            except Exception:  # connection already gone
                logger.debug("could not stop stream %d", self.stream_id, exc_info=True)
