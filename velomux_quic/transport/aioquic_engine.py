"""The aioquic engine: our ``QuicConnection``, the only place that reaches into aioquic's internals.

It is one of the two engines behind the seam of :mod:`.seam` (the default one); it turns
aioquic's events into the seam's own in :meth:`EngineConnection.poll_event`.

What aioquic does not offer through its public API, and we need:

* **Receive-side backpressure.** aioquic doubles a stream's receive window whenever the
  peer has sent half of it, whether or not anybody consumed the data, so a receiver can
  never push back. For streams we *manage* (every lane stream), the window is instead
  ``consumed + window``, where ``consumed`` counts the bytes the layer above actually took.
  A receiver that stops reading a lane therefore stops granting credit, the sender's
  :class:`~velomux_quic.transport.admission.LaneGate` sees no room, and its ``send``
  returns ``Pending``.
* **Send-side occupancy.** The gate needs to know how much is queued on a stream beyond
  the peer's window; aioquic keeps it in ``QuicStreamSender._buffer_stop``.
* **More concurrent streams.** aioquic lets a peer open at most 128 streams of each kind
  and has no setting for it; the per-stream path needs thousands, so the initial limits
  are raised here (they are re-granted by aioquic as streams finish).
* **Send backlog.** The per-stream path bounds, per connection, the bytes its streams
  have written inside their peer windows that aioquic has not transmitted yet (see
  :class:`~velomux_quic.transport.admission.SharedRoom`). aioquic keeps no such total, so
  it is kept here, for the streams registered with :meth:`track_send_backlog`, and
  updated where it changes: a write, a STREAM frame carrying new bytes, a
  MAX_STREAM_DATA, a reset (ours or the peer's STOP_SENDING).
* **Datagram sizes per path.** aioquic fixes a connection's datagram size at
  construction and neither advertises nor reads ``max_udp_payload_size``. Here the size
  can be changed on a live connection (:meth:`EngineConnection.set_datagram_size`, which
  updates the packet builder's size, the congestion controller's and the pacer's), our
  limit is advertised and the peer's read, and :meth:`EngineConnection.send_mtu_probe`
  sends a padded PING of a given size that is tracked for acknowledgement but kept out
  of bytes in flight, so its loss never shrinks the congestion window (RFC 9000 section
  14.4). Losses of ordinary packets are reported by size, for black-hole detection.
* **Full packets.** aioquic offers every stream with queued data a frame in every packet
  it builds, even once the packet is full. With a thousand streams each holding a record,
  that was most of the per-stream path's CPU; a stream frame that cannot fit returns at
  once.

Peer verification is installed on the TLS context in :meth:`_initialize` (see
``velomux_quic.security.tls``). Every private name of aioquic used here is pinned by
``tests/unit/test_aioquic_assumptions.py`` against the pinned aioquic range (see
``pyproject.toml``); ``tests/unit/test_aioquic_engine.py`` and ``tests/unit/test_shared_room.py``
test what this class does with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import aioquic
from aioquic import tls
from aioquic._buffer import Buffer  # typed there; aioquic.buffer re-exports it untyped
from aioquic.buffer import size_uint_var
from aioquic.quic import events as aioquic_events
from aioquic.quic.congestion.base import K_INITIAL_WINDOW, K_MINIMUM_WINDOW
from aioquic.quic.connection import (
    END_STATES,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    Limit,
    NetworkAddress,
    QuicConnection,
    QuicConnectionState,
    QuicReceiveContext,
)
from aioquic.quic.packet import (
    QuicFrameType,
    QuicPacketType,
    QuicTransportParameters,
    pull_quic_transport_parameters,
    push_quic_transport_parameters,
)
from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder, QuicSentPacket
from aioquic.quic.recovery import QuicPacketRecovery, QuicPacketSpace
from aioquic.quic.stream import QuicStream
from cryptography.hazmat.primitives.serialization import Encoding

from ..ids import InstanceId
from ..security.alerts import Role
from ..security.tls import VerifyingContext, install_peer_verification
from ..security.verify import PeerVerificationError, PeerVerifier
from . import seam
from .config import JUMBO_LOOPBACK_DATAGRAM_SIZE
from .resets import StatelessResets

__all__ = ["AIOQUIC_FEATURES", "UNLIMITED_UDP_PAYLOAD", "EngineConnection"]

AIOQUIC_FEATURES = seam.EngineFeatures(
    name="aioquic",
    version=aioquic.__version__,
    live_datagram_size=True,
    mtu_probes=True,
    receive_backpressure="stream",
    derived_reset_tokens="all",
    gso=False,
    loopback_datagram_size=JUMBO_LOOPBACK_DATAGRAM_SIZE,
)

Consumed = Callable[[], int]

UNLIMITED_UDP_PAYLOAD = 65527
"""``max_udp_payload_size`` of a peer that sends none (RFC 9000 section 18.2)."""


class _LossReportingRecovery(QuicPacketRecovery):
    """aioquic's loss recovery, which also reports how many in-flight packets larger
    than a threshold each loss declared (the black-hole detector's input)."""

    def __init__(self, *, on_large_lost: Callable[[int], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.large_threshold = 1 << 30
        self._on_large_lost = on_large_lost

    def _on_packets_lost(
        self,
        *,
        congestion_event: bool = True,
        now: float,
        packets: Iterable[QuicSentPacket],
        persistent_congestion: bool = False,
        space: QuicPacketSpace,
    ) -> None:
        packets = packets if isinstance(packets, list | tuple) else list(packets)
        threshold = self.large_threshold
        large = sum(1 for p in packets if p.in_flight and p.sent_bytes > threshold)
        super()._on_packets_lost(
            congestion_event=congestion_event,
            now=now,
            packets=packets,
            persistent_congestion=persistent_congestion,
            space=space,
        )
        if large:
            self._on_large_lost(large)


_SMALLEST_STREAM_FRAME_HEADER = 4
"""A STREAM frame's header is at least type (1) + stream id (1) + length (2) bytes; with
less room than that left in the packet, aioquic's own code builds no frame either."""

_TWO_BYTE_LENGTH_MAX = 0x3FFF
"""The largest length a two-byte QUIC variable-length integer holds (RFC 9000 section 16)."""


class EngineConnection(QuicConnection):
    """A ``QuicConnection`` with verified peers, managed receive windows and more streams.

    It implements :class:`~.seam.QuicEngine` (checked by mypy where the endpoint makes one).
    """

    features = AIOQUIC_FEATURES

    def __init__(
        self,
        *args: Any,
        verifier: PeerVerifier,
        peer_role: Role,
        expected_peer: InstanceId | None,
        max_concurrent_streams: int,
        resets: StatelessResets | None = None,
        accepted_datagram_size: int = UNLIMITED_UDP_PAYLOAD,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._velomux_resets = resets
        self.cid_minted: Callable[[bytes], None] | None = None
        """Called with each host connection ID as it is made (before it is ever sent), so
        the endpoint routes it from the start; set by the owner after construction."""
        self._derive_reset_tokens()
        self.accepted_datagram_size = accepted_datagram_size
        """The ``max_udp_payload_size`` we advertise; set before the handshake starts."""
        self.peer_max_udp_payload_size = UNLIMITED_UDP_PAYLOAD
        """The largest datagram the peer accepts (its transport parameter, once known)."""
        self.mtu_probe_observer: Callable[[int, bool], None] | None = None
        """Told (size, acknowledged) when a probe of :meth:`send_mtu_probe` is answered or lost."""
        self.large_loss_observer: Callable[[int], None] | None = None
        """Told how many packets above :attr:`large_packet_threshold` a loss declared."""
        configuration = self._configuration
        # Same arguments as aioquic's own, in QuicConnection.__init__; nothing has used
        # the recovery yet (its spaces are set in _initialize).
        self._loss = self._reporting_loss = _LossReportingRecovery(
            congestion_control_algorithm=configuration.congestion_control_algorithm,
            initial_rtt=configuration.initial_rtt,
            max_datagram_size=self._max_datagram_size,
            peer_completed_address_validation=not self._is_client,
            quic_logger=self._quic_logger,
            send_probe=self._send_probe,
            logger=self._logger,
            on_large_lost=self._large_packets_lost,
        )
        self._velomux_verifier = verifier
        self._velomux_peer_role: Role = peer_role
        self._velomux_expected = expected_peer
        self._managed_windows: dict[int, tuple[Consumed, int]] = {}
        self._backlog: dict[int, int] = {}  # tracked stream -> its share of send_backlog
        self.send_backlog = 0
        """Bytes the tracked streams hold inside their peer windows, never transmitted."""
        # Replace (not mutate) the limits: their initial value is also what the
        # transport parameters advertise, serialized later in _initialize.
        self._local_max_streams_bidi = Limit(
            frame_type=QuicFrameType.MAX_STREAMS_BIDI,
            name="max_streams_bidi",
            value=max_concurrent_streams,
        )
        self._local_max_streams_uni = Limit(
            frame_type=QuicFrameType.MAX_STREAMS_UNI,
            name="max_streams_uni",
            value=max_concurrent_streams,
        )

    # -- stateless resets -----------------------------------------------------------------

    def _derive_reset_tokens(self) -> None:
        """Replace aioquic's random reset tokens with ones derived from the node's key, so
        the endpoint can answer for a connection ID after the connection is gone.

        Only tokens not yet issued are replaced (a token, once sent, is the peer's to keep);
        the client's first connection ID carries none, and keeps none."""
        resets = self._velomux_resets
        if resets is None:
            return
        for host_cid in self._host_cids:
            if host_cid.stateless_reset_token and not host_cid.was_sent:
                host_cid.stateless_reset_token = resets.token(host_cid.cid)
        if not self._is_client:  # advertised in the transport parameters, not a frame
            first = self._host_cids[0]
            first.stateless_reset_token = resets.token(first.cid)

    def _replenish_connection_ids(self) -> None:
        known = {host_cid.cid for host_cid in self._host_cids}
        super()._replenish_connection_ids()
        self._derive_reset_tokens()
        minted = self.cid_minted
        if minted is not None:
            for host_cid in self._host_cids:
                if host_cid.cid not in known:
                    minted(host_cid.cid)

    def adopt_resettable_peer_cid(self) -> bool:
        """Server side: move off the client's first connection ID to one it issued later.

        A client cannot attach a reset token to its first connection ID (RFC 9000 gives it
        no place to), so a client that lost the connection could not reset it while this
        end still sent to that ID. Once the client's NEW_CONNECTION_ID frames have arrived,
        switch to one of those (with its token). True when done or not needed."""
        if self._is_client or self._peer_cid.stateless_reset_token:
            return True
        if not self._peer_cid_available:
            return False
        self.change_connection_id()
        return True

    def peer_reset_tokens(self) -> list[bytes]:
        """The stateless reset tokens the peer issued with its connection IDs in use or in
        reserve: a datagram ending in one of them is the peer saying it lost our state."""
        tokens = [cid.stateless_reset_token for cid in self._peer_cid_available]
        tokens.append(self._peer_cid.stateless_reset_token)
        return [token for token in tokens if token]

    @property
    def peer_close(self) -> seam.ConnectionTerminated | None:
        """The peer's CONNECTION_CLOSE: aioquic drains (rather than closes) only on the
        peer's, and keeps it as the termination it will report."""
        closing = self._close_event
        if self._state is not QuicConnectionState.DRAINING or closing is None:
            return None
        return seam.ConnectionTerminated(
            closing.error_code, closing.frame_type, closing.reason_phrase
        )

    # -- identity ------------------------------------------------------------------------

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        install_peer_verification(
            self.tls,
            self._velomux_verifier,
            role=self._velomux_peer_role,
            expected=self._velomux_expected,
        )

    @property
    def verified_peer(self) -> InstanceId | None:
        """The peer's InstanceId once its certificate passed verification, else None."""
        context = getattr(self, "tls", None)
        return context.velomux_peer if isinstance(context, VerifyingContext) else None

    @property
    def handshake_confirmed(self) -> bool:
        """For a client: the server sent HANDSHAKE_DONE, so it accepted our certificate.

        A TLS 1.3 client finishes its side of the handshake before the server has seen
        its certificate, so "handshake completed" does not mean "accepted" on the dialing
        side; only confirmation does (RFC 9001, section 4.1.2).
        """
        return bool(self._handshake_confirmed)

    @property
    def verification_error(self) -> PeerVerificationError | None:
        """Why *we* refused the peer, when we did."""
        context = getattr(self, "tls", None)
        return context.velomux_error if isinstance(context, VerifyingContext) else None

    def presented_certificates(self) -> tuple[bytes | None, bytes | None]:
        """(our certificate, the peer's once verified), DER, from this connection's own
        TLS context (a credentials reload does not change what it presented)."""
        context = getattr(self, "tls", None)
        if not isinstance(context, VerifyingContext):
            return None, None
        own = context.certificate
        peer = context._peer_certificate if context.velomux_peer is not None else None
        return (
            None if own is None else own.public_bytes(Encoding.DER),
            None if peer is None else peer.public_bytes(Encoding.DER),
        )

    # -- datagrams in --------------------------------------------------------------------

    def receive_datagrams(self, datagrams: list[bytes], addr: Any, now: float) -> None:
        """aioquic takes a datagram at a time; the events wait in its queue for the last."""
        receive = self.receive_datagram
        for data in datagrams:
            receive(data, addr, now)

    # -- events --------------------------------------------------------------------------

    def poll_event(self) -> seam.EngineEvent | None:
        """aioquic's next event as the seam's own (those the transport does not use are
        skipped: ProtocolNegotiated, DatagramFrameReceived, ...)."""
        while True:
            # aioquic's queue also holds the seam's events gathered at its front (below).
            event: object = self.next_event()
            if event is None:
                return None
            # Most frequent first: a STREAM event per frame, the rest now and then.
            if isinstance(event, aioquic_events.StreamDataReceived):
                # The pieces of every stream that follow in aioquic's queue come with it,
                # one event a stream; the others' wait at the queue's front, as seam events.
                return seam.gather_stream_data(
                    event, self._events, aioquic_events.StreamDataReceived
                )
            if type(event) is seam.StreamDataReceived:
                return event  # gathered with the piece before it
            if isinstance(event, aioquic_events.ConnectionIdIssued):
                return seam.ConnectionIdIssued(event.connection_id)
            if isinstance(event, aioquic_events.ConnectionIdRetired):
                return seam.ConnectionIdRetired(event.connection_id)
            if isinstance(event, aioquic_events.PingAcknowledged):
                return seam.PingAcknowledged(event.uid)
            if isinstance(event, aioquic_events.StreamReset):
                return seam.StreamReset(event.stream_id, event.error_code)
            if isinstance(event, aioquic_events.StopSendingReceived):
                return seam.StopSendingReceived(event.stream_id, event.error_code)
            if isinstance(event, aioquic_events.HandshakeCompleted):
                return seam.HandshakeCompleted()
            if isinstance(event, aioquic_events.ConnectionTerminated):
                return seam.ConnectionTerminated(
                    event.error_code, event.frame_type, event.reason_phrase
                )

    def poll_receive_gate(self) -> bool:
        """Never holds: a managed window stops growing on its own (see the module doc)."""
        return False

    # -- datagram size -------------------------------------------------------------------

    def _serialize_transport_parameters(self) -> bytes:
        # aioquic advertises no max_udp_payload_size: add ours to what it serialized.
        data = super()._serialize_transport_parameters()
        parameters = pull_quic_transport_parameters(Buffer(data=data))
        parameters.max_udp_payload_size = self.accepted_datagram_size
        buf = Buffer(capacity=len(data) + 16)
        push_quic_transport_parameters(buf, parameters)
        return bytes(buf.data)

    def _parse_transport_parameters(self, data: bytes, from_session_ticket: bool = False) -> None:
        super()._parse_transport_parameters(data, from_session_ticket)
        parameters: QuicTransportParameters = pull_quic_transport_parameters(Buffer(data=data))
        if parameters.max_udp_payload_size is not None:  # aioquic checked it is >= 1200
            self.peer_max_udp_payload_size = int(parameters.max_udp_payload_size)

    @property
    def datagram_size(self) -> int:
        """The largest datagram this connection builds now."""
        return int(self._max_datagram_size)

    @property
    def probe_timeout(self) -> float:
        """QUIC's probe timeout (PTO) now, without backoff: about an RTT plus its variance
        and the peer's acknowledgement delay."""
        return float(self._loss.get_probe_timeout())

    @property
    def large_packet_threshold(self) -> int:
        """Packets above this many bytes count for :attr:`large_loss_observer`."""
        return self._reporting_loss.large_threshold

    @large_packet_threshold.setter
    def large_packet_threshold(self, size: int) -> None:
        self._reporting_loss.large_threshold = size

    def set_datagram_size(self, size: int) -> None:
        """Build datagrams of up to ``size`` bytes from the next transmit on.

        The packet builder, the congestion controller (its window steps and minimum) and
        the pacer all count in datagrams of this size. A raised size also raises the
        congestion window to the minimum it has in datagrams (the initial window while
        still in slow start, RFC 9002 section 7.2), so that a full datagram fits at all.
        """
        self._max_datagram_size = size
        loss = self._loss
        controller = loss._cc
        if hasattr(controller, "_max_datagram_size"):
            controller._max_datagram_size = size
        if hasattr(controller, "additive_increase_factor"):
            controller.additive_increase_factor = size
        loss._pacer._max_datagram_size = size
        floor = (K_INITIAL_WINDOW if controller.ssthresh is None else K_MINIMUM_WINDOW) * size
        if controller.congestion_window < floor:
            controller.congestion_window = floor

    def send_mtu_probe(self, size: int, now: float) -> list[tuple[bytes, NetworkAddress]]:
        """One datagram of exactly ``size`` bytes: a 1-RTT packet of a PING and PADDING.

        It is acknowledged like any packet, and :attr:`mtu_probe_observer` hears whether
        it was; but it is not in flight, so the congestion controller neither waits for
        room for it nor reacts to its loss. Nothing is built before the handshake is
        confirmed, or once the connection is closing.
        """
        if not self._handshake_confirmed or self._state in END_STATES:
            return []
        crypto = self._cryptos[tls.Epoch.ONE_RTT]
        if not crypto.send.is_valid():
            return []
        network_path = self._network_paths[0]
        assert self._version is not None  # negotiated before the handshake completed
        builder = QuicPacketBuilder(
            host_cid=self.host_cid,
            is_client=self._is_client,
            max_datagram_size=size,
            packet_number=self._packet_number,
            peer_cid=self._peer_cid.cid,
            quic_logger=self._quic_logger,
            spin_bit=self._spin_bit,
            version=self._version,
        )
        builder.start_packet(QuicPacketType.ONE_RTT, crypto)
        buf = builder.start_frame(
            QuicFrameType.PING, handler=self._on_mtu_probe_delivery, handler_args=(size,)
        )
        buf.push_bytes(bytes(builder.remaining_buffer_space))  # PADDING frames to the end
        datagrams, packets = builder.flush()
        self._packet_number = builder.packet_number
        space = self._spaces[tls.Epoch.ONE_RTT]
        for packet in packets:
            packet.in_flight = False  # a probe's loss says "too big", not "congested"
            packet.sent_time = now
            self._loss.on_packet_sent(packet=packet, space=space)
        sent = []
        for datagram in datagrams:
            network_path.bytes_sent += len(datagram)
            sent.append((datagram, network_path.addr))
        return sent

    def _on_mtu_probe_delivery(self, delivery: QuicDeliveryState, size: int) -> None:
        observer = self.mtu_probe_observer
        if observer is not None:
            observer(size, delivery == QuicDeliveryState.ACKED)

    def _large_packets_lost(self, count: int) -> None:
        observer = self.large_loss_observer
        if observer is not None:
            observer(count)

    # -- send side -----------------------------------------------------------------------

    def open_send_stream(self, stream_id: int) -> None:
        """Create a locally initiated stream, and every lower one of its kind first.

        aioquic numbers local streams in creation order: creating stream 6 before stream 2
        makes it treat 2 as opened-and-finished, and sending on it then fails. Lanes are
        opened on first use, in any order, so the lower ids are created (empty) first.
        """
        for lower in range(stream_id & 0x3, stream_id + 1, 4):
            if lower not in self._streams and not self._stream_is_discarded(lower):
                self._get_or_create_stream_for_send(lower)

    def ack_due(self, now: float) -> bool:
        """Whether a transmit now would carry an acknowledgement aioquic owes the peer.

        aioquic only acknowledges on a transmit at or after ``ack_at`` (its delayed-ACK
        deadline). The receive path transmits at once when this is true and otherwise
        leaves the transmit to one pass per loop iteration: a pass after every datagram
        mostly found nothing to send, and deferring a due ACK past a long iteration starved
        the sender's congestion window (bulk transfers on many lanes fell to half speed).
        Before the handshake is complete every datagram is answered at once.
        """
        if not self._handshake_complete:
            return True
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        if space is None:
            return True
        ack_at = space.ack_at
        return ack_at is not None and ack_at <= now

    def acknowledge_now(self) -> None:
        """Make the acknowledgement aioquic owes the peer due at once, so the next transmit
        carries it. A node closing a connection calls it first: aioquic sends nothing but
        CONNECTION_CLOSE once closing, and the peer would never learn that the last data it
        sent arrived (its streams' retirement waits for that acknowledgement)."""
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        if space is not None and space.ack_at is not None:
            space.ack_at = 0.0

    def stream_room(self, stream_id: int, send_buffer: int) -> int:
        """Bytes the stream may take now: peer window + ``send_buffer`` - bytes written."""
        stream = self._streams.get(stream_id)
        if stream is None:
            # Not created yet: the peer's initial window for unidirectional streams.
            return int(self._remote_max_stream_data_uni) + send_buffer
        return int(stream.max_stream_data_remote) + send_buffer - int(stream.sender._buffer_stop)

    def stream_idle(self, stream_id: int) -> bool:
        """Nothing written on the stream is still waiting for the peer's window."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return True
        return int(stream.sender._buffer_stop) <= int(stream.max_stream_data_remote)

    def stream_unsent(self, stream_id: int) -> int:
        """Bytes written on the stream and never transmitted (waiting for the peer's
        window, the connection's window, or the congestion controller)."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        sender = stream.sender
        return int(sender._buffer_stop) - int(sender.highest_offset)

    def stream_beyond_window(self, stream_id: int) -> int:
        """Bytes written on the stream past what the peer's window lets us transmit.

        They leave only when the peer's reader grants more, so they measure what a stream
        holds because its reader is slow, apart from what waits on the connection.
        """
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return max(0, int(stream.sender._buffer_stop) - int(stream.max_stream_data_remote))

    def tracks_send_backlog(self, stream_id: int) -> bool:
        """Whether the stream still counts in :attr:`send_backlog` (not yet sent through)."""
        return stream_id in self._backlog

    def track_send_backlog(self, stream_id: int) -> None:
        """Count this stream in :attr:`send_backlog` until it is sent through or reset."""
        self._backlog.setdefault(stream_id, 0)
        self._resync_backlog(stream_id)

    def _resync_backlog(self, stream_id: int) -> None:
        """Recount one tracked stream's share of :attr:`send_backlog` from aioquic's state.

        The share is what the stream may transmit now but has not: written, inside the
        peer's window for the stream, past the highest offset sent. Bytes beyond that
        window wait for the stream's own reader, so they are left to the stream's own bound
        and never hold up the connection's other streams.
        """
        counted = self._backlog.get(stream_id)
        if counted is None:
            return
        stream = self._streams.get(stream_id)
        share = 0
        done = True  # discarded by aioquic (all sent and acknowledged) or reset
        if stream is not None:
            sender = stream.sender
            if sender._reset_error_code is None:
                sent = int(sender.highest_offset)
                limit = min(int(sender._buffer_stop), int(stream.max_stream_data_remote))
                share = max(0, limit - sent)
                fin = sender._buffer_fin
                done = fin is not None and sent >= fin
        self.send_backlog += share - counted
        if done:
            del self._backlog[stream_id]
        else:
            self._backlog[stream_id] = share

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        super().send_stream_data(stream_id, data, end_stream)
        if stream_id in self._backlog:
            self._resync_backlog(stream_id)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        super().reset_stream(stream_id, error_code)
        self._resync_backlog(stream_id)

    def _write_stream_frame(
        self, builder: QuicPacketBuilder, space: Any, stream: QuicStream, max_offset: int
    ) -> int:
        """aioquic's STREAM frame writer, with two differences.

        aioquic calls this for every stream with data queued, for every packet, even once
        the packet is full: it returns at once when no STREAM frame header fits. And the
        frame's length is a full variable-length integer: aioquic writes it in two bytes
        (``len | 0x4000``), which hold at most 16,383, so in a datagram larger than 16 KiB
        a longer frame's length was corrupted and the peer closed the connection
        (FRAME_ENCODING_ERROR). The same two bytes are written up to that length.
        """
        room = builder.remaining_flight_space
        if room < _SMALLEST_STREAM_FRAME_HEADER:
            return 0
        sender = stream.sender
        stream_id = stream.stream_id
        assert stream_id is not None
        offset = sender.next_offset
        long_length = room > _TWO_BYTE_LENGTH_MAX
        overhead = (
            1
            + size_uint_var(stream_id)
            + (size_uint_var(offset) if offset else 0)
            + (4 if long_length else 2)
        )
        previous_highest = sender.highest_offset
        frame = sender.get_frame(room - overhead, max_offset)
        if frame is None:
            return 0
        frame_type = QuicFrameType.STREAM_BASE | 2  # with a length
        if frame.offset:
            frame_type |= 4
        if frame.fin:
            frame_type |= 1
        size = len(frame.data)
        buf = builder.start_frame(
            frame_type,
            capacity=overhead,
            handler=sender.on_data_delivery,
            handler_args=(frame.offset, frame.offset + size, frame.fin),
        )
        buf.push_uint_var(stream_id)
        if frame.offset:
            buf.push_uint_var(frame.offset)
        if long_length:
            buf.push_uint32(size | 0x8000_0000)
        else:
            buf.push_uint16(size | 0x4000)
        buf.push_bytes(frame.data)
        logged = builder.quic_logger_frames
        if self._quic_logger is not None and logged is not None:
            logged.append(self._quic_logger.encode_stream_frame(frame, stream_id=stream_id))
        used = int(sender.highest_offset - previous_highest)
        if used and stream_id in self._backlog:
            self._resync_backlog(stream_id)
        return used

    def _handle_max_stream_data_frame(
        self, context: QuicReceiveContext, frame_type: int, buf: Buffer
    ) -> None:
        # A raised window makes bytes already written transmittable: recount them.
        stream_id = self._peek_stream_id(buf)
        super()._handle_max_stream_data_frame(context, frame_type, buf)
        self._resync_backlog(stream_id)

    def _handle_stop_sending_frame(
        self, context: QuicReceiveContext, frame_type: int, buf: Buffer
    ) -> None:
        # aioquic resets the stream itself on STOP_SENDING: its backlog will never leave.
        stream_id = self._peek_stream_id(buf)
        super()._handle_stop_sending_frame(context, frame_type, buf)
        self._resync_backlog(stream_id)

    @staticmethod
    def _peek_stream_id(buf: Buffer) -> int:
        """The stream id a frame's body starts with, leaving the buffer where it was."""
        position = buf.tell()
        stream_id = int(buf.pull_uint_var())
        buf.seek(position)
        return stream_id

    def stream_unacked(self, stream_id: int) -> int:
        """Bytes written on the stream that the peer has not acknowledged yet."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return int(stream.sender._buffer_stop) - int(stream.sender._buffer_start)

    # -- receive side --------------------------------------------------------------------

    def manage_receive_window(self, stream_id: int, consumed: Consumed, window: int) -> None:
        """Grant the peer ``consumed() + window`` on this stream instead of aioquic's doubling."""
        self._managed_windows[stream_id] = (consumed, window)

    def forget_stream(self, stream_id: int) -> None:
        self._managed_windows.pop(stream_id, None)

    def _write_stream_limits(
        self, builder: QuicPacketBuilder, space: Any, stream: QuicStream
    ) -> None:
        # aioquic calls this for every stream on every packet it builds, so the common
        # cases return at once: a stream we only send on (no receive window at all), and
        # a managed window with nothing new to grant.
        if not stream.max_stream_data_local and not stream.max_stream_data_local_sent:
            return
        managed = self._managed_windows.get(stream.stream_id)  # type: ignore[arg-type]
        if managed is None:
            super()._write_stream_limits(builder, space, stream)
            return
        consumed, window = managed
        target = consumed() + window
        # Raise in steps of a quarter window, so a steady reader sends one
        # MAX_STREAM_DATA per quarter window, not one per packet.
        if target - stream.max_stream_data_local >= window // 4:
            stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            assert stream.stream_id is not None
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local
