"""The receive side of a connection: stream data into lanes, requests and per-stream inbound.

:class:`ConnectionReceiving` is the half of
:class:`~velomux_quic.transport.connection.PeerConnection` that takes what arrives on
streams: :meth:`~ConnectionReceiving._stream_data` routes each STREAM event to the
request/reply streams, to an inbound lane (its frame decoder, the pause/resume that holds
frames back, the window granted from what the layer above consumed), or to the layers
above (the per-stream path); it refuses a stream nobody claims, and handles a peer's
RESET_STREAM and STOP_SENDING, and our own STOP_SENDING.

:mod:`.connection` keeps the rest: the connection's lifecycle (dial, handshake and peer
verification, close, termination), the datagrams in and the dispatch of aioquic's events,
the send side (lanes, per-stream streams, their gates), pings, timers and transmit. The
two are separate because they change for different reasons (how the bytes of a stream
become frames for a handler, against how a connection comes up, goes down and puts
datagrams on the wire), and each stays small enough to read whole.

They are one class at runtime: ``PeerConnection`` inherits this mixin, so the event
dispatch reaching ``self._stream_data`` and the lane path reaching ``self.close`` or
``self.transmit_soon`` cost exactly what they did in a single class, with no other object
to load and no forwarding call. This class declares, for the type checker, the state the
connection's constructor sets and the methods of the connection it calls.
``_stream_data`` and the lane path (``_lane_data``, ``_feed``, ``_deliver``) run once per
STREAM frame: keep them free of extra calls and attribute lookups.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from aioquic.quic import events as quic_events

from ..ids import InstanceId
from .errors import ChannelClosed
from .framing import FrameTooLarge
from .lanes import InboundLane, OutboundStream, lane_of_stream, stream_of_lane
from .requests import IncomingRequests, OutgoingRequests
from .states import CloseCode, ConnectionState

if TYPE_CHECKING:
    from .endpoint import QuicTransport
    from .engine import EngineConnection

__all__ = ["ConnectionReceiving"]

# The connection's logger, as before this half had a module of its own: one logger
# for everything a connection reports.
logger = logging.getLogger("velomux_quic.transport.connection")


class ConnectionReceiving:
    """The stream-receiving methods of :class:`~velomux_quic.transport.connection.PeerConnection`.

    The handler's stream callbacks take the ``PeerConnection`` that ``self`` always is at
    runtime; the three calls that pass ``self`` say so to the type checker with an ignore.
    """

    # Set by PeerConnection.__init__; declared here because the receive side reads them.
    transport: QuicTransport
    quic: EngineConnection
    is_client: bool
    peer: InstanceId | None
    state: ConnectionState
    requests_out: OutgoingRequests
    requests_in: IncomingRequests
    _inbound: dict[int, InboundLane]
    _extra: dict[int, OutboundStream]
    _blocked: set[OutboundStream]

    if TYPE_CHECKING:
        # PeerConnection: lifecycle and transmit.

        def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None: ...
        def transmit_soon(self) -> None: ...
        def _peer_name(self) -> str: ...

    # -- lanes ---------------------------------------------------------------------------

    def pause_reading(self, lane: int) -> None:
        state = self._inbound.get(stream_of_lane(lane))
        if state is not None:
            state.paused = True

    def resume_reading(self, lane: int) -> None:
        state = self._inbound.get(stream_of_lane(lane))
        if state is None or not state.paused:
            return
        state.paused = False
        self._drain_inbound(state)
        self.transmit_soon()  # the consumed bytes open the peer's window

    def _inbound_lane(self, stream_id: int, lane: int) -> InboundLane:
        state = self._inbound.get(stream_id)
        if state is None:
            assert self.peer is not None
            paused = self.transport.is_reading_paused(self.peer, lane)
            state = InboundLane(lane, stream_id, self.transport.config.max_message_size, paused)
            self._inbound[stream_id] = state
            self.quic.manage_receive_window(
                stream_id, state.consumed_bytes, self.transport.config.lane_window
            )
        return state

    def _lane_data(self, state: InboundLane, data: bytes) -> None:
        if state.paused or state.held or state.backlog:
            state.backlog.append(data)
            return
        self._feed(state, data)

    def _feed(self, state: InboundLane, data: bytes) -> None:
        state.consumed += len(data)
        try:
            bodies = state.decoder.feed(data)
        except FrameTooLarge as exc:
            if exc.frames:
                self._deliver(state, exc.frames)
            self.transport.stats.rejections["oversized_frame"] += 1
            logger.warning(
                "closing connection from %s: lane %d: %s", self._peer_name(), state.lane, exc
            )
            self.close(CloseCode.FRAME_TOO_LARGE, str(exc))
            return
        if not bodies:
            return
        stats = self.transport.stats
        stats.frames_in += len(bodies)
        stats.bytes_in += len(data)
        self._deliver(state, bodies)

    def _deliver(self, state: InboundLane, bodies: list[bytes] | deque[bytes]) -> None:
        handler = self.transport.handler.frame_received
        peer = self.peer
        assert peer is not None
        lane = state.lane
        for index, body in enumerate(bodies):
            try:
                handler(peer, lane, body)
            except Exception:
                self.transport.stats.rejections["handler_error"] += 1
                logger.exception("frame handler failed for a frame from %s lane %d", peer, lane)
            if state.paused:
                state.held.extend(list(bodies)[index + 1 :])
                return

    def _drain_inbound(self, state: InboundLane) -> None:
        if state.held:
            held = list(state.held)
            state.held.clear()
            self._deliver(state, held)
        while state.backlog and not state.paused and not state.held:
            self._feed(state, state.backlog.popleft())
            if self.state is not ConnectionState.ESTABLISHED:
                return

    # -- stream data, resets and stops ---------------------------------------------------

    def _stream_data(self, event: quic_events.StreamDataReceived) -> None:
        if self.state is not ConnectionState.ESTABLISHED or self.peer is None:
            # Defence in depth: the handshake cannot complete unverified, but never let
            # bytes from an unverified connection near a handler.
            self.transport.stats.rejections["unverified_data"] += 1
            self.close(CloseCode.UNVERIFIED_PEER, "data before verification")
            return
        stream_id = event.stream_id
        if self.is_client:
            if stream_id & 0x3 == 0x1:  # the accepting side asks us for something
                self.requests_in.data(stream_id, event.data, event.end_stream)
            else:
                self.transport.stats.rejections["unexpected_stream"] += 1
                self._refuse_stream(stream_id)
            return
        lane = lane_of_stream(stream_id)
        if lane is None:
            if self.requests_out.owns(stream_id):
                self.requests_out.data(stream_id, event.data, event.end_stream)
            elif not self.transport.handler.stream_received(self, event):  # type: ignore[arg-type]
                # Not a lane: the layers above may claim such streams (the per-stream
                # path); until one does, refuse the stream without harming the connection.
                self.transport.stats.rejections["unexpected_stream"] += 1
                self._refuse_stream(stream_id)
            return
        state = self._inbound_lane(stream_id, lane)
        if event.data:
            self._lane_data(state, event.data)
        if event.end_stream:
            self._lane_finished(state)

    def _refuse_stream(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        try:
            self.quic.stop_stream(stream_id, int(code))
        except Exception:  # stream already finished or not receivable: nothing to stop
            logger.debug("could not stop stream %d", stream_id, exc_info=True)

    def _lane_finished(self, state: InboundLane) -> None:
        if state.decoder.buffered_bytes:
            self.transport.stats.rejections["truncated_frame"] += 1
        self._forget_inbound(state)

    def _stop_sending(self, stream_id: int) -> None:
        """The receiver no longer wants a stream we write (a cancelled per-stream stream)."""
        stream = self._extra.pop(stream_id, None)
        if stream is None:
            self.requests_in.stopped(stream_id)
            return
        self._blocked.discard(stream)
        stream.finished = True
        stream.gate.close(ChannelClosed("the receiver stopped the stream"))
        try:
            self.quic.reset_stream(stream_id, int(CloseCode.SHUTDOWN))
        except Exception:  # already finished: nothing to reset
            logger.debug("could not reset stream %d", stream_id, exc_info=True)
        self.transmit_soon()
        self.transport.handler.stream_stopped(self, stream_id)  # type: ignore[arg-type]

    def stop_receiving(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        """Ask the peer to stop a stream it writes to us (STOP_SENDING), and forget it."""
        self.quic.forget_stream(stream_id)
        self._refuse_stream(stream_id, code)
        self.transmit_soon()

    def _stream_reset(self, stream_id: int, error_code: int) -> None:
        if self.requests_out.owns(stream_id):
            self.requests_out.reset(stream_id, error_code)
            return
        if lane_of_stream(stream_id) is None and not self.is_client:
            if self.peer is not None:
                self.transport.handler.stream_reset(self, stream_id, error_code)  # type: ignore[arg-type]
            return
        state = self._inbound.get(stream_id)
        if state is None or self.peer is None:
            return
        self._forget_inbound(state)
        self.transport.handler.lane_reset(self.peer, state.lane)

    def _forget_inbound(self, state: InboundLane) -> None:
        self._inbound.pop(state.stream_id, None)
        self.quic.forget_stream(state.stream_id)
