"""The per-stream QUIC path (``quic-stream-v1``): one QUIC stream per stream.

Each stream gets its own unidirectional QUIC stream on the producer's outbound connection:
length-prefixed frames, the first of which is the 16-byte opening
``[u64 anchor_local_id][u64 routing_session_id]`` that claims the bind the attach made,
then FIN after the terminal. It serves peers
without the mux, and it is the baseline the mux is measured against.

Flow control is QUIC's, per stream: the consumer's anchor reads the receiver's buffer
directly (:class:`PerStreamReceiver` is its feed), and only what it takes opens the
producer's window. A consumer that stops reading therefore stops its producer, and only it.

Backpressure on the producer is the transport's admission gate, one per stream, bounded by
what QUIC has not transmitted yet: the stream's own unsent bytes
(``StreamingConfig.per_stream_send_buffer``) and the connection's per-stream backlog
(``TransportConfig.streams_send_buffer``). ``send`` waits while either is full and resumes
when aioquic transmits (or the peer's window opens); ``try_send`` says False instead, which
is how a heartbeat is dropped on a full channel. A heartbeat is measured against its own
stream's bound only: other streams keeping the connection busy do not silence it.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import AdmissionError, ChannelClosed, FrameTooLarge
from ..ids import InstanceId
from ..transport import (
    CloseCode,
    FrameDecoder,
    PeerLink,
    PerStreamOutbound,
    SendAdmission,
    StreamData,
    StreamReset,
    TransportHandler,
    lane_of_stream,
)
from .config import StreamingConfig
from .control import PER_STREAM_KEY
from .frames import DETACHED, HEARTBEAT, encode_transport_error, is_terminal_sentinel
from .snapshot import PerStreamSnapshot
from .transports import AttachTerms, BindTerms

if TYPE_CHECKING:
    from ..messenger import Messenger
    from .anchor import AnchorEntry, RemoteSender
    from .metrics import StreamingMetrics

__all__ = [
    "OPENING",
    "PerStreamChannel",
    "PerStreamReceiver",
    "PerStreamSnapshot",
    "PerStreamTransport",
]

logger = logging.getLogger(__name__)

OPENING = struct.Struct(">QQ")
"""The 16 bytes that open a per-stream QUIC stream: anchor local id, routing session id."""


class PerStreamChannel:
    """The producer's end: frames onto a QUIC stream of its own, backpressure by awaiting.

    A frame that fits is written at once and allocates nothing; one that does not waits
    in the stream's gate (FIFO behind the stream's earlier frames, and in turn with the
    connection's other per-stream streams) and ``send`` awaits its admission.
    """

    __slots__ = ("_closed", "_metrics", "_stream")

    def __init__(
        self,
        stream: PerStreamOutbound,
        local_id: int,
        session_id: int,
        metrics: StreamingMetrics,
    ) -> None:
        self._stream = stream
        self._metrics = metrics
        self._closed = False
        # The opening is the stream's first frame, ahead of every record (FIFO gate).
        stream.send(OPENING.pack(local_id, session_id))

    @property
    def closed(self) -> bool:
        return self._closed or self._stream.gate.closed

    @property
    def credit(self) -> int | None:
        """None: this path's window is QUIC's, in bytes, not a count of records."""
        return None

    @property
    def lane(self) -> None:
        """None: a per-stream path stream has its own QUIC stream, not a lane."""
        return None

    @property
    def queued_bytes(self) -> int:
        """Bytes written to the QUIC stream that aioquic has not transmitted yet."""
        return self._stream.unsent_bytes

    def try_send(self, body: bytes) -> bool:
        """Write now or return False (full, or closed); never waits, never queues.

        The heartbeat (the manager passes the one ``HEARTBEAT`` object) only needs room in
        its own stream: a stream whose channel is full has its heartbeat dropped, one
        whose neighbours fill the connection does not.
        """
        if self._closed or not self._stream.try_send(body, shared=body is not HEARTBEAT):
            return False
        self._metrics.frames_written += 1
        self._metrics.egress_flushes += 1  # one stream write per frame on this path
        return True

    async def send(self, body: bytes) -> None:
        """Write, waiting while the stream or the connection's per-stream backlog is full.

        Raises :class:`ChannelClosed` if the stream closes first (the consumer cancelled,
        the connection died, the node is closing). A caller cancelled while waiting
        withdraws its frame: it is never written, so a retry cannot duplicate it.
        """
        if self.closed:
            raise ChannelClosed("the stream's channel is closed")
        outcome = self._stream.send(body)
        if isinstance(outcome, SendAdmission):
            # A wait here is counted once by StreamSender.send, alike on every channel.
            try:
                await outcome
            except AdmissionError as exc:
                raise ChannelClosed(f"the stream's channel closed: {exc}") from exc
            except asyncio.CancelledError:
                outcome.cancel()
                raise
        self._metrics.frames_written += 1
        self._metrics.egress_flushes += 1  # one stream write per frame on this path

    def after_records(self, stage: Callable[[], None]) -> None:
        stage()  # each record was written to the QUIC stream as it was sent

    def send_terminal(self, body: bytes, done: asyncio.Future[bool]) -> None:
        self._closed = True
        stream = self._stream
        outcome = stream.send(body)
        self._metrics.frames_written += 1
        self._metrics.egress_flushes += 1  # one stream write per frame on this path
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

    def end_now(self, body: bytes, done: asyncio.Future[bool]) -> None:
        """The node is closing: the terminal goes at once if the stream has room; behind
        frames waiting for the consumer's window it would wait as long as they do, so the
        stream is reset instead (its consumer reads what arrived, then SenderDropped)."""
        if self._stream.gate.pending_count:
            self.abort()
            done.set_result(False)
            return
        self.send_terminal(body, done)

    def abort(self) -> None:
        self._closed = True
        self._stream.abort()


class PerStreamReceiver:
    """The consumer's end of one per-stream QUIC stream, and the anchor's feed.

    Frames are decoded as data arrives and wait here until the anchor takes them; the
    QUIC window granted is what the anchor took plus ``window``, so this buffer is bounded.
    """

    __slots__ = (
        "_decoder",
        "_frames",
        "_link",
        "_loop",
        "_metrics",
        "_saturated",
        "_window",
        "buffered",
        "consumed",
        "ended",
        "last_arrival",
        "opening",
        "remote",
        "stream_id",
        "terminal",
        "withdrawn",
    )

    def __init__(
        self,
        link: PeerLink,
        stream_id: int,
        window: int,
        max_message_size: int,
        metrics: StreamingMetrics,
    ) -> None:
        self._link = link
        self.stream_id = stream_id
        self._window = window
        self._decoder = FrameDecoder(max_message_size)
        self._frames: deque[bytes] = deque()
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self.consumed = 0
        self.buffered = 0
        self._saturated = False
        self.opening: tuple[int, int] | None = None
        self.remote: RemoteSender | None = None
        self.terminal: bytes | None = None
        self.ended = False
        self.withdrawn = False
        self.last_arrival = self._loop.time()
        link.manage_receive_window(stream_id, self._consumed, window)

    def _consumed(self) -> int:
        return self.consumed

    @property
    def peer(self) -> InstanceId:
        return self._link.peer

    def data(self, data: bytes, end_stream: bool) -> bool:
        """New stream data; returns True when frames became readable."""
        now = self.last_arrival = self._loop.time()
        if self.remote is not None:
            self.remote.last_arrival = now  # what the consumer's watchdog reads
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
                self._link.stop_receiving(self.stream_id, CloseCode.FRAME_TOO_LARGE)
                return True
            if bodies and self.opening is None:
                first = bodies.pop(0)
                self.consumed += len(first) + 4
                if len(first) != OPENING.size:
                    self.ended = True
                    self._link.stop_receiving(self.stream_id)
                    return False
                self.opening = OPENING.unpack(first)
            if bodies:
                last = bodies[-1]
                if is_terminal_sentinel(last):
                    self.terminal = last
                self._frames.extend(bodies)
                self._metrics.frames_received += len(bodies)
                self.buffered += len(data)
                if not self._saturated and self.buffered >= self._window - (self._window >> 3):
                    # The anchor is not keeping up: the window is (nearly) all used and the
                    # producer is about to wait. Counted once per episode.
                    self._saturated = True
                    self._metrics.reader_pump_backpressure += 1
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
        size = len(body) + 4
        self.consumed = before + size
        self.buffered -= size
        if self._saturated and self.buffered < self._window >> 1:
            self._saturated = False
        # Let QUIC grant the next quarter window promptly, without a transmit per record.
        quarter = self._window >> 2
        if before // quarter != self.consumed // quarter:
            self._link.grant_soon()
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
                self._link.stop_receiving(self.stream_id)
            except Exception:  # connection already gone
                logger.debug("could not stop stream %d", self.stream_id, exc_info=True)


class PerStreamTransport(TransportHandler):
    """``quic-stream-v1``: binds on the consumer, QUIC streams of their own on the producer.

    It is also the messenger's stream acceptor: the QUIC streams that are not lanes arrive
    here, are matched to a bind by their opening frame, and become their anchor's feed.
    """

    key = PER_STREAM_KEY

    def __init__(
        self, messenger: Messenger, config: StreamingConfig, metrics: StreamingMetrics
    ) -> None:
        self._messenger = messenger
        self._config = config
        self._metrics = metrics
        self._binds: dict[tuple[InstanceId | None, int, int], tuple[AnchorEntry, RemoteSender]] = {}
        self._receivers: dict[
            tuple[PeerLink, int], tuple[PerStreamReceiver, AnchorEntry | None]
        ] = {}

    def snapshot(self) -> PerStreamSnapshot:
        """Live binds and receivers, for operators and for tests that prove none leak."""
        return PerStreamSnapshot(
            binds=len(self._binds),
            receivers=len(self._receivers),
            buffered_bytes=sum(receiver.buffered for receiver, _ in self._receivers.values()),
        )

    # -- StreamTransport -----------------------------------------------------------------

    def bind(self, entry: AnchorEntry, remote: RemoteSender) -> BindTerms:
        """Expect the attach's stream: its opening frame will name this anchor and session."""
        self._binds[(remote.node, entry.local_id, remote.session_id)] = (entry, remote)
        return BindTerms()

    def unbind(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """The stream ended, its attach failed or its sender left before its stream came:
        forget the bind, and the receiver's way back to the sender (each refers to the
        other, which would leave every ended stream to the cyclic collector)."""
        self._binds.pop((remote.node, entry.local_id, remote.session_id), None)
        receiver = remote.receiver
        if isinstance(receiver, PerStreamReceiver):
            receiver.remote = None

    async def connect(self, terms: AttachTerms) -> PerStreamChannel:
        """The producer's side of an accepted attach: a QUIC stream of its own to the consumer."""
        stream = self._messenger.transport.open_stream(
            terms.peer, send_buffer=self._config.per_stream_send_buffer
        )
        return PerStreamChannel(
            stream, terms.handle.local_id, terms.routing_session_id, self._metrics
        )

    async def close(self) -> None:
        """The node is closing: forget every bind and receiver (their connections close too)."""
        self._binds.clear()
        self._receivers.clear()

    # -- QUIC streams arriving (forwarded by the messenger) ------------------------------

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        """A per-stream stream's data: decode it into its receiver, bind it on its opening."""
        stream_id = event.stream_id
        key = (link, stream_id)
        known = self._receivers.get(key)
        if known is None:
            if link.outbound or stream_id & 0x3 != 0x2 or lane_of_stream(stream_id) is not None:
                return False
            receiver = PerStreamReceiver(
                link,
                stream_id,
                self._config.per_stream_window,
                self._messenger.transport.config.max_message_size,
                self._metrics,
            )
            known = (receiver, None)
            self._receivers[key] = known
        receiver, entry = known
        readable = receiver.data(event.data, event.end_stream)
        if entry is None and receiver.opening is not None:
            entry = self._bind_stream(receiver)
            if entry is None:
                del self._receivers[key]
                return True
            self._receivers[key] = (receiver, entry)
        if entry is not None:
            if receiver.terminal == DETACHED and not entry.mpsc:
                # The Detached is in the buffer the anchor reads: a new sender may attach
                # now; the inbox reads it only after this one (ordered feeds).
                entry.attached = False
            if readable:
                entry.inbox.wake()
        if receiver.ended:
            self._receivers.pop(key, None)
        return True

    def _bind_stream(self, receiver: PerStreamReceiver) -> AnchorEntry | None:
        assert receiver.opening is not None
        local_id, session_id = receiver.opening
        bound = self._binds.pop((receiver.peer, local_id, session_id), None)
        if bound is None or bound[0].finished:
            self._metrics.refused_streams += 1
            logger.debug(
                "refusing a per-stream stream from %s: no bind %x/%d",
                receiver.peer,
                local_id,
                session_id,
            )
            receiver.withdraw()
            return None
        entry, remote = bound
        remote.last_arrival = receiver.last_arrival
        receiver.remote = remote
        remote.receiver = receiver
        entry.inbox.install_feed(receiver, remote.sender_id)
        return entry

    def stream_reset(self, link: PeerLink, event: StreamReset) -> None:
        """The producer reset its stream: what its receiver buffered is all there is."""
        known = self._receivers.pop((link, event.stream_id), None)
        if known is not None:
            receiver, entry = known
            receiver.lost()
            if entry is not None:
                entry.inbox.wake()

    def connection_lost(self, link: PeerLink) -> None:
        """Every stream of the connection is over: their anchors read what is left, then end."""
        for key in [k for k in self._receivers if k[0] is link]:
            receiver, entry = self._receivers.pop(key)
            receiver.lost()
            if entry is not None:
                entry.inbox.wake()
