"""One QUIC connection to or from a peer: its lifecycle, its events, its streams, transmit.

A node *sends* only on connections it dialed (client role: outbound lanes with admission
gates) and *receives* only on connections it accepted (server role: inbound lanes with
frame decoders), as docs/architecture.md decides. Both roles share this class because the
asyncio plumbing (timers, transmit, close) is the same.

:class:`PeerConnection` ties the engine, the endpoint and the connection's parts
together: the dial's handshake deadline, peer verification, graceful and abrupt close,
termination and what it reports; the datagrams in and the dispatch of its engine's
events; pings, keepalive, timers and transmit. Each part is a collaborator of its own:
what arrives on its streams, :class:`~.inbound.InboundStreams` (lanes into frames for the
handler, the peer's turns, the bounds on unfinished frames and openings, request streams,
the per-stream path's streams handed up as :mod:`.events`); what it writes,
:class:`~.outbound.OutboundStreams` (lanes and the per-stream path's streams, their gates,
this node's cap on what the peer leaves unacknowledged and the stall check); the
datagram size of its path, :class:`~.datagram_size.DatagramSize`; the reading of a
handshake that failed as the dial's error, :mod:`.dial_failures`. Their interfaces are
narrow: the endpoint that owns it is a :class:`ConnectionOwner`, its streams see it as a
:class:`~.lanes.StreamHost`, its parts as an :class:`~.inbound.InboundHost` and an
:class:`~.outbound.OutboundHost`, and the layers above see only its
:class:`~.events.PeerLink`.

``_process_events`` hands each STREAM frame straight to the receive side: keep that path
free of extra calls and attribute lookups.

Time comes in from outside: every timer of the connection is a :class:`~.deadlines.Deadline`
kept as a plain time, decided on in :meth:`PeerConnection.on_timer` with the ``now`` it is
given, beside the engine's own timer; :meth:`PeerConnection.next_deadline` is the earliest.
The shell that owns the one loop timer at that deadline, and the call-soon that coalesces
transmits, is a :class:`~.deadlines.ConnectionClock` (on the event loop,
:class:`~.deadlines.LoopTimer`), so the connection itself runs without a loop or a socket
(``tests/unit/test_connection_core.py`` drives every timer on a fake clock).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from ..errors import ChannelClosed, ConnectionReplaced, DialError
from ..ids import InstanceId
from ..security.certs import NodeCredentials
from .admission import PeerLedger, SendOutcome
from .config import TransportConfig
from .datagram_size import DatagramSize
from .deadlines import Cancellable, ConnectionClock, Deadline, Deadlines, LoopTimer
from .deliveries import DeliveryCallback
from .dial_failures import dial_failure, never_connected
from .events import PeerLink, StreamStopped
from .handler import TransportHandler
from .inbound import InboundStreams
from .lanes import OutboundStream
from .metrics import TransportStats
from .outbound import OutboundStreams
from .perstream_send import PerStreamOutbound
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

__all__ = ["ConnectionOwner", "PeerConnection"]

logger = logging.getLogger(__name__)

# The states read per datagram and per transmit, bound once: a member read off its enum
# class runs the enum type's attribute hook each time on Python 3.11.
_HANDSHAKING = ConnectionState.HANDSHAKING
_ESTABLISHED = ConnectionState.ESTABLISHED
_CLOSED = ConnectionState.CLOSED


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
    def peer_ledger(self) -> PeerLedger: ...

    @property
    def address(self) -> tuple[str, int]: ...

    @property
    def credentials(self) -> NodeCredentials:
        """The credentials new connections present (named when a peer refuses them)."""
        ...

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None: ...

    def send_datagrams(self, datagrams: list[tuple[bytes, tuple[str, int]]]) -> None: ...

    def register_cid(self, cid: bytes, connection: PeerConnection) -> None: ...

    def unregister_cid(self, cid: bytes) -> None: ...

    def connection_established(self, connection: PeerConnection) -> None: ...

    def connection_closed(self, connection: PeerConnection) -> None: ...

    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool: ...


class PeerConnection:
    """Glue between one :class:`~.seam.QuicEngine` and the node's UDP endpoint."""

    def __init__(
        self,
        endpoint: ConnectionOwner,
        quic: QuicEngine,
        *,
        is_client: bool,
        peer: InstanceId | None,
        clock: ConnectionClock | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.quic = quic
        self.is_client = is_client
        self.peer = peer  # expected peer when dialing; verified peer once accepted
        self.state = ConnectionState.HANDSHAKING
        self.established_once = False
        self.remote_address: tuple[str, int] | None = None
        self.closed = asyncio.Event()
        self.stats = endpoint.stats
        self.link: PeerLink | None = None
        """The layers above's handle on this connection, from its establishment on."""
        self._clock: ConnectionClock = clock or LoopTimer(endpoint.loop, self.on_timer)
        self._deadlines = Deadlines()
        self._engine_at: float | None = None
        """The engine's own timer (apart from :attr:`_deadlines`: it moves every transmit)."""
        self._transmit_handle: Cancellable | None = None
        self._last_heard = self._clock.time()
        self._handshake_done = asyncio.Event()
        self._handshake_error: DialError | None = None
        config = endpoint.config
        self._outbound = OutboundStreams(self, endpoint, quic, self._clock.time())
        self.inflight = self._outbound.inflight
        """This node's cap on what the lanes hold unacknowledged (see InflightBound)."""
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        self._next_ping = 1
        self._refusal_counted = False
        self._reset_in_handshake = False
        """A stateless reset ended the handshake (see :meth:`reset_by_peer`)."""
        self.requests_out = OutgoingRequests(quic, self.transmit_soon)
        self.requests_in = IncomingRequests(
            quic,
            self.transmit_soon,
            endpoint.handler.serve_request,
            lambda: self.peer,
            self._count_request_refusal,
        )
        self._inbound = InboundStreams(
            self,
            endpoint,
            quic,
            self._clock.time,
            is_client=is_client,
            requests_in=self.requests_in,
            requests_out=self.requests_out,
        )
        self._drained = asyncio.Event()
        self._cid_switch_pending = not is_client
        """Server side: still sending to the client's first connection ID, which carries
        no stateless reset token (see ``EngineConnection.adopt_resettable_peer_cid``)."""
        self._size = DatagramSize(quic, self.stats, config, endpoint.sendto)
        quic.mtu_probe_observer = self._mtu_probe_answered
        quic.large_loss_observer = self._large_packets_lost

    def _count_request_refusal(self, reason: str) -> None:
        self.stats.rejections[reason] += 1

    @property
    def established(self) -> bool:
        return self.state is _ESTABLISHED

    # -- lifecycle -----------------------------------------------------------------------

    def start_handshake_deadline(self) -> None:
        config = self.endpoint.config
        now = self._clock.time()
        self._deadlines.set(Deadline.HANDSHAKE, now + config.handshake_timeout)
        if not self.is_client:
            self._deadlines.set(Deadline.HALF_OPEN, now + config.half_open_idle_timeout)
        self._rearm()

    def _reap_if_abandoned(self, now: float) -> None:
        """An inbound handshake whose peer went silent is dropped without a word.

        A flood of Initials from senders that never continue would otherwise hold its
        connections until ``handshake_timeout``; nothing is sent to the (possibly
        spoofed) source.
        """
        if self.state is not ConnectionState.HANDSHAKING:
            return
        idle = self.endpoint.config.half_open_idle_timeout
        silent = now - self._last_heard
        if silent < idle:
            self._deadlines.set(Deadline.HALF_OPEN, now + idle - silent)
            return
        self.endpoint.stats.rejections["handshake_abandoned"] += 1
        self._terminated(
            ConnectionTerminated(
                error_code=int(CloseCode.HANDSHAKE_TIMEOUT),
                frame_type=None,
                reason_phrase="handshake abandoned",
            )
        )

    async def wait_established(self) -> None:
        """Resolve when the handshake completed and the peer was verified; raise DialError."""
        await self._handshake_done.wait()
        error = self._handshake_error
        if error is not None:
            # Each waiter's raise starts its own traceback: the error is kept, their frames not.
            raise error.with_traceback(None)

    def _handshake_timed_out(self) -> None:
        if self.state is ConnectionState.HANDSHAKING:
            self._fail_handshake(
                DialError(
                    f"no handshake with {self.peer_name()} within "
                    f"{self.endpoint.config.handshake_timeout:g} s",
                    reason="handshake_timeout",
                )
            )
            self.close(CloseCode.HANDSHAKE_TIMEOUT, "handshake timeout")

    def _fail_handshake(self, error: DialError) -> None:
        if not self._handshake_done.is_set():
            self._handshake_error = error
            self._handshake_done.set()

    def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None:
        """Close now: waiting admissions are refused; unacknowledged data may be lost."""
        if self.state in (ConnectionState.CLOSING, ConnectionState.CLOSED):
            return
        failed = self._handshake_error
        self._outbound.refuse_pending(
            ConnectionReplaced(f"connection to {self.peer_name()} was replaced")
            if code is CloseCode.REPLACED
            else never_connected(self.peer_name(), failed)
            if failed is not None and not self.established_once
            else ChannelClosed(f"connection to {self.peer_name()} closed: {reason or code.name}")
        )
        self.state = ConnectionState.CLOSING
        self._inbound.closing()
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
        what waits on it fails as on any lost connection.

        A connection draining after the peer's own CONNECTION_CLOSE ends with that close:
        the reset only says the peer's closing period is over (a few probe timeouts,
        short on a fast path), which a packet this node sent before the close arrived
        outlived. A server that refuses a client's certificate closes in the
        handshake with the reason, and its reset of the client's next packet must not
        turn "refused_by_peer:<reason>" into a reason-less failure (RFC 9000 section
        10.3.1: a reset moves a connection to draining, and it was draining already)."""
        if self.state is ConnectionState.CLOSED:
            return
        peer_close = self.quic.peer_close
        if peer_close is None and self.state is ConnectionState.HANDSHAKING:
            self._reset_in_handshake = True
        self._terminated(
            peer_close
            or ConnectionTerminated(
                error_code=int(CloseCode.SHUTDOWN),
                frame_type=None,
                reason_phrase="stateless reset: the peer no longer has this connection",
            )
        )

    async def aclose(self, timeout: float) -> None:
        """Close gracefully: give admitted data up to ``timeout`` to be acknowledged first."""
        if self.state is ConnectionState.ESTABLISHED and self.is_client:
            self._outbound.refuse_pending(
                ChannelClosed(f"connection to {self.peer_name()} is closing")
            )
            if self._outbound.unacked_total() > 0:
                self._drained.clear()
                try:
                    await asyncio.wait_for(self._drained.wait(), timeout)
                except TimeoutError:
                    logger.info(
                        "closing connection to %s with %d bytes unacknowledged",
                        self.peer_name(),
                        self._outbound.unacked_total(),
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

    def peer_name(self) -> str:
        return str(self.peer) if self.peer is not None else "an unverified peer"

    # -- sending -------------------------------------------------------------------------

    def send(self, lane: int, body: bytes) -> SendOutcome:
        return self._outbound.send(lane, body)

    def open_stream(self, send_buffer: int) -> PerStreamOutbound:
        """A new unidirectional stream of its own (the per-stream path), opened on first write.

        Its sends wait while it holds ``send_buffer`` bytes not yet transmitted, or while
        the connection's per-stream streams together hold ``streams_send_buffer``.
        """
        return self._outbound.open_stream(send_buffer)

    def on_delivered(self, lane: int, callback: DeliveryCallback) -> None:
        """``callback(True)`` once the peer's QUIC stack acknowledged every byte written so
        far on ``lane``; ``callback(False)`` if this connection or the lane ends first.

        What the mux retires a stream on: a frame admitted to the lane is only in this
        node's send buffer, and a connection that closes before the acknowledgement loses
        it. Checked when datagrams arrive (acknowledgements come in them): O(1) per check
        for a lane with nothing waiting, and no cost at all on a connection nobody asked."""
        self._outbound.on_delivered(lane, callback)

    def stream_blocked(self, stream: OutboundStream) -> None:
        self._outbound.stream_blocked(stream)

    def stream_done(self, stream: OutboundStream) -> None:
        self._outbound.stream_done(stream)

    def snapshot(self) -> ConnectionSnapshot:
        """What this connection holds now (see :class:`ConnectionSnapshot`); not for hot paths."""
        outbound = self._outbound
        blocked, held = outbound.waiting()
        lanes = outbound.lanes if self.is_client else self._inbound.lanes
        return ConnectionSnapshot(
            peer=self.peer,
            outbound=self.is_client,
            state=self.state.value,
            open_lanes=lanes,
            send_backlog=self.quic.send_backlog,
            blocked_streams=blocked,
            held_by_peer_window=held,
            extra_streams=outbound.extra_streams,
            pending_requests=self.requests_out.pending_count,
            partial_requests=self.requests_in.partial_count + self.requests_in.serving_count,
            partial_frame_bytes=self._inbound.partial_bytes,
            stream_openings=self._inbound.openings_pending,
            datagram_size=self.quic.datagram_size,
            unacked_bytes=self.inflight.unacked,
            datagram_mode=self._size.mode.value,
        )

    # -- datagram size -------------------------------------------------------------------

    def _start_datagram_plan(self, now: float) -> None:
        """Established: choose the datagram size for this path (see :mod:`.datagram_size`)."""
        remote = self.remote_address[0] if self.remote_address is not None else ""
        local = self.endpoint.address[0]
        config = self.endpoint.config
        at = self._size.start(config, local, remote, now, self._path_name())
        self._deadlines.set(Deadline.PMTU, at)

    def _path_name(self) -> str:
        return f"{'to' if self.is_client else 'from'} {self.peer_name()}"

    def _mtu_probe_answered(self, size: int, acked: bool) -> None:
        """The engine's loss detection decided a probe's fate (inside its receive path, so
        the next probe waits for the timer, due at once)."""
        if self._size.probe_answered(size, acked, self._clock.time()):
            self._pmtu_step_soon()

    def _large_packets_lost(self, count: int) -> None:
        if self._size.large_packets_lost(count):
            self._pmtu_step_soon()

    def _pmtu_step_soon(self) -> None:
        if self.state is ConnectionState.ESTABLISHED:
            # Not from inside the engine's receive path: at once, from the timer.
            self._deadlines.set(Deadline.PMTU, self._clock.time())
            self._rearm()

    def _pmtu_step(self, now: float) -> None:
        if self.state is ConnectionState.ESTABLISHED:
            self._deadlines.set(Deadline.PMTU, self._size.step(now, self._path_name()))

    async def ping(self, timeout: float) -> None:
        uid = self._next_ping
        self._next_ping += 1
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ping_waiters[uid] = waiter
        self.quic.send_ping(uid)
        self.transmit()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        finally:
            self._ping_waiters.pop(uid, None)

    def reset_lane(self, lane: int) -> None:
        """Abort one outbound lane's stream (RESET_STREAM); the peer sees the lane cut."""
        self._outbound.reset_lane(lane)

    # -- receiving (InboundStreams) and the streams we write that the peer stopped ---------

    def pause_reading(self, lane: int) -> None:
        self._inbound.pause_reading(lane)

    def resume_reading(self, lane: int) -> None:
        self._inbound.resume_reading(lane)

    def openings_due(self, at: float) -> None:
        """The inbound side's first pending opening: wake for it at ``at``."""
        self._deadlines.set(Deadline.OPENINGS, at)
        self._rearm()

    def _stop_sending(self, stream_id: int) -> None:
        """The receiver no longer wants a stream we write (a cancelled per-stream stream)."""
        if not self._outbound.stopped(stream_id):
            self.requests_in.stopped(stream_id)
            return
        self.transmit_soon()
        if self.link is not None:
            self.endpoint.handler.stream_stopped(self.link, StreamStopped(stream_id))

    def stop_receiving(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        """Ask the peer to stop a stream it writes to us (STOP_SENDING), and forget it."""
        self._inbound.stop_receiving(stream_id, code)

    def manage_receive_window(
        self, stream_id: int, consumed: Callable[[], int], window: int
    ) -> None:
        """Grant the peer ``consumed() + window`` on a stream it writes (see :class:`PeerLink`)."""
        self.quic.manage_receive_window(stream_id, consumed, window)

    # -- events from the engine -------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.remote_address = addr
        now = self._last_heard = self._clock.time()
        self.quic.receive_datagram(data, addr, now=now)
        self._received(now)

    def datagrams_received(self, datagrams: list[bytes], addr: tuple[str, int]) -> None:
        """A run of datagrams that arrived together (one GRO buffer): the engine takes them
        all before its events are read, so a batch that spans them reaches the lane as
        one piece, and the per-datagram work below is done once."""
        self.remote_address = addr
        now = self._last_heard = self._clock.time()
        self.quic.receive_datagrams(datagrams, addr, now)
        self._received(now)

    def _received(self, now: float) -> None:
        self._process_events()
        if self.state is _HANDSHAKING:
            self._note_refusal()
            self._confirm_if_ready()
        if self._cid_switch_pending and self.state is _ESTABLISHED:
            self._cid_switch_pending = not self.quic.adopt_resettable_peer_cid()
        self._outbound.datagrams_arrived(now)
        # The loop hands over every datagram that arrived at once before it runs callbacks;
        # a datagrams_to_send pass after each one mostly found nothing to send (the ACK not
        # yet due) and cost a receiver about a sixth of its CPU, so the pass waits for the
        # end of the batch, unless an acknowledgement is due now (see EngineConnection.ack_due).
        if self.quic.ack_due(self._clock.time()):
            self.transmit()
        else:
            self.transmit_soon()

    def _process_events(self) -> None:
        quic = self.quic
        stream_data = self._inbound.stream_data
        event = quic.poll_event()
        while event is not None:
            # A STREAM event per frame, the rest now and then: the frequent one is told
            # by one identity check, cheaper than a match's isinstance.
            if type(event) is StreamDataReceived:
                stream_data(event)
                event = quic.poll_event()
                continue
            match event:
                case ConnectionIdIssued(connection_id=cid):
                    self.endpoint.register_cid(cid, self)
                case ConnectionIdRetired(connection_id=cid):
                    self.endpoint.unregister_cid(cid)
                case HandshakeCompleted():
                    self._handshake_completed()
                case PingAcknowledged(uid=uid):
                    waiter = self._ping_waiters.pop(uid, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
                case EngineStreamReset(stream_id=stream_id, error_code=code):
                    self._inbound.stream_reset(stream_id, code)
                case StopSendingReceived(stream_id=stream_id):
                    self._stop_sending(stream_id)
                case ConnectionTerminated():
                    self._terminated(event)
                    return
            event = quic.poll_event()
        if self._unacked_pending_drain():
            self._drained.set()

    def _unacked_pending_drain(self) -> bool:
        return not self._drained.is_set() and self._outbound.unacked_total() == 0

    def _handshake_completed(self) -> None:
        verified = self.quic.verified_peer
        if verified is None or (self.is_client and verified != self.peer):
            # Unreachable while the TLS hook is installed; refuse rather than trust.
            self.endpoint.stats.rejections["unverified_peer"] += 1
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
            self.endpoint.stats.peer_refusals[error.reason] += 1
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
        self.link = link = PeerLink(self.peer, self.is_client, self)
        self.established_once = True
        deadlines = self._deadlines
        deadlines.set(Deadline.HANDSHAKE, None)
        deadlines.set(Deadline.HALF_OPEN, None)
        self._handshake_done.set()
        now = self._clock.time()
        self._schedule_keepalive(now)
        self._start_datagram_plan(now)
        outbound = self._outbound
        deadlines.set(
            Deadline.UNACKED_STALL, outbound.join(self.endpoint.peer_ledger, self.peer, now)
        )
        deadlines.set(
            Deadline.PARTIAL_SWEEP, self._inbound.established(link, outbound.holdings, now)
        )
        self._rearm()
        self.endpoint.connection_established(self)
        outbound.poll_gates()

    def _terminated(self, event: ConnectionTerminated) -> None:
        if self.state is ConnectionState.CLOSED:
            return
        was_established = self.state is not ConnectionState.HANDSHAKING
        self.state = ConnectionState.CLOSED
        if event.reason_phrase.startswith(ENGINE_FAILURE_REASON):
            self.endpoint.stats.engine_failures += 1
        self._deadlines.clear()
        self._engine_at = None
        if self._transmit_handle is not None:
            self._transmit_handle.cancel()
            self._transmit_handle = None
        self._clock.wake_at(None)
        self._inbound.ended()
        if self.peer is not None:
            self._outbound.leave(self.endpoint.peer_ledger, self.peer)
        self._size.forget()
        reason = event.reason_phrase or f"error {event.error_code:#x}"
        dial_error = None if was_established else self._dial_error(event)
        error = self._outbound.close_error or (
            ChannelClosed(f"connection to {self.peer_name()} closed: {reason}")
            if dial_error is None
            else never_connected(self.peer_name(), dial_error)
        )
        if self.is_client and was_established:
            assert self.peer is not None
            self._outbound.report_unacked(self.peer, error)
        self._outbound.refuse_pending(error)
        self._outbound.ended()
        self.requests_out.close(ChannelClosed(f"connection closed: {reason}"))
        self.requests_in.close()
        if dial_error is not None:
            self._fail_handshake(dial_error)
        for waiter in self._ping_waiters.values():
            if not waiter.done():
                waiter.set_exception(ChannelClosed(f"connection closed: {reason}"))
        self._ping_waiters.clear()
        self._drained.set()
        self.endpoint.connection_closed(self)
        self.closed.set()

    def _dial_error(self, event: ConnectionTerminated) -> DialError:
        ours = self.quic.verification_error
        if ours is not None:
            self._note_refusal()
        return dial_failure(
            event,
            self.peer_name(),
            ours=ours,
            reset_in_handshake=self._reset_in_handshake,
            credentials=self.endpoint.credentials,
        )

    # -- timers and transmit -------------------------------------------------------------

    def transmit_soon(self) -> None:
        """Coalesce: many sends in one loop iteration leave in one transmit."""
        if self._transmit_handle is None and self.state is not _CLOSED:
            self._transmit_handle = self._clock.soon(self.transmit)

    def transmit(self) -> None:
        handle = self._transmit_handle
        if handle is not None:  # a direct transmit makes the scheduled one redundant
            handle.cancel()
            self._transmit_handle = None
        if self.state is _CLOSED:
            return
        if self.quic.poll_receive_gate():
            # A reader caught up: stream data the engine held for it (and whatever queued
            # behind it) is deliverable now, and taking it is what grants the peer credit.
            self._process_events()
            if self.closed.is_set():
                return
        datagrams = self.quic.datagrams_to_send(now=self._clock.time())
        if datagrams:
            self.endpoint.send_datagrams(datagrams)
            self.endpoint.stats.datagrams_out += len(datagrams)
        outbound = self._outbound
        stream_room = outbound.stream_room
        if stream_room.waiting_count and outbound.inflight.room() > 0:
            # What was just transmitted is room for the per-stream sends waiting on it;
            # what they write now leaves in the next transmit (transmit_soon).
            stream_room.poll()
        timer_at = self.quic.get_timer()
        if timer_at != self._engine_at:  # next_deadline() inline: this runs per batch
            self._engine_at = timer_at
            other = self._deadlines.next_at
            if other is not None and (timer_at is None or other < timer_at):
                timer_at = other
            self._clock.wake_at(timer_at)

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` is next due: the engine's timer or one of the connection's
        own :class:`~.deadlines.Deadline` (None: nothing to wait for)."""
        at = self._engine_at
        other = self._deadlines.next_at
        if other is not None and (at is None or other < at):
            return other
        return at

    def _rearm(self) -> None:
        self._clock.wake_at(self.next_deadline())

    def on_timer(self, now: float) -> None:
        """Do what is due at ``now``: the engine's timer, then the connection's deadlines."""
        if self.state is _CLOSED:
            return
        engine_at = self._engine_at
        if engine_at is not None and engine_at <= now:
            self._engine_at = None
            self.quic.handle_timer(now=now)
            self._process_events()
            self._outbound.poll_gates()
            self.transmit()
        for deadline in self._deadlines.due(now):
            if self.closed.is_set():  # ended by what ran before (state is narrowed here)
                return
            match deadline:
                case Deadline.HANDSHAKE:
                    self._handshake_timed_out()
                case Deadline.HALF_OPEN:
                    self._reap_if_abandoned(now)
                case Deadline.KEEP_ALIVE:
                    self._send_keepalive(now)
                case Deadline.OPENINGS:
                    self._deadlines.set(Deadline.OPENINGS, self._inbound.expire_openings(now))
                case Deadline.PARTIAL_SWEEP:
                    self._deadlines.set(Deadline.PARTIAL_SWEEP, self._inbound.sweep(now))
                case Deadline.PMTU:
                    self._pmtu_step(now)
                case Deadline.UNACKED_STALL:
                    self._deadlines.set(Deadline.UNACKED_STALL, self._outbound.check_stall(now))
        if not self.closed.is_set():
            self._rearm()

    def _schedule_keepalive(self, now: float) -> None:
        interval = self.endpoint.config.keep_alive_interval
        self._deadlines.set(Deadline.KEEP_ALIVE, now + interval)

    def _send_keepalive(self, now: float) -> None:
        if self.state is not ConnectionState.ESTABLISHED:
            return
        self.quic.send_ping(0)
        self.transmit()
        self._schedule_keepalive(now)
