"""One QUIC connection to or from a peer: its lifecycle, its events, its streams, transmit.

A node *sends* only on connections it dialed (client role: outbound lanes with admission
gates) and *receives* only on connections it accepted (server role: inbound lanes with
frame decoders), as docs/architecture.md decides. Both roles share this class because the
asyncio plumbing (timers, transmit, close) is the same.

:class:`PeerConnection` is one concern, a connection's lifecycle and what happens on it,
so it is one class in one file: the dial's handshake deadline, peer verification,
graceful and abrupt close, termination and what it reports; the datagrams in and the
dispatch of aioquic's events; what arrives on streams (lanes into frames for the handler,
request streams, the per-stream path's streams handed up as :mod:`.events`); the send side
(lanes and the per-stream path's streams, their gates); the datagram size of its path
(the plan and search of :mod:`.pmtu`, fed with its probes' fates); pings, keepalive,
timers and transmit. Its collaborators have narrow interfaces: the endpoint that owns it is a
:class:`ConnectionOwner`, its streams see it as a :class:`~.lanes.StreamHost`, and the
layers above see only its :class:`~.events.PeerLink`.

``_stream_data`` and the lane path (``_lane_data``, ``_feed``, ``_deliver``) run once per
STREAM frame: keep them free of extra calls and attribute lookups.
:class:`CloseCode`, :class:`ConnectionState` and :class:`PerStreamOutbound` are re-exported
here, where they have always been imported from.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..errors import ChannelClosed, ConnectionReplaced, DialError
from ..ids import InstanceId
from ..security.tls import parse_refusal_reason
from .admission import SendOutcome, SharedRoom
from .config import MAX_LANES, TransportConfig
from .events import PeerLink, StreamData, StreamReset, StreamStopped
from .framing import FrameTooLarge
from .handler import TransportHandler
from .lanes import (
    FIRST_EXTRA_STREAM,
    InboundLane,
    OutboundStream,
    lane_of_stream,
    stream_of_lane,
)
from .metrics import TransportStats
from .openings import DROP, REFUSED_TIMEOUT, StreamOpenings
from .perstream_send import PerStreamOutbound
from .pmtu import DatagramMode, PathMtuSearch, plan_path
from .requests import IncomingRequests, OutgoingRequests
from .seam import (
    ENGINE_FAILURE_REASON,
    ConnectionIdIssued,
    ConnectionIdRetired,
    ConnectionTerminated,
    HandshakeCompleted,
    PingAcknowledged,
    QuicEngine,
    StopSendingReceived,
    StreamDataReceived,
)
from .seam import (
    StreamReset as EngineStreamReset,
)
from .snapshot import ConnectionSnapshot
from .states import CloseCode, ConnectionState

__all__ = ["CloseCode", "ConnectionOwner", "ConnectionState", "PeerConnection", "PerStreamOutbound"]

logger = logging.getLogger(__name__)

DeliveryCallback = Callable[[bool], None]
"""Told True once the peer acknowledged the bytes it waits for, False if it never will."""

_CRYPTO_ERROR_FIRST = 0x100
"""QUIC's CRYPTO_ERROR range (RFC 9000 section 20.1): 0x100 plus the TLS alert."""
_CRYPTO_ERROR_LAST = _CRYPTO_ERROR_FIRST + 0xFF

_MIN_PROBE_TIMEOUT = 0.1
"""A path MTU probe unanswered for three probe timeouts, and at least this long, is lost."""

_PRUNE_FINISHED_MIN = 64
"""Finished per-stream streams remembered before the acknowledged ones are forgotten."""


class ConnectionOwner(Protocol):
    """What a connection needs from the endpoint that owns it (the node's UDP endpoint)."""

    @property
    def config(self) -> TransportConfig: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def handler(self) -> TransportHandler: ...

    @property
    def stats(self) -> TransportStats: ...

    @property
    def address(self) -> tuple[str, int]: ...

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None: ...

    def register_cid(self, cid: bytes, connection: PeerConnection) -> None: ...

    def unregister_cid(self, cid: bytes) -> None: ...

    def connection_established(self, connection: PeerConnection) -> None: ...

    def connection_closed(self, connection: PeerConnection) -> None: ...

    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool: ...


class PeerConnection:
    """Glue between one :class:`~.seam.QuicEngine` and the node's UDP endpoint."""

    def __init__(
        self,
        transport: ConnectionOwner,
        quic: QuicEngine,
        *,
        is_client: bool,
        peer: InstanceId | None,
    ) -> None:
        self.transport = transport
        self.quic = quic
        self.is_client = is_client
        self.peer = peer  # expected peer when dialing; verified peer once accepted
        self.state = ConnectionState.HANDSHAKING
        self.established_once = False
        self.remote_address: tuple[str, int] | None = None
        self.send_buffer = transport.config.send_buffer
        self.closed = asyncio.Event()
        self.stats = transport.stats
        self.link: PeerLink | None = None
        """The layers above's handle on this connection, from its establishment on."""
        self._loop = transport.loop
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_handle: asyncio.Handle | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._handshake_deadline: asyncio.TimerHandle | None = None
        self._half_open_check: asyncio.TimerHandle | None = None
        self._last_heard = self._loop.time()
        self._handshake_waiter: asyncio.Future[None] = self._loop.create_future()
        self._outbound: list[OutboundStream | None] = [None] * MAX_LANES
        self._extra: dict[int, OutboundStream] = {}
        self._finished_unacked: set[int] = set()
        """Per-stream streams finished (their FIN written) that may still hold bytes the
        peer has not acknowledged: a graceful close waits for them as for the lanes."""
        self._prune_finished_at = _PRUNE_FINISHED_MIN
        self._next_extra = FIRST_EXTRA_STREAM
        self._blocked: set[OutboundStream] = set()
        self._deliveries: dict[int, deque[tuple[int, DeliveryCallback]]] = {}
        """Per outbound lane: (stream offset, callback) waiting for the peer's
        acknowledgement of every byte before that offset, offsets in increasing order."""
        # What the per-stream streams may hold, together, not yet transmitted.
        self._stream_room = SharedRoom(
            transport.config.streams_send_buffer, lambda: quic.send_backlog
        )
        self._inbound: dict[int, InboundLane] = {}
        config = transport.config
        self._partial_bytes = 0
        """Bytes of unfinished frames across the inbound lanes (``max_partial_frame_bytes``)."""
        self._partial_limit = config.partial_frame_limit
        self._openings = StreamOpenings(
            config.max_stream_openings,
            config.max_stream_opening_size,
            config.stream_opening_timeout,
        )
        self._opening_timer: asyncio.TimerHandle | None = None
        self._partial_sweep: asyncio.TimerHandle | None = None
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        self._next_ping = 1
        self._close_error: ChannelClosed | ConnectionReplaced | None = None
        self._refusal_counted = False
        self.requests_out = OutgoingRequests(quic, self.transmit_soon)
        self.requests_in = IncomingRequests(
            quic,
            self.transmit_soon,
            transport.handler.serve_request,
            lambda: self.peer,
            self._count_request_refusal,
        )
        self._drained = asyncio.Event()
        self._cid_switch_pending = not is_client
        """Server side: still sending to the client's first connection ID, which carries
        no stateless reset token (see ``EngineConnection.adopt_resettable_peer_cid``)."""
        self._pmtu: PathMtuSearch | None = None
        self._pmtu_timer: asyncio.TimerHandle | None = None
        self._pmtu_soon: asyncio.Handle | None = None
        self._black_holes_counted = 0
        self._datagram_mode = (
            DatagramMode.PINNED if config.max_datagram_size is not None else DatagramMode.BASE
        )
        self._counted_size: int | None = None
        quic.accepted_datagram_size = config.accepted_datagram_size
        quic.mtu_probe_observer = self._mtu_probe_answered
        quic.large_loss_observer = self._large_packets_lost

    def _count_request_refusal(self, reason: str) -> None:
        self.stats.rejections[reason] += 1

    @property
    def established(self) -> bool:
        return self.state is ConnectionState.ESTABLISHED

    # -- lifecycle -----------------------------------------------------------------------

    def start_handshake_deadline(self) -> None:
        timeout = self.transport.config.handshake_timeout
        self._handshake_deadline = self._loop.call_later(timeout, self._handshake_timed_out)
        if not self.is_client:
            idle = self.transport.config.half_open_idle_timeout
            self._half_open_check = self._loop.call_later(idle, self._reap_if_abandoned)

    def _reap_if_abandoned(self) -> None:
        """An inbound handshake whose peer went silent is dropped without a word.

        A flood of Initials from senders that never continue would otherwise hold its
        connections until ``handshake_timeout``; nothing is sent to the (possibly
        spoofed) source.
        """
        self._half_open_check = None
        if self.state is not ConnectionState.HANDSHAKING:
            return
        idle = self.transport.config.half_open_idle_timeout
        silent = self._loop.time() - self._last_heard
        if silent < idle:
            self._half_open_check = self._loop.call_later(idle - silent, self._reap_if_abandoned)
            return
        self.transport.stats.rejections["handshake_abandoned"] += 1
        self._terminated(
            ConnectionTerminated(
                error_code=int(CloseCode.HANDSHAKE_TIMEOUT),
                frame_type=None,
                reason_phrase="handshake abandoned",
            )
        )

    async def wait_established(self) -> None:
        """Resolve when the handshake completed and the peer was verified; raise DialError."""
        await asyncio.shield(self._handshake_waiter)

    def _handshake_timed_out(self) -> None:
        self._handshake_deadline = None
        if self.state is ConnectionState.HANDSHAKING:
            self._fail_handshake(
                DialError(
                    f"no handshake with {self._peer_name()} within "
                    f"{self.transport.config.handshake_timeout:g} s",
                    reason="handshake_timeout",
                )
            )
            self.close(CloseCode.HANDSHAKE_TIMEOUT, "handshake timeout")

    def _fail_handshake(self, error: DialError) -> None:
        if not self._handshake_waiter.done():
            self._handshake_waiter.set_exception(error)
            self._handshake_waiter.exception()  # retrieved: a dial nobody awaits must not warn

    def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None:
        """Close now: waiting admissions are refused; unacknowledged data may be lost."""
        if self.state in (ConnectionState.CLOSING, ConnectionState.CLOSED):
            return
        self._refuse_pending(
            ConnectionReplaced(f"connection to {self._peer_name()} was replaced")
            if code is CloseCode.REPLACED
            else ChannelClosed(f"connection to {self._peer_name()} closed: {reason or code.name}")
        )
        self.state = ConnectionState.CLOSING
        if self.established_once:
            # Acknowledge what arrived before saying goodbye: the peer retires its streams
            # SENT only on our acknowledgement, and a closing aioquic sends no more of them.
            self.quic.acknowledge_now()
            self.transmit()
        self.quic.close(error_code=int(code), reason_phrase=reason or code.name.lower())
        self.transmit()

    def reset_by_peer(self) -> None:
        """The peer sent a stateless reset: it has no state for this connection any more
        (its idle timer fired while this node was stopped, say). End it here at once,
        without a word on the wire (the peer would only answer with another reset);
        what waits on it fails as on any lost connection."""
        if self.state is ConnectionState.CLOSED:
            return
        self._terminated(
            ConnectionTerminated(
                error_code=int(CloseCode.SHUTDOWN),
                frame_type=None,
                reason_phrase="stateless reset: the peer no longer has this connection",
            )
        )

    async def aclose(self, timeout: float) -> None:
        """Close gracefully: give admitted data up to ``timeout`` to be acknowledged first."""
        if self.state is ConnectionState.ESTABLISHED and self.is_client:
            self._refuse_pending(ChannelClosed(f"connection to {self._peer_name()} is closing"))
            if self._unacked_total() > 0:
                self._drained.clear()
                try:
                    await asyncio.wait_for(self._drained.wait(), timeout)
                except TimeoutError:
                    logger.info(
                        "closing connection to %s with %d bytes unacknowledged",
                        self._peer_name(),
                        self._unacked_total(),
                    )
        self.close(CloseCode.SHUTDOWN, "shutdown")
        try:
            await asyncio.wait_for(self.closed.wait(), timeout + 1.0)
        except TimeoutError:
            self._terminated(
                ConnectionTerminated(
                    error_code=int(CloseCode.SHUTDOWN), frame_type=None, reason_phrase="shutdown"
                )
            )

    def _refuse_pending(self, error: ChannelClosed | ConnectionReplaced) -> None:
        self._close_error = error
        for lane in self._outbound:
            if lane is not None:
                lane.gate.close(error)
        for stream in self._extra.values():
            stream.gate.close(error)
        self._blocked.clear()
        self._stream_room.clear()

    def _unacked_total(self) -> int:
        """Admitted bytes the peer has not acknowledged: the lanes', and those of the
        per-stream streams already finished (a producer that finalizes its streams and
        closes at once must not cut their last bytes off: the engine may still be pacing
        them out when the close comes)."""
        total = sum(
            self.quic.stream_unacked(lane.stream_id) for lane in self._outbound if lane is not None
        )
        if self._finished_unacked:
            total += self._prune_finished()
        return total

    def _prune_finished(self) -> int:
        """Forget the finished streams the peer acknowledged; the others' unacknowledged bytes."""
        unacked = 0
        for stream_id in list(self._finished_unacked):
            left = self.quic.stream_unacked(stream_id)
            if left:
                unacked += left
            else:
                self._finished_unacked.discard(stream_id)
        return unacked

    def _peer_name(self) -> str:
        return str(self.peer) if self.peer is not None else "an unverified peer"

    # -- sending -------------------------------------------------------------------------

    def send(self, lane: int, body: bytes) -> SendOutcome:
        outbound = self._outbound[lane]
        if outbound is None:
            outbound = self._outbound[lane] = OutboundStream(
                self, stream_of_lane(lane), self.send_buffer, lane
            )
        return outbound.send(body)

    def open_stream(self, send_buffer: int) -> PerStreamOutbound:
        """A new unidirectional stream of its own (the per-stream path), opened on first write.

        Its sends wait while it holds ``send_buffer`` bytes not yet transmitted, or while
        the connection's per-stream streams together hold ``streams_send_buffer``.
        """
        stream = PerStreamOutbound(self, self._next_extra, send_buffer, self._stream_room)
        self._next_extra += 4
        self._extra[stream.stream_id] = stream
        if self._close_error is not None:
            stream.gate.close(self._close_error)
        return stream

    def on_delivered(self, lane: int, callback: DeliveryCallback) -> None:
        """``callback(True)`` once the peer's QUIC stack acknowledged every byte written so
        far on ``lane``; ``callback(False)`` if this connection or the lane ends first.

        What the mux retires a stream on: a frame admitted to the lane is only in this
        node's send buffer, and a connection that closes before the acknowledgement loses
        it. Checked when datagrams arrive (acknowledgements come in them): O(1) per check
        for a lane with nothing waiting, and no cost at all on a connection nobody asked."""
        outbound = self._outbound[lane]
        if outbound is None or self.state is not ConnectionState.ESTABLISHED:
            callback(False)
            return
        target = outbound.written
        if self.quic.stream_unacked(outbound.stream_id) == 0:
            callback(True)
            return
        waiting = self._deliveries.get(lane)
        if waiting is None:
            waiting = self._deliveries[lane] = deque()
        waiting.append((target, callback))

    def _check_deliveries(self) -> None:
        for lane, waiting in list(self._deliveries.items()):
            outbound = self._outbound[lane]
            if outbound is None:
                self._fail_deliveries(lane)
                continue
            acked = outbound.written - self.quic.stream_unacked(outbound.stream_id)
            while waiting and waiting[0][0] <= acked:
                _, callback = waiting.popleft()
                self._tell(callback, True)
            if not waiting:
                del self._deliveries[lane]

    def _fail_deliveries(self, lane: int | None = None) -> None:
        """The lane (None: every lane) ended: what it still waits for is never acknowledged."""
        lanes = list(self._deliveries) if lane is None else [lane]
        for each in lanes:
            waiting = self._deliveries.pop(each, None)
            while waiting:
                _, callback = waiting.popleft()
                self._tell(callback, False)

    @staticmethod
    def _tell(callback: DeliveryCallback, delivered: bool) -> None:
        try:
            callback(delivered)
        except Exception:  # one watcher's bug must not stop the connection's datagram path
            logger.exception("delivery callback failed")

    def stream_blocked(self, stream: OutboundStream) -> None:
        self._blocked.add(stream)
        self.transport.stats.send_backpressure += 1

    def stream_done(self, stream: OutboundStream) -> None:
        self._blocked.discard(stream)
        if self._extra.pop(stream.stream_id, None) is not None and not stream.aborted:
            finished = self._finished_unacked
            finished.add(stream.stream_id)
            if len(finished) >= self._prune_finished_at:  # amortised: bounded by what is unacked
                self._prune_finished()
                self._prune_finished_at = max(_PRUNE_FINISHED_MIN, 2 * len(finished))

    def _poll_gates(self) -> None:
        if not self._blocked or self.state is not ConnectionState.ESTABLISHED:
            return
        for stream in list(self._blocked):
            stream.gate.poll()
            if stream.gate.pending_count == 0:
                self._blocked.discard(stream)

    def snapshot(self) -> ConnectionSnapshot:
        """What this connection holds now (see :class:`ConnectionSnapshot`); not for hot paths."""
        streams = [lane for lane in self._outbound if lane is not None]
        streams.extend(self._extra.values())
        waiting = {s for s in streams if s.gate.pending_count}
        if self.is_client:
            lanes = tuple(lane.lane for lane in self._outbound if lane is not None)
        else:
            lanes = tuple(sorted(state.lane for state in self._inbound.values()))
        return ConnectionSnapshot(
            peer=self.peer,
            outbound=self.is_client,
            state=self.state.value,
            open_lanes=lanes,
            send_backlog=self.quic.send_backlog,
            blocked_streams=len(waiting | self._blocked),
            held_by_peer_window=sum(1 for s in waiting if s.held_by_peer_window),
            extra_streams=len(self._extra),
            pending_requests=self.requests_out.pending_count,
            partial_requests=self.requests_in.partial_count + self.requests_in.serving_count,
            partial_frame_bytes=self._partial_bytes,
            stream_openings=self._openings.pending,
            datagram_size=self.quic.datagram_size,
            datagram_mode=self._datagram_mode.value,
        )

    # -- datagram size -------------------------------------------------------------------

    def _start_datagram_plan(self) -> None:
        """Established: choose the datagram size for this path (see :mod:`.pmtu`)."""
        config = self.transport.config
        remote = self.remote_address[0] if self.remote_address is not None else ""
        plan = plan_path(config, self.transport.address[0], remote)
        limit = self.quic.peer_max_udp_payload_size
        self._datagram_mode = plan.mode
        if not self.quic.features.live_datagram_size:
            # The engine was made at the plan's size and keeps it; a search stays at its
            # base (EngineFeatures.mtu_probes), which the mode says.
            if plan.search_max is not None:
                self._datagram_mode = DatagramMode.BASE
            self._use_datagram_size(self.quic.datagram_size)
            return
        if plan.search_max is not None:
            search = PathMtuSearch(min(plan.size, limit), min(plan.search_max, limit))
            self._pmtu = search
            self._datagram_mode = search.mode
            self.quic.large_packet_threshold = search.base
            self._use_datagram_size(search.size)
            self._pmtu_step()
        else:
            self._use_datagram_size(min(plan.size, limit))

    def _use_datagram_size(self, size: int) -> None:
        if size != self.quic.datagram_size:
            self.quic.set_datagram_size(size)
        sizes = self.stats.datagram_sizes
        if self._counted_size is not None:
            sizes[self._counted_size] -= 1
            if not sizes[self._counted_size]:
                del sizes[self._counted_size]
        sizes[size] += 1
        self._counted_size = size

    def _forget_datagram_size(self) -> None:
        if self._counted_size is not None:
            sizes = self.stats.datagram_sizes
            sizes[self._counted_size] -= 1
            if not sizes[self._counted_size]:
                del sizes[self._counted_size]
            self._counted_size = None

    def _mtu_probe_answered(self, size: int, acked: bool) -> None:
        """aioquic's loss detection decided a probe's fate (inside its receive path, so the
        next probe waits for a callback of its own)."""
        search = self._pmtu
        if search is None:
            return
        if acked:
            self.stats.pmtu_probes["acked"] += 1
            search.probe_acked(size)
        elif search.probe_lost(size, self._loop.time()):
            self.stats.pmtu_probes["lost"] += 1
        self._pmtu_step_soon()

    def _large_packets_lost(self, count: int) -> None:
        search = self._pmtu
        if search is not None and search.size > search.base:
            search.large_packets_lost(count)
            self._pmtu_step_soon()

    def _pmtu_step_soon(self) -> None:
        if self._pmtu_soon is None and self.state is ConnectionState.ESTABLISHED:
            self._pmtu_soon = self._loop.call_soon(self._pmtu_step)

    def _pmtu_step(self) -> None:
        """Give up on an overdue probe, send the next one, and follow the search's size."""
        self._pmtu_soon = None
        search = self._pmtu
        if search is None or self.state is not ConnectionState.ESTABLISHED:
            return
        now = self._loop.time()
        if search.expire(now) is not None:
            self.stats.pmtu_probes["lost"] += 1
        retry_at: float | None = None
        size = search.next_probe(now)
        if size is not None:
            datagrams = self.quic.send_mtu_probe(size, now)
            if datagrams:
                for data, addr in datagrams:
                    self.transport.sendto(data, addr)
                self.stats.datagrams_out += len(datagrams)
                self.stats.pmtu_probes["sent"] += 1
                timeout = max(3 * self.quic.probe_timeout, _MIN_PROBE_TIMEOUT)
                search.probe_sent(size, now, timeout)
            else:  # no 1-RTT keys to send with yet: try again shortly
                retry_at = now + _MIN_PROBE_TIMEOUT
        if search.size != self._counted_size:
            self._use_datagram_size(search.size)
        self._datagram_mode = search.mode
        if search.black_holes != self._black_holes_counted:
            self.stats.pmtu_black_holes += search.black_holes - self._black_holes_counted
            self._black_holes_counted = search.black_holes
            logger.info(
                "connection %s %s: full-size datagrams are lost; back to %d bytes",
                "to" if self.is_client else "from",
                self._peer_name(),
                search.size,
            )
        if self._pmtu_timer is not None:
            self._pmtu_timer.cancel()
            self._pmtu_timer = None
        deadline = search.deadline if retry_at is None else retry_at
        if deadline is not None:
            self._pmtu_timer = self._loop.call_at(deadline, self._pmtu_step)

    async def ping(self, timeout: float) -> None:
        uid = self._next_ping
        self._next_ping += 1
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._ping_waiters[uid] = waiter
        self.quic.send_ping(uid)
        self.transmit()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        finally:
            self._ping_waiters.pop(uid, None)

    def reset_lane(self, lane: int) -> None:
        """Abort one outbound lane's stream (RESET_STREAM); the peer sees the lane cut."""
        outbound = self._outbound[lane]
        if outbound is None:
            return
        self._outbound[lane] = None
        self._blocked.discard(outbound)
        self._fail_deliveries(lane)
        outbound.gate.close(ChannelClosed(f"lane {lane} to {self._peer_name()} was reset"))
        self.quic.reset_stream(outbound.stream_id, int(CloseCode.KILLED))
        self.transmit()

    # -- receiving: lanes ------------------------------------------------------------------

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
        decoder = state.decoder
        try:
            bodies = decoder.feed(data)
        except FrameTooLarge as exc:
            if exc.frames:
                self._deliver(state, exc.frames)
            self.transport.stats.rejections["oversized_frame"] += 1
            logger.warning(
                "closing connection from %s: lane %d: %s", self._peer_name(), state.lane, exc
            )
            self.close(CloseCode.FRAME_TOO_LARGE, str(exc))
            return
        partial = decoder.buffered_bytes
        if partial != state.partial:
            self._partial_bytes += partial - state.partial
            state.partial = partial
            if self._partial_bytes > self._partial_limit:
                self._too_much_partial(bodies, state)
                return
        if not bodies:
            return
        stats = self.transport.stats
        stats.frames_in += len(bodies)
        stats.bytes_in += len(data)
        self._deliver(state, bodies)

    def _too_much_partial(self, bodies: list[bytes], state: InboundLane) -> None:
        """The lanes hold more unfinished frames than ``max_partial_frame_bytes``: close.

        Each lane's frame is within ``max_message_size``, but a peer starting one on every
        lane at once and finishing none is spending this node's memory, not sending.
        """
        if bodies:
            self._deliver(state, bodies)
        self.transport.stats.rejections["partial_frame_bytes"] += 1
        logger.warning(
            "closing connection from %s: its lanes hold %d bytes of unfinished frames"
            " (max_partial_frame_bytes %d)",
            self._peer_name(),
            self._partial_bytes,
            self._partial_limit,
        )
        self.close(CloseCode.FRAME_TOO_LARGE, "too many bytes of unfinished frames")

    def _schedule_partial_sweep(self) -> None:
        timeout = self.transport.config.partial_frame_timeout
        self._partial_sweep = self._loop.call_later(timeout, self._sweep_partial_frames)

    def _sweep_partial_frames(self) -> None:
        """Close the connection if a lane began a frame and nothing arrived on it since the
        last sweep. It runs off the receive path, once per ``partial_frame_timeout``: the
        lanes' byte counts say whether anything moved, so arrivals cost nothing extra."""
        self._partial_sweep = None
        if self.state is not ConnectionState.ESTABLISHED:
            return
        for state in self._inbound.values():
            stalled = state.partial and state.consumed == state.swept
            state.swept = state.consumed
            if stalled and not (state.paused or state.held or state.backlog):
                self.transport.stats.rejections["partial_frame_timeout"] += 1
                logger.warning(
                    "closing connection from %s: lane %d holds %d bytes of a frame on which"
                    " nothing arrived for %g s",
                    self._peer_name(),
                    state.lane,
                    state.partial,
                    self.transport.config.partial_frame_timeout,
                )
                self.close(CloseCode.FRAME_TOO_LARGE, "an unfinished frame stalled")
                return
        self._schedule_partial_sweep()

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

    def _stream_data(self, event: StreamDataReceived) -> None:
        link = self.link
        if self.state is not ConnectionState.ESTABLISHED or link is None:
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
                return
            openings = self._openings
            if stream_id not in openings.opened:  # its opening is still to come
                refusal = openings.admit(stream_id, event.data, self._loop.time())
                if refusal is not None:
                    if refusal != DROP:
                        self._refuse_opening(link, stream_id, refusal)
                    return
                if self._opening_timer is None and openings.pending:
                    self._arm_opening_timer()
            if not self.transport.handler.stream_received(
                link, StreamData(stream_id, event.data, event.end_stream)
            ):
                # Not a lane: the layers above may claim such streams (the per-stream
                # path); until one does, refuse the stream without harming the connection.
                self.transport.stats.rejections["unexpected_stream"] += 1
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

    def _refuse_opening(self, link: PeerLink, stream_id: int, reason: str) -> None:
        """A stream past an opening bound (see :mod:`.openings`): refuse it, count it, and
        tell its receiver, which may hold its first bytes, that the stream is over."""
        self.transport.stats.rejections[reason] += 1
        self.stop_receiving(stream_id, CloseCode.SHUTDOWN)
        self.transport.handler.stream_reset(link, StreamReset(stream_id, int(CloseCode.SHUTDOWN)))

    def _arm_opening_timer(self) -> None:
        deadline = self._openings.next_deadline()
        if deadline is not None:
            self._opening_timer = self._loop.call_at(deadline, self._openings_timed_out)

    def _openings_timed_out(self) -> None:
        self._opening_timer = None
        link = self.link
        if self.state is not ConnectionState.ESTABLISHED or link is None:
            return
        for stream_id in self._openings.expire(self._loop.time()):
            self._refuse_opening(link, stream_id, REFUSED_TIMEOUT)
        self._arm_opening_timer()

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
        self._finished_unacked.discard(stream_id)  # the peer wants none of it any more
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
        if self.link is not None:
            self.transport.handler.stream_stopped(self.link, StreamStopped(stream_id))

    def stop_receiving(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        """Ask the peer to stop a stream it writes to us (STOP_SENDING), and forget it."""
        self.quic.forget_stream(stream_id)
        self._refuse_stream(stream_id, code)
        self.transmit_soon()

    def _stream_reset(self, stream_id: int, error_code: int) -> None:
        if error_code == CloseCode.READER_BEHIND:
            self.transport.stats.rejections["reader_behind"] += 1
        if self.requests_out.owns(stream_id):
            self.requests_out.reset(stream_id, error_code)
            return
        if self.is_client and stream_id & 0x3 == 0x1:  # a request the accepting side dropped
            self.requests_in.reset(stream_id)
            return
        if lane_of_stream(stream_id) is None and not self.is_client:
            self._openings.ended(stream_id)
            if self.link is not None:
                self.transport.handler.stream_reset(self.link, StreamReset(stream_id, error_code))
            return
        state = self._inbound.get(stream_id)
        if state is None or self.peer is None:
            return
        self._forget_inbound(state)
        self.transport.handler.lane_reset(self.peer, state.lane)

    def _forget_inbound(self, state: InboundLane) -> None:
        self._partial_bytes -= state.partial
        state.partial = 0
        self._inbound.pop(state.stream_id, None)
        self.quic.forget_stream(state.stream_id)

    def manage_receive_window(
        self, stream_id: int, consumed: Callable[[], int], window: int
    ) -> None:
        """Grant the peer ``consumed() + window`` on a stream it writes (see :class:`PeerLink`)."""
        self.quic.manage_receive_window(stream_id, consumed, window)

    # -- events from aioquic -------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.remote_address = addr
        now = self._last_heard = self._loop.time()
        self.quic.receive_datagram(data, addr, now=now)
        self._process_events()
        if self.state is ConnectionState.HANDSHAKING:
            self._note_refusal()
            self._confirm_if_ready()
        if self._cid_switch_pending and self.state is ConnectionState.ESTABLISHED:
            self._cid_switch_pending = not self.quic.adopt_resettable_peer_cid()
        self._poll_gates()
        if self._deliveries:
            self._check_deliveries()
        # The loop hands over every datagram that arrived at once before it runs callbacks;
        # a datagrams_to_send pass after each one mostly found nothing to send (the ACK not
        # yet due) and cost a receiver about a sixth of its CPU, so the pass waits for the
        # end of the batch, unless an acknowledgement is due now (see EngineConnection.ack_due).
        if self.quic.ack_due(self._loop.time()):
            self.transmit()
        else:
            self.transmit_soon()

    def _process_events(self) -> None:
        quic = self.quic
        event = quic.poll_event()
        while event is not None:
            # Most frequent first: a STREAM event per frame, the rest now and then.
            kind = type(event)
            if kind is StreamDataReceived:
                self._stream_data(event)  # type: ignore[arg-type]
            elif isinstance(event, ConnectionIdIssued):
                self.transport.register_cid(event.connection_id, self)
            elif isinstance(event, ConnectionIdRetired):
                self.transport.unregister_cid(event.connection_id)
            elif isinstance(event, HandshakeCompleted):
                self._handshake_completed()
            elif isinstance(event, PingAcknowledged):
                waiter = self._ping_waiters.pop(event.uid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif isinstance(event, EngineStreamReset):
                self._stream_reset(event.stream_id, event.error_code)
            elif isinstance(event, StopSendingReceived):
                self._stop_sending(event.stream_id)
            elif isinstance(event, ConnectionTerminated):
                self._terminated(event)
                return
            event = quic.poll_event()
        if self._unacked_pending_drain():
            self._drained.set()

    def _unacked_pending_drain(self) -> bool:
        return not self._drained.is_set() and self._unacked_total() == 0

    def _handshake_completed(self) -> None:
        verified = self.quic.verified_peer
        if verified is None or (self.is_client and verified != self.peer):
            # Unreachable while the TLS hook is installed; refuse rather than trust.
            self.transport.stats.rejections["unverified_peer"] += 1
            self._fail_handshake(
                DialError("peer completed the handshake unverified", reason="unverified_peer")
            )
            self.close(CloseCode.UNVERIFIED_PEER, "peer not verified")
            return
        self.peer = verified
        if not self.is_client:
            self._established()
        # A dialer waits for HANDSHAKE_DONE: the server may still refuse our certificate,
        # and nothing may be admitted onto a connection that is about to be refused.

    def _note_refusal(self) -> None:
        """Count our refusal of the peer the moment it happens, not when draining ends."""
        error = self.quic.verification_error
        if error is not None and not self._refusal_counted:
            self._refusal_counted = True
            self.transport.stats.peer_refusals[error.reason] += 1
            # The peer was told the reason code only; the detail stays here.
            logger.info(
                "refused the %s at %s (%s): %s",
                "server" if self.is_client else "client",
                self.remote_address,
                error.reason,
                error,
            )

    def _confirm_if_ready(self) -> None:
        if (
            self.is_client
            and self.state is ConnectionState.HANDSHAKING
            and self.quic.verified_peer is not None
            and self.quic.handshake_confirmed
        ):
            self._established()

    def _established(self) -> None:
        assert self.peer is not None
        self.state = ConnectionState.ESTABLISHED
        self.link = PeerLink(self.peer, self.is_client, self)
        self.established_once = True
        if self._handshake_deadline is not None:
            self._handshake_deadline.cancel()
            self._handshake_deadline = None
        if self._half_open_check is not None:
            self._half_open_check.cancel()
            self._half_open_check = None
        if not self._handshake_waiter.done():
            self._handshake_waiter.set_result(None)
        self._schedule_keepalive()
        if not self.is_client:
            self._schedule_partial_sweep()
        self._start_datagram_plan()
        self.transport.connection_established(self)
        self._poll_gates()

    def _terminated(self, event: ConnectionTerminated) -> None:
        if self.state is ConnectionState.CLOSED:
            return
        was_established = self.state is not ConnectionState.HANDSHAKING
        self.state = ConnectionState.CLOSED
        if event.reason_phrase.startswith(ENGINE_FAILURE_REASON):
            self.transport.stats.engine_failures += 1
        for handle in (
            self._timer,
            self._transmit_handle,
            self._keepalive,
            self._handshake_deadline,
            self._half_open_check,
            self._opening_timer,
            self._partial_sweep,
            self._pmtu_timer,
            self._pmtu_soon,
        ):
            if handle is not None:
                handle.cancel()
        self._opening_timer = self._partial_sweep = None
        self._pmtu_timer = self._pmtu_soon = None
        self._pmtu = None
        self._forget_datagram_size()
        self._openings.clear()
        self._timer = self._transmit_handle = self._keepalive = self._handshake_deadline = None
        self._half_open_check = None
        reason = event.reason_phrase or f"error {event.error_code:#x}"
        error = self._close_error or ChannelClosed(
            f"connection to {self._peer_name()} closed: {reason}"
        )
        if self.is_client and was_established:
            self._report_unacked(error)
        self._refuse_pending(error)
        self._fail_deliveries()
        self.requests_out.close(ChannelClosed(f"connection closed: {reason}"))
        self.requests_in.close()
        if not was_established:
            self._fail_handshake(self._dial_error(event))
        for waiter in self._ping_waiters.values():
            if not waiter.done():
                waiter.set_exception(ChannelClosed(f"connection closed: {reason}"))
        self._ping_waiters.clear()
        self._drained.set()
        self.transport.connection_closed(self)
        self.closed.set()

    def _report_unacked(self, error: ChannelClosed | ConnectionReplaced) -> None:
        """Admitted data the peer never acknowledged: report it to the node's error handler."""
        assert self.peer is not None
        for lane in self._outbound:
            if lane is None:
                continue
            lost = self.quic.stream_unacked(lane.stream_id)
            if lost:
                self.transport.stats.send_failures_after_admission += 1
                self.transport.handler.send_failed(
                    self.peer,
                    lane.lane,
                    ChannelClosed(
                        f"{error}; {lost} admitted bytes on lane {lane.lane} unacknowledged"
                    ),
                )

    def _dial_error(self, event: ConnectionTerminated) -> DialError:
        ours = self.quic.verification_error
        if ours is not None:
            self._note_refusal()
            return DialError(f"refused {self._peer_name()}: {ours}", reason=ours.reason)
        if _CRYPTO_ERROR_FIRST <= event.error_code <= _CRYPTO_ERROR_LAST:
            theirs = parse_refusal_reason(event.reason_phrase)
            return DialError(
                f"{self._peer_name()} refused the handshake: {event.reason_phrase}",
                reason=f"refused_by_peer:{theirs}" if theirs else "handshake_failed",
            )
        if event.error_code == CloseCode.HANDSHAKE_TIMEOUT:
            return DialError(
                f"no handshake with {self._peer_name()} in time", reason="handshake_timeout"
            )
        return DialError(
            f"connection to {self._peer_name()} failed before the handshake: "
            f"{event.reason_phrase or event.error_code}",
            reason="unreachable",
        )

    # -- timers and transmit -------------------------------------------------------------

    def transmit_soon(self) -> None:
        """Coalesce: many sends in one loop iteration leave in one transmit."""
        if self._transmit_handle is None and self.state is not ConnectionState.CLOSED:
            self._transmit_handle = self._loop.call_soon(self.transmit)

    def transmit(self) -> None:
        handle = self._transmit_handle
        if handle is not None:  # a direct transmit makes the scheduled one redundant
            handle.cancel()
            self._transmit_handle = None
        if self.state is ConnectionState.CLOSED:
            return
        if self.quic.poll_receive_gate():
            # A reader caught up: stream data the engine held for it (and whatever queued
            # behind it) is deliverable now, and taking it is what grants the peer credit.
            self._process_events()
            if self.closed.is_set():
                return
        sendto = self.transport.sendto
        sent = 0
        for data, addr in self.quic.datagrams_to_send(now=self._loop.time()):
            sendto(data, addr)
            sent += 1
        self.transport.stats.datagrams_out += sent
        if self._stream_room.waiting_count:
            # What was just transmitted is room for the per-stream sends waiting on it;
            # what they write now leaves in the next transmit (transmit_soon).
            self._stream_room.poll()
        timer_at = self.quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
        self._timer_at = timer_at

    def _handle_timer(self) -> None:
        now = max(self._timer_at or 0.0, self._loop.time())
        self._timer = None
        self._timer_at = None
        self.quic.handle_timer(now=now)
        self._process_events()
        self._poll_gates()
        self.transmit()

    def _schedule_keepalive(self) -> None:
        interval = self.transport.config.keep_alive_interval
        self._keepalive = self._loop.call_later(interval, self._send_keepalive)

    def _send_keepalive(self) -> None:
        self._keepalive = None
        if self.state is not ConnectionState.ESTABLISHED:
            return
        self.quic.send_ping(0)
        self.transmit()
        self._schedule_keepalive()
