"""What arrives on one connection's streams: lanes into frames, openings, requests.

A connection this node accepted reads lanes: each lane's bytes go through its frame
decoder (:class:`~.lanes.InboundLane`) to the handler's ``frame_received``, in turns the
peer shares with every other peer of the node (:class:`~.admission.PeerHoldings`), held
back while the layer above paused the lane. The bytes of unfinished frames are bounded
over all of the peer's connections (``max_partial_frame_bytes``) and a frame on which
nothing arrives for ``partial_frame_timeout`` closes the connection (the sweep). The
streams that are not lanes (the per-stream path's) are handed up as :mod:`.events` once
their openings pass :mod:`.openings`' bounds; request streams go to :mod:`.requests`.

:class:`InboundStreams` is sans-IO: it is given ``now`` and answers with the time it next
wants to be called (the sweep, the oldest opening's deadline), which the connection keeps
among its :class:`~.deadlines.Deadline`; what it cannot do itself (close the connection,
transmit, wake earlier for an opening) it asks of its :class:`InboundHost`.

:meth:`InboundStreams.stream_data` and the lane path (``_lane_data``, ``_feed``,
``_deliver``) run once per STREAM frame: keep them free of extra calls and attribute
lookups.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..ids import InstanceId
from .admission import PeerHoldings
from .events import PeerLink, StreamData, StreamReset
from .framing import FrameTooLarge
from .handler import EndpointServices
from .lanes import InboundLane, lane_of_stream, stream_of_lane
from .openings import DROP, REFUSED_TIMEOUT, StreamOpenings
from .requests import IncomingRequests, OutgoingRequests
from .seam import StreamDataReceived
from .states import CloseCode

__all__ = ["InboundEngine", "InboundHost", "InboundOwner", "InboundStreams"]

logger = logging.getLogger(__name__)


class InboundEngine(Protocol):
    """What the inbound side asks of the connection's QUIC engine: receive windows only."""

    def manage_receive_window(
        self, stream_id: int, consumed: Callable[[], int], window: int
    ) -> None: ...

    def forget_stream(self, stream_id: int) -> None: ...

    def stop_stream(self, stream_id: int, error_code: int) -> None: ...


class InboundOwner(EndpointServices, Protocol):
    """What the inbound side asks of the node's endpoint (a ``ConnectionOwner`` is one)."""

    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool: ...


class InboundHost(Protocol):
    """What the inbound side asks of its connection."""

    def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None:
        """Close the connection now (a peer past a bound)."""

    def transmit_soon(self) -> None:
        """Transmit once the loop has handed over what arrived: consumed bytes open the
        peer's windows, and a STOP_SENDING should leave promptly."""

    def openings_due(self, at: float) -> None:
        """An opening began while none was pending: call :meth:`InboundStreams.expire_openings`
        at ``at``."""


class InboundStreams:
    """The receive side of one connection (see the module docstring)."""

    __slots__ = (
        "_closing",
        "_holdings",
        "_host",
        "_inbound",
        "_is_client",
        "_lane_window",
        "_max_message_size",
        "_openings",
        "_openings_at",
        "_owner",
        "_partial_limit",
        "_partial_timeout",
        "_quic",
        "_receiving",
        "_stats",
        "_time",
        "_turn_waiting",
        "link",
        "partial_bytes",
        "peer",
        "requests_in",
        "requests_out",
    )

    def __init__(
        self,
        host: InboundHost,
        owner: InboundOwner,
        quic: InboundEngine,
        time: Callable[[], float],
        *,
        is_client: bool,
        requests_in: IncomingRequests,
        requests_out: OutgoingRequests,
    ) -> None:
        config = owner.config
        self._host = host
        self._owner = owner
        self._quic = quic
        self._time = time
        """The connection's clock, read when a stream's opening begins."""
        self._stats = owner.stats
        self._is_client = is_client
        self.requests_in = requests_in
        self.requests_out = requests_out
        self._max_message_size = config.max_message_size
        self._lane_window = config.lane_window
        self._partial_limit = config.partial_frame_limit
        self._partial_timeout = config.partial_frame_timeout
        self._inbound: dict[int, InboundLane] = {}
        self.partial_bytes = 0
        """Bytes of unfinished frames across the inbound lanes (``max_partial_frame_bytes``)."""
        self._holdings: PeerHoldings | None = None
        """What the peer's connections hold together, from establishment to the end."""
        self._turn_waiting = False
        self._closing = False
        """This side closed the connection: what still arrives is nobody's, not refused."""
        self._openings = StreamOpenings(
            config.max_stream_openings,
            config.max_stream_opening_size,
            config.stream_opening_timeout,
        )
        self._openings_at: float | None = None
        """The openings deadline last reported to the connection (None: none is due)."""
        self.link: PeerLink | None = None
        """The connection's link, from its establishment on."""
        self._receiving: PeerLink | None = None
        """The link while the connection is established (None before, and once it is
        closing): what arrives without one is refused."""
        self.peer: InstanceId | None = None
        """The verified peer, from establishment on."""

    # -- the connection's lifecycle --------------------------------------------------------

    def established(
        self, link: PeerLink, holdings: PeerHoldings | None, now: float
    ) -> float | None:
        """The peer is verified: take its data from now on. The time of the first sweep for
        stalled frames (None on a dialed connection, which reads no lanes)."""
        self.link = self._receiving = link
        self.peer = link.peer
        self._holdings = holdings
        return None if self._is_client else now + self._partial_timeout

    def closing(self) -> None:
        """The connection is closing: nothing more that arrives is the handler's, and its
        unfinished frames, which can never finish now, are let go at once. Counted for the
        peer until the connection ended, they would close its other connections too while
        this one drains."""
        self._receiving = None
        self._closing = True
        self._let_go()

    def ended(self) -> None:
        """The connection ended: its unfinished frames no longer count for its peer."""
        self._receiving = None
        self._let_go()
        self._openings.clear()
        self._openings_at = None

    def _let_go(self) -> None:
        """Drop the lanes' unfinished frames and what waited to be fed, and take their
        bytes off the peer's count."""
        holdings = self._holdings
        if holdings is not None:
            self._holdings = None
            holdings.partial_bytes -= self.partial_bytes
        self.partial_bytes = 0
        self._inbound.clear()

    @property
    def lanes(self) -> tuple[int, ...]:
        """The lanes being read, in order (for the snapshot)."""
        return tuple(sorted(state.lane for state in self._inbound.values()))

    @property
    def openings_pending(self) -> int:
        return self._openings.pending

    # -- pausing ---------------------------------------------------------------------------

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
        self._host.transmit_soon()  # the consumed bytes open the peer's window

    # -- stream data -----------------------------------------------------------------------

    def stream_data(self, event: StreamDataReceived) -> None:
        link = self._receiving
        if link is None:
            if self._closing:
                return  # arrived after this side closed the connection: nobody's now
            # Defence in depth: the handshake cannot complete unverified, but never let
            # bytes from an unverified connection near a handler.
            self._stats.rejections["unverified_data"] += 1
            self._host.close(CloseCode.UNVERIFIED_PEER, "data before verification")
            return
        stream_id = event.stream_id
        if self._is_client:
            if stream_id & 0x3 == 0x1:  # the accepting side asks us for something
                self.requests_in.data(stream_id, event.data, event.end_stream)
            else:
                self._stats.rejections["unexpected_stream"] += 1
                self._refuse_stream(stream_id)
            return
        lane = lane_of_stream(stream_id)
        if lane is None:
            if self.requests_out.owns(stream_id):
                self.requests_out.data(stream_id, event.data, event.end_stream)
                return
            openings = self._openings
            if stream_id not in openings.opened:  # its opening is still to come
                refusal = openings.admit(stream_id, event.data, self._time())
                if refusal is not None:
                    if refusal != DROP:
                        self._refuse_opening(link, stream_id, refusal)
                    return
                if openings.pending and self._openings_at is None:
                    at = openings.next_deadline()
                    assert at is not None
                    self._openings_at = at
                    self._host.openings_due(at)
            if not self._owner.handler.stream_received(
                link, StreamData(stream_id, event.data, event.end_stream)
            ):
                # Not a lane: the layers above may claim such streams (the per-stream
                # path); until one does, refuse the stream without harming the connection.
                self._stats.rejections["unexpected_stream"] += 1
                self._openings.ended(stream_id)
                self._refuse_stream(stream_id)
            elif event.end_stream:
                self._openings.ended(stream_id)
            return
        state = self._inbound_lane(stream_id, lane)
        if event.data:
            self._lane_data(state, event.data)
        if event.end_stream:
            self._lane_finished(state)

    def _inbound_lane(self, stream_id: int, lane: int) -> InboundLane:
        state = self._inbound.get(stream_id)
        if state is None:
            peer = self.peer
            assert peer is not None
            paused = self._owner.is_reading_paused(peer, lane)
            state = InboundLane(lane, stream_id, self._max_message_size, paused)
            self._inbound[stream_id] = state
            self._quic.manage_receive_window(stream_id, state.consumed_bytes, self._lane_window)
        return state

    def _lane_data(self, state: InboundLane, data: bytes) -> None:
        if state.paused or state.held or state.backlog:
            state.backlog.append(data)
            return
        holdings = self._holdings
        if holdings is not None:
            taken = holdings.take_turn(len(data))
            if taken < len(data):  # the peer's share of this turn is spent
                state.backlog.append(data[taken:] if taken else data)
                self._wait_turn(holdings)
                if not taken:
                    return
                data = data[:taken]
        self._feed(state, data)

    # -- the peer's turns --------------------------------------------------------------------

    def _wait_turn(self, holdings: PeerHoldings) -> None:
        if not self._turn_waiting:
            self._turn_waiting = True
            self._stats.turns_waited += 1
            holdings.defer(self._next_turn)

    def _next_turn(self) -> None:
        """The peer's next share: feed what waited, lane by lane, while the share lasts."""
        self._turn_waiting = False
        holdings = self._holdings
        receiving = self._receiving  # read again below: the data fed may close the connection
        if holdings is None or receiving is None:
            return
        for state in list(self._inbound.values()):
            backlog = state.backlog
            while backlog and not state.paused and not state.held:
                data = backlog.popleft()
                taken = holdings.take_turn(len(data))
                if taken < len(data):
                    backlog.appendleft(data[taken:] if taken else data)
                    self._wait_turn(holdings)
                    self._host.transmit_soon()
                    if taken:
                        self._feed(state, data[:taken])
                    return
                self._feed(state, data)
                if self._receiving is None:  # its data closed the connection
                    return
        self._host.transmit_soon()  # what was consumed opens the peer's window

    # -- frames ------------------------------------------------------------------------------

    def _feed(self, state: InboundLane, data: bytes) -> None:
        state.consumed += len(data)
        decoder = state.decoder
        try:
            bodies = decoder.feed(data)
        except FrameTooLarge as exc:
            if exc.frames:
                self._deliver(state, exc.frames)
            self._stats.rejections["oversized_frame"] += 1
            logger.warning(
                "closing connection from %s: lane %d: %s", self._peer_name(), state.lane, exc
            )
            self._host.close(CloseCode.FRAME_TOO_LARGE, str(exc))
            return
        partial = decoder.buffered_bytes
        if partial != state.partial:
            grown = partial - state.partial
            self.partial_bytes += grown
            state.partial = partial
            holdings = self._holdings
            held = self.partial_bytes
            if holdings is not None:
                holdings.partial_bytes += grown
                held = holdings.partial_bytes
            if held > self._partial_limit:
                self._too_much_partial(bodies, state)
                return
        if not bodies:
            return
        stats = self._stats
        stats.frames_in += len(bodies)
        stats.bytes_in += len(data)
        self._deliver(state, bodies)

    def _too_much_partial(self, bodies: list[bytes], state: InboundLane) -> None:
        """The peer's lanes hold more unfinished frames than ``max_partial_frame_bytes``
        (over all of its connections): close this one, the one that passed it.

        Each lane's frame is within ``max_message_size``, but a peer starting one on every
        lane of every connection at once and finishing none is spending this node's
        memory, not sending.
        """
        if bodies:
            self._deliver(state, bodies)
        self._stats.rejections["partial_frame_bytes"] += 1
        logger.warning(
            "closing connection from %s: its lanes hold %d bytes of unfinished frames, its"
            " connections %d together (max_partial_frame_bytes %d)",
            self._peer_name(),
            self.partial_bytes,
            self.partial_bytes if self._holdings is None else self._holdings.partial_bytes,
            self._partial_limit,
        )
        self._host.close(CloseCode.FRAME_TOO_LARGE, "too many bytes of unfinished frames")

    def sweep(self, now: float) -> float | None:
        """Close the connection if a lane began a frame and nothing arrived on it since the
        last sweep; the time of the next sweep (None: the connection is closing).

        It runs off the receive path, once per ``partial_frame_timeout``: the lanes' byte
        counts say whether anything moved, so arrivals cost nothing extra."""
        if self._receiving is None:
            return None
        for state in self._inbound.values():
            stalled = state.partial and state.consumed == state.swept
            state.swept = state.consumed
            if stalled and not (state.paused or state.held or state.backlog):
                self._stats.rejections["partial_frame_timeout"] += 1
                logger.warning(
                    "closing connection from %s: lane %d holds %d bytes of a frame on which"
                    " nothing arrived for %g s",
                    self._peer_name(),
                    state.lane,
                    state.partial,
                    self._partial_timeout,
                )
                self._host.close(CloseCode.FRAME_TOO_LARGE, "an unfinished frame stalled")
                return None
        return now + self._partial_timeout

    def _deliver(self, state: InboundLane, bodies: list[bytes] | deque[bytes]) -> None:
        handler = self._owner.handler.frame_received
        peer = self.peer
        assert peer is not None
        lane = state.lane
        for index, body in enumerate(bodies):
            try:
                handler(peer, lane, body)
            except Exception:
                self._stats.rejections["handler_error"] += 1
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
            if self._receiving is None:
                return

    # -- openings, refusals, resets ------------------------------------------------------------

    def expire_openings(self, now: float) -> float | None:
        """Refuse the streams whose opening timed out by ``now``; when the next one does
        (None: no opening is pending, or the connection is closing)."""
        self._openings_at = None
        link = self._receiving
        if link is None:
            return None
        for stream_id in self._openings.expire(now):
            self._refuse_opening(link, stream_id, REFUSED_TIMEOUT)
        at = self._openings_at = self._openings.next_deadline()
        return at

    def _refuse_opening(self, link: PeerLink, stream_id: int, reason: str) -> None:
        """A stream past an opening bound (see :mod:`.openings`): refuse it, count it, and
        tell its receiver, which may hold its first bytes, that the stream is over."""
        self._stats.rejections[reason] += 1
        self.stop_receiving(stream_id, CloseCode.SHUTDOWN)
        self._owner.handler.stream_reset(link, StreamReset(stream_id, int(CloseCode.SHUTDOWN)))

    def _refuse_stream(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        try:
            self._quic.stop_stream(stream_id, int(code))
        except Exception:  # stream already finished or not receivable: nothing to stop
            logger.debug("could not stop stream %d", stream_id, exc_info=True)

    def stop_receiving(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        """Ask the peer to stop a stream it writes to us (STOP_SENDING), and forget it."""
        self._quic.forget_stream(stream_id)
        self._refuse_stream(stream_id, code)
        self._host.transmit_soon()

    def _lane_finished(self, state: InboundLane) -> None:
        if state.decoder.buffered_bytes:
            self._stats.rejections["truncated_frame"] += 1
        self._forget_inbound(state)

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        """The peer reset a stream it writes to us (RESET_STREAM)."""
        if error_code == CloseCode.READER_BEHIND:
            self._stats.rejections["reader_behind"] += 1
        if self.requests_out.owns(stream_id):
            self.requests_out.reset(stream_id, error_code)
            return
        if self._is_client and stream_id & 0x3 == 0x1:  # a request the accepting side dropped
            self.requests_in.reset(stream_id)
            return
        if lane_of_stream(stream_id) is None and not self._is_client:
            self._openings.ended(stream_id)
            if self.link is not None:
                self._owner.handler.stream_reset(self.link, StreamReset(stream_id, error_code))
            return
        state = self._inbound.get(stream_id)
        if state is None or self.peer is None:
            return
        self._forget_inbound(state)
        self._owner.handler.lane_reset(self.peer, state.lane)

    def _forget_inbound(self, state: InboundLane) -> None:
        self.partial_bytes -= state.partial
        if self._holdings is not None:
            self._holdings.partial_bytes -= state.partial
        state.partial = 0
        self._inbound.pop(state.stream_id, None)
        self._quic.forget_stream(state.stream_id)

    def _peer_name(self) -> str:
        return str(self.peer) if self.peer is not None else "an unverified peer"
