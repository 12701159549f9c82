"""The qh3 engine: qh3's QUIC connection (a Python facade over a Rust core) behind the seam.

The optional ``velomux_quic[qh3]`` extra. qh3 2.x builds and parses packets, runs loss
recovery, congestion control and pacing in Rust (``qh3._hazmat.QuicConnectionCore``), which
costs several times less per datagram than aioquic's Python. Everything of qh3's that is
not its public API is read here only, and pinned by ``tests/unit/test_qh3_assumptions.py``
against the range in ``pyproject.toml``:

* **Mutual TLS.** The TLS context the facade's bridge builds is turned into a
  :class:`~velomux_quic.security.qh3_tls.Qh3VerifyingContext` before the handshake
  (``_create_tls``): the server asks for and verifies the client's certificate in the
  handshake, the client verifies the server's.
* **Anti-amplification credit (a qh3 defect, worked around).** qh3's facade hands the core
  each QUIC packet of a datagram separately, so bytes that follow the last packet (aioquic
  pads a client's Initial datagram with such bytes, RFC 9000 section 14.1 allows it) are
  never counted toward the 3x amplification allowance (RFC 9000 section 8.1 says to count
  the whole datagram). A qh3 server then sees 499 bytes of a 1,452-byte Initial, sends one
  1,280-byte datagram, and its packet builder fails the next one with "packet builder
  capacity exhausted", killing the handshake. :meth:`Qh3Connection.receive_datagram` gives
  the core those trailing bytes with the last packet.
* **Stream limits, reset token, datagram size advertised.** qh3 fixes the concurrent stream
  limits at 100/103 and advertises a random reset token (server) and 1,472 as
  ``max_udp_payload_size`` (client); ``_create_core`` and the bridge's transport parameters
  carry ours instead (``max_concurrent_streams``, the token derived from the node's key for
  the first connection ID, ``accepted_datagram_size``).
* **Events and receive credit.** The Rust core grants a stream's receive credit when its
  stream-data event is *taken* from the core's one FIFO event queue: there is no per-stream
  "consumed" call. So this adapter takes the core's events itself (``_drain_core``), turning
  them into the seam's. It stops taking them while a lane is a whole window ahead of its
  reader, which holds every stream of the connection (the engine's ``receive_backpressure``
  is ``connection``) until :meth:`Qh3Connection.poll_receive_gate` finds the reader caught
  up; a per-stream stream holds it for at most ``HOLD_GRACE``, and is cut once its reader
  is ``READER_LAG_WINDOWS`` behind (:meth:`Qh3Connection._cut_for_reader`). It also reads the
  peer's per-stream credit (``stream_credit`` events), which the facade drops, for the
  admission gate.
* **Reservations (a qh3 defect, worked around).** The core keeps stream reservations
  across transmits while its window is full, and removes a stream as its end event is
  taken; a reservation left open on it fails the next transmit. While the core may hold
  one (its last transmit loop stopped with less room than a datagram) and a stream could
  end under it, the adapter leaves the core's events in it and defers resets and stops
  (:meth:`Qh3Connection._reservation_hazard`), until a loop stops with room.
* **Core errors.** Anything the core raises while receiving, sending or on a timer ends
  the connection at once with CONNECTION_CLOSE (:meth:`Qh3Connection._engine_failed`).
* **Lost PINGs.** The core does not resend a lost PING; the adapter does
  (:meth:`Qh3Connection._resend_pings`).

What qh3 does not offer and this adapter does not build: changing the datagram size of a
live connection and probing for a larger one (the size is fixed from the same path plan when
the connection is made), derived reset tokens beyond the first connection ID, and a
per-stream acknowledged offset (a stream counts as acknowledged when the core ends it;
a lane, which never ends, once nothing of it is unsent and nothing of the connection is in
flight, which is late under constant load, never early). ``EngineFeatures`` says so, and
the node snapshot reports it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import qh3
from qh3 import tls as qtls
from qh3._hazmat import Buffer, QuicConnectionCore
from qh3._hazmat import pull_quic_header as qh3_pull_quic_header
from qh3.quic import events as qh3_events
from qh3.quic.configuration import QuicConfiguration as Qh3Configuration
from qh3.quic.connection import QuicConnection as Qh3QuicConnection
from qh3.quic.connection import QuicConnectionError, QuicConnectionState
from qh3.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from qh3.quic.tls_bridge import QuicTlsBridge, QuicTlsBridgeError

if TYPE_CHECKING:
    from typing_extensions import Buffer as BufferProtocol

from ..ids import InstanceId
from ..security.alerts import Role
from ..security.qh3_tls import Qh3VerifyingContext, install_qh3_peer_verification
from ..security.verify import PeerVerificationError, PeerVerifier
from . import seam
from .config import BASE_DATAGRAM_SIZE
from .lanes import lane_of_stream
from .resets import StatelessResets
from .states import CloseCode

__all__ = ["ENGINE_FAILURE_REASON", "QH3_FEATURES", "Qh3Connection"]

ENGINE_FAILURE_REASON = seam.ENGINE_FAILURE_REASON

logger = logging.getLogger(__name__)

Consumed = Callable[[], int]

UNLIMITED_UDP_PAYLOAD = 65527

QH3_FEATURES = seam.EngineFeatures(
    name="qh3",
    version=qh3.__version__,
    live_datagram_size=False,
    mtu_probes=False,
    receive_backpressure="connection",
    derived_reset_tokens="first",
    gso=False,
    # qh3's congestion controller starts at RFC 9002's initial window, which is two
    # packets when they are jumbo, and its pacer spaces packets by the window over the
    # smoothed RTT (seeded by the handshake's sample, which a busy process inflates): a
    # new loopback connection of 16 KiB datagrams holds each one about half a round trip.
    # At the base size the window is ten packets and the first writes leave at once.
    loopback_datagram_size=BASE_DATAGRAM_SIZE,
)

_END_STATES = frozenset({"closing", "draining", "terminated"})

INTERNAL_ERROR = 0x1
"""QUIC's transport error code INTERNAL_ERROR (RFC 9000 section 20.1)."""

HOLD_GRACE = 1.0
"""Seconds a per-stream stream a window ahead of its reader may hold its connection (as a
lane does) before its neighbours are let through (see :meth:`Qh3Connection._end_grace`):
a reader's short pause still pushes back on its writer, a stall holds no other stream."""

READER_LAG_WINDOWS = 16
"""How many receive windows a per-stream stream's reader may fall behind before the stream
is cut (see :meth:`Qh3Connection._cut_for_reader`): 1 MiB at the default 64 KiB window."""

MAX_CUT_STREAMS = 4096
"""Cut streams remembered so their late data is dropped (a stream's end forgets it)."""

MAX_TRACKED_PINGS = 64
"""PINGs kept for resending: the checks a transport runs at once on one connection."""

ACK_COALESCE = 0.001
"""How long an owed acknowledgement may wait for the rest of a burst (see
:meth:`Qh3Connection.ack_due`): aioquic's own delay (its ``K_GRANULARITY``), and what
qh3's core waits before acknowledging a lone packet."""


class _VelomuxBridge(QuicTlsBridge):
    """qh3's TLS bridge, advertising our stream limits and datagram size."""

    velomux_streams = 0
    velomux_datagram_size = UNLIMITED_UDP_PAYLOAD

    def serialize_transport_parameters(self) -> bytes:
        data = super().serialize_transport_parameters()
        parameters = pull_quic_transport_parameters(Buffer(data=data))
        if self.velomux_streams:
            parameters.initial_max_streams_bidi = self.velomux_streams
            parameters.initial_max_streams_uni = self.velomux_streams
        parameters.max_udp_payload_size = self.velomux_datagram_size
        buf = Buffer(capacity=len(data) + 64)
        push_quic_transport_parameters(buf, parameters)
        return bytes(buf.data)


class Qh3Connection(Qh3QuicConnection):
    """qh3's ``QuicConnection`` behind the seam: verified peers, our limits, our events.

    Implements :class:`~.seam.QuicEngine` (checked by mypy where the endpoint makes one).
    """

    features = QH3_FEATURES

    def __init__(
        self,
        *,
        configuration: Qh3Configuration,
        original_destination_connection_id: bytes | None = None,
        retry_source_connection_id: bytes | None = None,
        verifier: PeerVerifier,
        peer_role: Role,
        expected_peer: InstanceId | None,
        max_concurrent_streams: int,
        resets: StatelessResets | None = None,
    ) -> None:
        super().__init__(
            configuration=configuration,
            original_destination_connection_id=original_destination_connection_id,
            retry_source_connection_id=retry_source_connection_id,
        )
        self._velomux_verifier = verifier
        self._velomux_peer_role: Role = peer_role
        self._velomux_expected = expected_peer
        self._velomux_streams = max_concurrent_streams
        self._velomux_resets = resets
        self.cid_minted: Callable[[bytes], None] | None = None
        self.accepted_datagram_size = UNLIMITED_UDP_PAYLOAD
        self.mtu_probe_observer: Callable[[int, bool], None] | None = None
        self.large_loss_observer: Callable[[int], None] | None = None
        self.large_packet_threshold = 1 << 30
        self._written: dict[int, int] = {}
        """Bytes written per locally opened stream (the facade keeps no count)."""
        self._credit: dict[int, int] = {}
        """The peer's credit per stream, from the core's ``stream_credit`` events."""
        self._acked_floor: dict[int, int] = {}
        self._losses_at_write: dict[int, int] = {}
        """The core's loss count at each stream's last write (see :meth:`stream_unacked`)."""
        self._unsettled: set[int] = set()
        """Streams with written bytes above their acknowledged floor (see :meth:`_settle_all`)."""
        self._backlog: set[int] = set()
        """Streams counted in :attr:`send_backlog` (the per-stream path's)."""
        self._beyond_tracked = 0
        """Of the tracked streams' unsent bytes, those past the peer's credit (kept as
        writes and credit change, so reading the backlog costs a few core calls, not one
        per stream: a thousand streams polled after every transmit blocked the loop)."""
        self._untracked: set[int] = set()
        """Streams written and not tracked (lanes, request streams), still open."""
        self._managed: dict[int, tuple[Consumed, int]] = {}
        self._delivered: dict[int, int] = {}
        self._held: int | None = None
        """The managed stream a whole window ahead of its reader: no core event is taken
        while it is set (see the module docstring)."""
        self._ack_owed_at: float | None = None
        """``ACK_COALESCE`` after the first datagram that no transmit has answered yet
        arrived (see :meth:`ack_due`)."""
        self._failure: seam.ConnectionTerminated | None = None
        """The core raised: the termination to report once the CONNECTION_CLOSE it sent
        has left with a transmit (see :meth:`_engine_failed`)."""
        self._farewell: list[tuple[bytes, Any]] = []
        self._failure_taken = False
        """The failure's termination was taken by :meth:`poll_event`: no timer any more."""
        self._pings: dict[int, None] = {}
        """PINGs sent and not acknowledged, oldest first (see :meth:`_resend_pings`)."""
        self._probe_marks = (0, 0)
        """The core's loss and probe-timeout counts when the PINGs were last (re)sent."""
        self._deferred: list[tuple[bool, int, int]] = []
        """STOP_SENDING (True) and RESET_STREAM (False) requests made while the core's
        events were held, applied once they are all taken (see :meth:`stop_stream`)."""
        self._held_since = 0.0
        """When the held stream was held (a per-stream stream's hold lasts ``HOLD_GRACE``)."""
        self._spilling: set[int] = set()
        """Per-stream streams held for ``HOLD_GRACE`` once: never held again, cut past
        ``READER_LAG_WINDOWS`` (see :meth:`_cut_for_reader`)."""
        self._draining: dict[int, seam.StreamDataReceived] = {}
        self._more_pieces: dict[int, list[bytes]] = {}
        """A drain's first event of each stream with data, and every piece of those that
        got more than one: see :meth:`_join_pieces`."""
        self._cut: set[int] = set()
        """Per-stream streams cut because their reader fell too far behind (see
        :meth:`_cut_for_reader`); their late data and reset are not reported."""
        self._ended_streams: set[int] = set()
        """Streams whose end the adapter took from the core while requests were deferred."""
        self._may_reserve = False
        """The core's last transmit loop stopped on a full congestion window, so it may
        hold stream reservations until the next (see :meth:`_reservation_hazard`)."""
        self._full_datagram = int(configuration.max_datagram_size)
        """Room the core needs in its window to build from its held reservations."""
        self._resend_mark = 0
        """The core's loss and probe-timeout counts (summed) when it last held no
        reservation: while they are unchanged, a held one is for bytes never sent."""
        self._finishing: set[int] = set()
        """Local streams written with FIN that the core has not ended yet."""
        self._ending: set[int] = set()
        """Streams asked to reset or stop that the core has not ended yet."""
        self._owed = False
        """Events left in the core because taking them was hazardous (see
        :meth:`_reservation_hazard`); :meth:`poll_receive_gate` takes them once it is not."""
        self._stash: list[tuple[bytes, Any]] = []
        """Datagrams :meth:`poll_receive_gate` had the core build, sent with the next
        :meth:`datagrams_to_send`."""
        self._now = 0.0
        """The time of the last call that carried one (a close made outside such a call
        dates its core's close timer by it)."""
        self._peer_close: seam.ConnectionTerminated | None = None
        """The peer's CONNECTION_CLOSE, from the core's ``peer_closed`` event."""

    # -- construction hooks (qh3 private, pinned) ------------------------------------------

    def _create_core(self, remote_addr: Any, initial_dcid: bytes, now: float) -> None:
        configuration = self._configuration
        streams = self._velomux_streams
        assert self._version is not None  # set by connect() or the first datagram
        self._core = QuicConnectionCore(
            self._is_client,
            self._version,
            ("0.0.0.0", 0),
            remote_addr,
            self.host_cid,
            initial_dcid,
            self._is_client or self._retry_source_connection_id is not None,
            configuration.active_connection_id_limit or (2 if self._is_client else 8),
            configuration.max_datagram_size,
            False,  # qh3's own path MTU probing (clients, up to 1,472) stays off
            configuration.idle_timeout,
            3,
            None if not self._is_client else 65536,
            None,
            configuration.max_data,
            0,
            configuration.max_stream_data,
            0,
            0,
            0,
            configuration.max_stream_data,
            streams,
            streams,
            0,
            0,
            configuration.initial_rtt,
            0.025,
            now,
        )
        self._applied_transport_parameters = None
        self._pre_handshake_state_replayed = False

    def _create_tls(self, remote_source_cid: bytes | None) -> QuicTlsBridge:
        token = None
        if not self._is_client and self._velomux_resets is not None:
            token = self._velomux_resets.token(self.host_cid)
        bridge = _VelomuxBridge.__new__(_VelomuxBridge)
        bridge.velomux_streams = self._velomux_streams
        bridge.velomux_datagram_size = self.accepted_datagram_size
        QuicTlsBridge.__init__(
            bridge,
            self._configuration,
            version=self._version or 1,
            local_initial_source_connection_id=self.host_cid,
            remote_initial_source_connection_id=remote_source_cid,
            original_destination_connection_id=self._original_destination_connection_id,
            retry_source_connection_id=self._retry_source_connection_id,
            stateless_reset_token=token,
            quic_logger=self._quic_logger,
            version_change_handler=self._set_version,
        )
        install_qh3_peer_verification(
            bridge.tls,
            self._velomux_verifier,
            role=self._velomux_peer_role,
            expected=self._velomux_expected,
        )
        self._tls = bridge
        return bridge

    # -- datagrams in and out ------------------------------------------------------------

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        """As qh3's, with two differences. Once the handshake is complete, a short-header
        datagram (all of them, from then on) goes to the core in one call: qh3's facade
        would parse its header in Python twice (for a Retry and for its packet loop) and
        normalise the address on every datagram. And on the accepting side, bytes after
        a datagram's last QUIC packet are given to the core with that packet, so they
        count toward the amplification allowance (see the module docstring)."""
        self._now = now
        if self._ack_owed_at is None:
            self._ack_owed_at = now + ACK_COALESCE
        try:
            core = self._core
            if data and not data[0] & 0x80 and core is not None and self._handshake_complete:
                self._call_core(core.receive_datagram, data, addr, now, None)
                self._drain_core()
                self._settle_all()
            else:
                end = len(data) if self._is_client else _end_of_packets(data, self._cid_length)
                if end == len(data) or end == 0:
                    super().receive_datagram(data, addr, now)
                elif self._core is not None or self._start_from(data, addr, now):
                    self._receive_with_trailing(data, end, addr, now)
        except Exception as exc:
            self._engine_failed(exc, now)
            return
        if self._pings:
            self._resend_pings()

    def receive_datagrams(self, datagrams: list[bytes], addr: Any, now: float) -> None:
        """As :meth:`receive_datagram` for each, in one call into the core once the
        handshake is complete (short headers only, as every datagram is from then on): the
        core finishes the batch (its acknowledgement state) once and hands a stream's data
        of the whole burst over as one piece, and its events, the settling of floors and
        the pings are taken once, after the last."""
        core = self._core
        short_headers = all(data and not data[0] & 0x80 for data in datagrams)
        if core is None or not self._handshake_complete or not short_headers:
            for data in datagrams:
                self.receive_datagram(data, addr, now)
            return
        self._now = now
        if self._ack_owed_at is None:
            self._ack_owed_at = now + ACK_COALESCE
        try:
            self._call_core(core.receive_many_datagrams, datagrams, addr, now)
            self._drain_core()
            self._settle_all()
        except Exception as exc:
            self._engine_failed(exc, now)
            return
        if self._pings:
            self._resend_pings()

    @property
    def _cid_length(self) -> int:
        return int(self._configuration.connection_id_length)

    def _start_from(self, data: bytes, addr: Any, now: float) -> bool:
        """The first datagram of an accepted connection: make the core and TLS from it, as
        qh3's ``receive_datagram`` does (same checks); False when it is not one."""
        if len(data) < 1200:
            return False
        try:
            header = qh3_pull_quic_header(data, 0, self._cid_length)
        except ValueError:
            return False
        version = header[0]
        if header[1] != 0 or version not in self._configuration.supported_versions:
            return False  # 0: an Initial packet
        self._remote_addr = self._normalize_address(addr)
        self._version = version
        self._create_core(self._remote_addr, header[3], now)
        self._create_tls(remote_source_cid=None)
        return True

    def _receive_with_trailing(self, data: bytes, end: int, addr: Any, now: float) -> None:
        start = _start_of_last_packet(data, end, self._cid_length)
        if start:
            super().receive_datagram(data[:start], addr, now)
        core = self._core
        assert core is not None
        self._call_core(
            core.receive_datagram, data[start:], self._normalize_address(addr), now, len(data)
        )
        self._learn_remote_source_cid(data[start:end])
        self._drain_core()

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        """The core's datagrams, taken in one loop (qh3's facade parses every datagram's
        headers in Python for its logger, which this transport never sets). After the core
        raised, the CONNECTION_CLOSE it was made to send, once, and then the termination."""
        self._now = now
        core = self._core
        if self._failure is not None:
            return self._take_farewell()
        if core is None:
            return []
        datagrams, self._stash = self._stash, []
        if not self._transmit_into(core, datagrams, now):
            return datagrams + self._take_farewell()
        if self._ack_owed_at is not None and datagrams:
            timer = core.get_timer()
            if timer is None or not timer[0].startswith("ack"):
                self._ack_owed_at = None  # what was owed left with these datagrams
        if core.has_events or (self._deferred and not self._may_reserve):
            # Connection IDs issued while building: route them now; requests deferred
            # while the core held reservations are safe to make once it holds none.
            self._drain_core()
        return datagrams

    def _transmit_into(
        self, core: QuicConnectionCore, datagrams: list[tuple[bytes, Any]], now: float
    ) -> bool:
        """Run the core's transmit loop into ``datagrams`` and note whether it may now hold
        reservations; False if the core raised (the connection is then failing)."""
        poll = core.poll_transmit
        try:
            while (transmit := poll(now)) is not None:
                datagrams.append((transmit[0], transmit[1]))
        except Exception as exc:
            self._engine_failed(exc, now)
            return False
        may_reserve = core.congestion_window - core.bytes_in_flight < self._full_datagram
        self._may_reserve = may_reserve
        if not may_reserve:
            self._resend_mark = core.loss_total + core.pto_total
        return True

    def _take_farewell(self) -> list[tuple[bytes, Any]]:
        farewell, self._farewell = self._farewell, []
        failure = self._failure
        if failure is not None and self._state is not QuicConnectionState.TERMINATED:
            self._state = QuicConnectionState.TERMINATED
            self._queue.append(failure)
        return farewell

    def get_timer(self) -> float | None:
        """As qh3's, and at once while a failure's termination waits to be taken: the
        connection's timer callback is what takes it."""
        if self._failure is not None:
            return None if self._failure_taken else 0.0
        core = self._core
        if core is None:
            return None
        timer = core.get_timer()
        deadline = None if timer is None else float(timer[1])
        grace = self._grace_deadline()
        if grace is not None and (deadline is None or grace < deadline):
            return grace
        return deadline

    def _grace_deadline(self) -> float | None:
        """When the hold of a per-stream stream ends (None: no such hold)."""
        held = self._held
        if held is None or lane_of_stream(held) is not None:
            return None
        return self._held_since + HOLD_GRACE

    def _end_grace(self, now: float) -> None:
        """A per-stream stream held ``HOLD_GRACE``: let its neighbours through, and from now
        on keep taking its data (up to the cut) instead of holding the connection."""
        grace = self._grace_deadline()
        if grace is None or grace > now:
            return
        held = self._held
        assert held is not None
        self._spilling.add(held)
        self._held = None
        self._drain_core()

    def handle_timer(self, now: float) -> None:
        self._now = now
        if self._failure is not None:
            return
        self._end_grace(now)
        try:
            super().handle_timer(now)
        except Exception as exc:
            self._engine_failed(exc, now)
            return
        if self._pings:
            self._resend_pings()

    def _engine_failed(self, exc: BaseException, now: float) -> None:
        """qh3's core raised: end the connection at once, telling the peer.

        Whatever the core raised (a ``ValueError`` from its stream bookkeeping as well as
        the ``RuntimeError`` qh3's facade expects), its state may now be inconsistent: a
        packet it built may never have been recorded, so the streams it carried would
        stall for good. The core is told to close with INTERNAL_ERROR; the CONNECTION_CLOSE
        it builds (a fresh packet, apart from the broken state) leaves with the next
        transmit, and only then is the termination reported, so the connection sends it
        before it tears down. The termination's reason starts with
        :data:`ENGINE_FAILURE_REASON`, which the transport counts."""
        if self._failure is not None or self._state is QuicConnectionState.TERMINATED:
            return
        detail = exc.reason_phrase if isinstance(exc, QuicConnectionError) else str(exc)
        reason = f"{ENGINE_FAILURE_REASON} (qh3): {type(exc).__name__}: {detail}"
        self._failure = seam.ConnectionTerminated(INTERNAL_ERROR, None, reason)
        self._held = None
        core = self._core
        if core is None or core.state in _END_STATES:
            return
        farewell: list[tuple[bytes, Any]] = []
        try:
            core.close(INTERNAL_ERROR, 0, reason.encode("utf8", "replace")[:512])
            while (transmit := core.poll_transmit(now)) is not None:
                farewell.append((transmit[0], transmit[1]))
        except Exception:  # the core cannot even close: end without telling the peer
            logger.debug("qh3 core could not send CONNECTION_CLOSE", exc_info=True)
        self._farewell = farewell

    # -- events --------------------------------------------------------------------------

    def _drain_core(self) -> None:
        core = self._core
        if core is None:
            return
        if self._held is not None:
            if core.state not in _END_STATES:
                return
            self._held = None  # ending: let the termination through
        if self._may_reserve and self._reservation_hazard(core):
            self._owed = True
            return
        self._owed = False
        append = self._queue.append
        managed = self._managed
        draining = self._draining
        try:
            while True:
                native = core.next_event()
                if native is None:
                    if self._deferred and not self._may_reserve:
                        self._apply_deferred()
                    return
                kind = native[0]
                if kind == "stream_data":
                    stream_id = native[1]
                    if stream_id in self._cut:
                        continue  # a stream cut for its reader: what was in flight is dropped
                    data = native[2]
                    first = draining.get(stream_id)
                    if first is None:
                        draining[stream_id] = event = seam.StreamDataReceived(
                            stream_id, data, native[3]
                        )
                        append(event)
                    else:  # joined into its first event before the drain returns
                        more = self._more_pieces.get(stream_id)
                        if more is None:
                            self._more_pieces[stream_id] = [first.data, data]
                        else:
                            more.append(data)
                        first.end_stream = native[3]
                    window = managed.get(stream_id)
                    if window is not None:
                        delivered = self._delivered.get(stream_id, 0) + len(data)
                        self._delivered[stream_id] = delivered
                        behind = delivered - window[0]()
                        if behind >= window[1]:
                            if stream_id not in self._spilling:
                                self._held = stream_id
                                self._held_since = self._now
                                return
                            if behind >= window[1] * READER_LAG_WINDOWS:
                                self._cut_for_reader(stream_id)
                elif kind == "stream_credit":
                    self._credit_changed(native[1], native[2])
                elif kind == "stream_finished":
                    self._stream_finished(native[1])
                    self._cut.discard(native[1])
                    if self._deferred:
                        self._ended_streams.add(native[1])
                elif kind == "crypto_data":
                    self._crypto(native)
                elif kind == "connection_id_issued":
                    minted = self.cid_minted
                    if minted is not None:
                        minted(native[1])
                    append(seam.ConnectionIdIssued(native[1]))
                elif kind == "connection_id_retired":
                    append(seam.ConnectionIdRetired(native[1]))
                elif kind == "ping_acknowledged":
                    self._pings.pop(native[1], None)
                    append(seam.PingAcknowledged(native[1]))
                elif kind == "stream_reset":
                    if native[1] in self._cut:
                        continue  # already reported cut
                    append(seam.StreamReset(native[1], native[2]))
                elif kind == "stop_sending":
                    self._unsettled.discard(native[1])  # the core resets it: never settled
                    append(seam.StopSendingReceived(native[1], native[2]))
                elif kind == "handshake_done":
                    self._handshake_confirmed = True
                    core.handshake_confirmed()
                elif kind == "peer_closed":
                    code, frame, reason = native[2], native[3], native[4].decode("utf8", "replace")
                    if self._close_event is None:  # the peer closed first: it drains (as aioquic)
                        self._peer_close = seam.ConnectionTerminated(code, frame, reason)
                    self._close_event = qh3_events.ConnectionTerminated(code, frame, reason)
                elif kind == "protocol_error":
                    code, frame, reason = native[1], native[2], str(native[3])
                    self._close_event = qh3_events.ConnectionTerminated(code, frame, reason)
                elif kind == "connection_terminated":
                    self._state = QuicConnectionState.TERMINATED
                    closing = self._close_event
                    if closing is not None and native[1] == 0 and closing.error_code:
                        code, frame, reason = (
                            closing.error_code,
                            closing.frame_type,
                            closing.reason_phrase,
                        )
                    else:
                        code, frame = native[1], native[2]
                        reason = native[3].decode("utf8", "replace")
                    self._close_event = qh3_events.ConnectionTerminated(code, frame, reason)
                    append(seam.ConnectionTerminated(code, frame, reason))
                elif kind == "new_token":
                    self._peer_token = native[1]
        finally:
            if draining:  # however the drain ends, before anything reads the queue
                if self._more_pieces:
                    self._join_pieces()
                draining.clear()

    def _join_pieces(self) -> None:
        """Before a drain returns: a stream's pieces of it in its first event, copied once.

        qh3's core merges a stream's data within a burst only while no other stream's
        frame comes between, and its writer takes the streams in turn, a packet each: a
        burst of lanes would reach the transport as one event per datagram, each paying
        the layers above once. Each stream's first event of the drain is queued where it
        came and takes the stream's later pieces, so a burst costs the layers above one
        event a lane; the order between streams is free, each stream's own stays, and its
        end comes with its last piece. Nothing reads the queue until the drain returns."""
        more_pieces = self._more_pieces
        draining = self._draining
        for stream_id, pieces in more_pieces.items():
            draining[stream_id].data = b"".join(pieces)
        more_pieces.clear()

    def _reservation_hazard(self, core: QuicConnectionCore) -> bool:
        """Whether taking the core's events now could end a stream it holds a reservation on.

        qh3's core builds a stream's frame in two steps, a reservation and its commit once
        the packet is sent, and keeps reservations across transmits while its congestion
        window is full. Taking a stream's end event from the core removes the stream at
        once, and a reservation still open on it then fails the next transmit ("reserved
        stream is missing"), losing the packet it was built into. That needs a stream the
        core can end while it holds a reservation on it: one asked to reset or stop (its
        control frame reserved, the peer's FIN or acknowledgement ending it), or one
        written with FIN whose bytes are being sent again after a loss or a probe timeout
        (the first copy's late acknowledgement ends it). So while the core may hold
        reservations and such a stream exists, events stay in the core; its transmit
        loop sends what it holds first once the window has room, and the next loop that
        stops with room to spare proves it holds none (see :meth:`poll_receive_gate`)."""
        if core.state in _END_STATES:
            return False
        if self._ending:
            return True
        return bool(self._finishing) and core.loss_total + core.pto_total != self._resend_mark

    def _cut_for_reader(self, stream_id: int) -> None:
        """A per-stream stream's reader is ``READER_LAG_WINDOWS`` windows behind: cut it.

        qh3 grants a stream credit as its data is taken from the core's one event queue,
        so the only way to stop a stream's writer is to stop taking events, which holds
        every stream of the connection. Lanes still do that (the mux above them has its own
        credit, so a lane is rarely a window behind), but a per-stream stream's reader is
        an application's: one that stalls would freeze its neighbours, and the watchdog
        would then drop them all. So its hold ends after ``HOLD_GRACE``, its data keeps
        being taken from then on, up to this bound, and past it the stream is stopped
        (STOP_SENDING, ``CloseCode.READER_BEHIND``) and reported reset to the transport,
        which counts it; its reader keeps what arrived."""
        self._managed.pop(stream_id, None)
        self._delivered.pop(stream_id, None)
        self._spilling.discard(stream_id)
        self._cut.add(stream_id)
        if len(self._cut) > MAX_CUT_STREAMS:
            self._cut.pop()
        self._queue.append(seam.StreamReset(stream_id, int(CloseCode.READER_BEHIND)))
        try:
            Qh3QuicConnection.stop_stream(self, stream_id, int(CloseCode.READER_BEHIND))
            self._ending.add(stream_id)
        except Exception:  # already finished in the core: nothing more will come
            logger.debug("could not stop stream %d", stream_id, exc_info=True)

    def _apply_deferred(self) -> None:
        """Every held event is taken and the core holds no reservation: make the stream
        requests deferred meanwhile, but for streams whose end was among them (see
        :meth:`stop_stream`)."""
        deferred, self._deferred = self._deferred, []
        ended, self._ended_streams = self._ended_streams, set()
        for stop, stream_id, error_code in deferred:
            if stream_id in ended:
                continue
            try:
                if stop:
                    super().stop_stream(stream_id, error_code)
                else:
                    super().reset_stream(stream_id, error_code)
                self._ending.add(stream_id)
            except Exception:  # finished or unknown to the core by now: nothing to do
                logger.debug("deferred request on stream %d dropped", stream_id, exc_info=True)

    def _crypto(self, native: tuple[Any, ...]) -> None:
        assert self._core is not None and self._tls is not None
        try:
            self._tls.receive_crypto(
                qtls.Epoch(native[1]), native[3], native[2], version=self._core.version
            )
            self._drain_tls()
        except QuicTlsBridgeError as exc:
            self._call_core(
                self._core.close, exc.error_code, int(exc.frame_type), exc.reason_phrase.encode()
            )
            self._close_event = qh3_events.ConnectionTerminated(
                exc.error_code, exc.frame_type, exc.reason_phrase
            )

    @property
    def _queue(self) -> deque[Any]:
        """The facade's event queue, which carries the seam's events as well as the few
        the facade's TLS code still puts there (one queue keeps their order: a client's
        Finished and its first stream data may share a datagram)."""
        return cast("deque[Any]", self._events)

    def poll_event(self) -> seam.EngineEvent | None:
        events = self._queue
        while events:
            event = events.popleft()
            if isinstance(event, qh3_events.QuicEvent):
                if isinstance(event, qh3_events.HandshakeCompleted):
                    return seam.HandshakeCompleted()
                if isinstance(event, qh3_events.ConnectionTerminated):
                    return seam.ConnectionTerminated(
                        event.error_code, event.frame_type, event.reason_phrase
                    )
                continue  # ProtocolNegotiated and the like: nothing for the transport
            if event is self._failure:
                self._failure_taken = True
            return cast(seam.EngineEvent, event)
        return None

    def close(
        self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = ""
    ) -> None:
        if self._failure is not None:
            return  # already closing with INTERNAL_ERROR
        try:
            super().close(error_code=error_code, frame_type=frame_type, reason_phrase=reason_phrase)
        except Exception as exc:
            self._engine_failed(exc, self._now)

    def send_ping(self, uid: int) -> None:
        """Queue a PING; it is sent again until acknowledged (see :meth:`_resend_pings`)."""
        if self._ended() or self._failure is not None:
            return  # ending: its termination reports what waited (aioquic ignores it too)
        super().send_ping(uid)
        pings = self._pings
        pings.pop(uid, None)
        pings[uid] = None
        if len(pings) > MAX_TRACKED_PINGS:
            del pings[next(iter(pings))]
        core = self._core
        if core is not None:
            self._probe_marks = (core.loss_total, core.pto_total)

    def _resend_pings(self) -> None:
        """Send the unacknowledged PINGs again after the core lost a packet or sent a probe.

        qh3's core reports a PING only when the packet carrying it is acknowledged, and
        does not resend a lost one (aioquic does): a health check whose PING fell into a
        short outage was never answered, however soon the path came back. So each time the
        core's loss or probe-timeout count moves while PINGs wait, they are queued again,
        under the same identifiers: the probe the core sends when its timer fires, or the
        next packet after a loss, carries them, and whichever copy is acknowledged first
        answers the check."""
        core = self._core
        if core is None or core.state in _END_STATES:
            return
        marks = (core.loss_total, core.pto_total)
        if marks == self._probe_marks:
            return
        self._probe_marks = marks
        for uid in self._pings:
            try:
                core.send_ping(uid)
            except Exception as exc:
                self._engine_failed(exc, self._now)
                return

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        """STOP_SENDING; deferred while the core's events are held or it may hold
        reservations.

        A request for a stream whose end the core has queued, behind events held for a
        slow reader, would reserve a frame on a stream the next event removes (see
        :meth:`_reservation_hazard`): the request is kept here until every held event
        has been taken, and dropped if the stream's end was among them. A reset asked
        while the core holds a reservation of the stream's data would discard that
        reservation under it ("unknown or stale stream reservation" at the next
        transmit), so both wait, too, for a transmit loop that leaves none."""
        if self._ended() or self._failure is not None:
            return
        if self._held is not None or self._may_reserve:
            self._deferred.append((True, stream_id, error_code))
            return
        super().stop_stream(stream_id, error_code)
        self._ending.add(stream_id)

    def _ended(self) -> bool:
        core = self._core
        return core is None or core.state in _END_STATES

    def ack_due(self, now: float) -> bool:
        """Whether an acknowledgement the core owes has waited long enough to go at once.

        qh3's core wants an ACK after every second ack-eliciting packet (RFC 9000 section
        13.2.2's default; it has no setting for it and no ACK-frequency extension), and
        after ``ACK_COALESCE`` for a lone packet. The receive path transmits at once when
        this is true and otherwise at the end of the loop iteration, after every datagram
        read in the same wake-up: so the core's every-second-packet ACK is taken as due
        only once the first datagram it answers has waited ``ACK_COALESCE``, as aioquic
        delays its own (``EngineConnection.ack_due``). A burst of datagrams is then
        answered by one ACK at its end rather than one per pair, each a datagram built,
        sent, received and processed on both sides; the core's own ACK timer still
        bounds the delay.
        """
        if not self._handshake_complete or self._core is None or self._failure is not None:
            return True
        timer = self._core.get_timer()
        if timer is None or not timer[0].startswith("ack") or timer[1] > now:
            return False
        owed_at = self._ack_owed_at
        return owed_at is None or owed_at <= now

    def acknowledge_now(self) -> None:
        """Make the acknowledgement the core owes the peer leave with the next transmit.

        A node closing a connection calls it first: once closing, qh3 sends nothing but
        CONNECTION_CLOSE, and without it the peer never learns that the last data it sent
        arrived (its streams retire DISCARDED instead of SENT). qh3 offers no call to hurry
        an acknowledgement, so its delayed-ACK timer is fired at its own deadline (at most
        the ACK delay ahead; nothing else is due before it, being the core's next timer)."""
        core = self._core
        if core is None or not self._handshake_complete or self._ended():
            return
        timer = core.get_timer()
        if timer is not None and timer[0].startswith("ack"):
            try:
                core.handle_timer(timer[1])
            except Exception as exc:
                self._engine_failed(exc, timer[1])

    # -- identity ------------------------------------------------------------------------

    def _context(self) -> Qh3VerifyingContext | None:
        bridge = self._tls
        context = None if bridge is None else bridge.tls
        return context if isinstance(context, Qh3VerifyingContext) else None

    @property
    def verified_peer(self) -> InstanceId | None:
        context = self._context()
        return None if context is None else context.velomux_peer

    @property
    def verification_error(self) -> PeerVerificationError | None:
        context = self._context()
        return None if context is None else context.velomux_error

    @property
    def handshake_confirmed(self) -> bool:
        return bool(self._handshake_confirmed)

    def presented_certificates(self) -> tuple[bytes | None, bytes | None]:
        context = self._context()
        if context is None:
            return None, None
        own = context.certificate
        peer = context._peer_certificate if context.velomux_peer is not None else None
        return (
            None if own is None else bytes(own.public_bytes()),
            None if peer is None else bytes(peer.public_bytes()),
        )

    # -- connection IDs and stateless resets ---------------------------------------------

    def peer_reset_tokens(self) -> list[bytes]:
        """The token of the peer's transport parameters (a server's first connection ID);
        those of NEW_CONNECTION_ID frames stay inside qh3's core."""
        bridge = self._tls
        parameters = None if bridge is None else bridge.remote_transport_parameters
        token = None if parameters is None else parameters.stateless_reset_token
        return [token] if token else []

    def adopt_resettable_peer_cid(self) -> bool:
        """Nothing to adopt: qh3 does not tell which peer connection IDs carry tokens."""
        return True

    @property
    def peer_close(self) -> seam.ConnectionTerminated | None:
        return self._peer_close

    # -- streams -------------------------------------------------------------------------

    def open_send_stream(self, stream_id: int) -> None:
        """Streams are numbered by the facade on first write, in any order; nothing to do
        but count from zero."""
        self._written.setdefault(stream_id, 0)

    def send_stream_data(
        self, stream_id: int, data: BufferProtocol, end_stream: bool = False
    ) -> None:
        if self._core is not None and self._core.state in _END_STATES:
            # The peer closed it (its termination is still to be taken): written bytes are
            # counted, and reported unacknowledged when it is, as aioquic's would be.
            size = len(data) if type(data) is bytes else memoryview(data).nbytes
            self._written[stream_id] = self._written.get(stream_id, 0) + size
            return
        super().send_stream_data(stream_id, data, end_stream)
        size = len(data) if type(data) is bytes else memoryview(data).nbytes
        written = self._written.get(stream_id, 0)
        if stream_id in self._backlog:
            credit = self._peer_credit(stream_id)
            before = max(0, written - credit)
            self._beyond_tracked += max(0, written + size - credit) - before
        else:
            self._untracked.add(stream_id)
        self._written[stream_id] = written + size
        self._unsettled.add(stream_id)
        if end_stream:
            self._finishing.add(stream_id)
        core = self._core
        if core is not None:
            self._losses_at_write[stream_id] = core.loss_total

    def _credit_changed(self, stream_id: int, credit: int) -> None:
        if stream_id in self._backlog:
            written = self._written.get(stream_id, 0)
            before = max(0, written - self._peer_credit(stream_id))
            self._beyond_tracked += max(0, written - credit) - before
        self._credit[stream_id] = credit

    def _stream_finished(self, stream_id: int) -> None:
        """qh3's core is done with a stream: stop counting it. For a stream we wrote and
        finished, that is the peer's acknowledgement of every byte and of its FIN (the
        core ends a sending stream only then, or once its reset is acknowledged, and a
        reset stream is no longer unsettled): its acknowledged floor is what it wrote, at
        once, however busy the connection is."""
        self._created_local_stream_ids.discard(stream_id)  # what qh3's facade does
        self._finishing.discard(stream_id)
        self._ending.discard(stream_id)
        self._untrack(stream_id)
        if stream_id in self._unsettled:
            self._unsettled.discard(stream_id)
            self._acked_floor[stream_id] = self._written.get(stream_id, 0)

    def _untrack(self, stream_id: int) -> None:
        self._untracked.discard(stream_id)
        if stream_id in self._backlog:
            self._backlog.discard(stream_id)
            written = self._written.get(stream_id, 0)
            self._beyond_tracked -= max(0, written - self._peer_credit(stream_id))

    def _peer_credit(self, stream_id: int) -> int:
        credit = self._credit.get(stream_id)
        if credit is not None:
            return credit
        bridge = self._tls
        parameters = None if bridge is None else bridge.remote_transport_parameters
        if parameters is None:
            return 0
        if stream_id & 0x2:
            return int(parameters.initial_max_stream_data_uni or 0)
        return int(parameters.initial_max_stream_data_bidi_remote or 0)

    def stream_room(self, stream_id: int, send_buffer: int) -> int:
        return self._peer_credit(stream_id) + send_buffer - self._written.get(stream_id, 0)

    def stream_idle(self, stream_id: int) -> bool:
        return self._written.get(stream_id, 0) <= self._peer_credit(stream_id)

    def stream_unsent(self, stream_id: int) -> int:
        if self._core is None or stream_id not in self._written:
            return 0
        try:
            return int(self.get_send_buffer_size(stream_id))
        except QuicConnectionError:
            return 0

    def stream_beyond_window(self, stream_id: int) -> int:
        return max(0, self._written.get(stream_id, 0) - self._peer_credit(stream_id))

    def stream_unacked(self, stream_id: int) -> int:
        """Written and not known acknowledged: qh3 keeps no per-stream acknowledged offset,
        so a stream is known acknowledged up to what it had written once nothing of it is
        unsent and nothing of the connection is in flight (late under load, never early).
        After a loss since the stream's last write, a retransmission may be queued where
        neither count shows it (qh3's unsent bytes are first transmissions only): then a
        pending pacing timer, which may be holding it, also defers the answer."""
        written = self._written.get(stream_id)
        if written is None:
            return 0
        floor = self._acked_floor.get(stream_id, 0)
        core = self._core
        if (
            floor < written
            and core is not None
            and core.state == "connected"
            and core.bytes_in_flight == 0
        ):
            floor = self._settle(core, stream_id, written, floor)
        return written - floor

    def _settle(self, core: QuicConnectionCore, stream_id: int, written: int, floor: int) -> int:
        """The stream's acknowledged floor, raised to ``written`` when nothing of the
        connection is in flight and nothing of the stream is waiting to be sent (see
        :meth:`stream_unacked`)."""
        if self.stream_unsent(stream_id) == 0:
            lost_since = core.loss_total != self._losses_at_write.get(stream_id, 0)
            timer = core.get_timer() if lost_since else None
            if timer is None or timer[0] != "pacing":
                floor = self._acked_floor[stream_id] = written
                self._unsettled.discard(stream_id)
        return floor

    def _settle_all(self) -> None:
        """Raise the floors as soon as an acknowledgement empties the flight, not only
        when a floor is next asked for: the acknowledgement that arrives just before the
        peer's CONNECTION_CLOSE is the last moment it can be read (once the connection is
        closing, nothing is counted acknowledged any more), and the close's report of
        unacknowledged bytes, like the lanes' SENT retirement, must see it."""
        core = self._core
        if (
            not self._unsettled
            or core is None
            or core.bytes_in_flight != 0
            or core.state != "connected"
        ):
            return
        for stream_id in list(self._unsettled):
            written = self._written.get(stream_id, 0)
            floor = self._acked_floor.get(stream_id, 0)
            if floor >= written:
                self._unsettled.discard(stream_id)
            else:
                self._settle(core, stream_id, written, floor)

    def track_send_backlog(self, stream_id: int) -> None:
        if stream_id in self._backlog:
            return
        self._untracked.discard(stream_id)
        self._backlog.add(stream_id)
        written = self._written.get(stream_id, 0)
        self._beyond_tracked += max(0, written - self._peer_credit(stream_id))

    @property
    def send_backlog(self) -> int:
        """Bytes the tracked streams may transmit (inside the peer's credit) but have not:
        every stream's unsent bytes, less the untracked streams', less what the tracked
        streams hold past their credit."""
        if self._core is None or not self._backlog:
            return 0
        unsent = self.stream_unsent_total()
        for stream_id in self._untracked:
            unsent -= self.stream_unsent(stream_id)
        return max(0, unsent - self._beyond_tracked)

    def stream_unsent_total(self) -> int:
        try:
            return int(self.get_send_buffer_size())
        except QuicConnectionError:
            return 0

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """RESET_STREAM; deferred while the core's events are held (see :meth:`stop_stream`)."""
        if not self._ended() and self._failure is None:
            if self._held is not None or self._may_reserve:
                self._deferred.append((False, stream_id, error_code))
            else:
                super().reset_stream(stream_id, error_code)
                self._ending.add(stream_id)
        self._untrack(stream_id)
        self._unsettled.discard(stream_id)  # what it wrote is abandoned, never settled

    def manage_receive_window(self, stream_id: int, consumed: Consumed, window: int) -> None:
        self._managed[stream_id] = (consumed, window)

    def forget_stream(self, stream_id: int) -> None:
        self._managed.pop(stream_id, None)
        self._delivered.pop(stream_id, None)
        self._spilling.discard(stream_id)
        if self._held == stream_id:
            self._held = None

    def poll_receive_gate(self) -> bool:
        """Take the events held for a slow reader once it caught up, and those left in the
        core for a reservation hazard once the core's transmit loop, run here, sends what
        it held (its datagrams go out with the next :meth:`datagrams_to_send`)."""
        held = self._held
        if held is None and not self._owed:
            return False
        if held is not None:
            window = self._managed.get(held)
            if window is not None and self._delivered.get(held, 0) - window[0]() >= window[1]:
                return False
            self._held = None
        core = self._core
        if (
            self._owed
            and core is not None
            and self._failure is None
            and not self._transmit_into(core, self._stash, self._now)
        ):
            return True  # failing: its termination is what the transport takes next
        before = len(self._events)
        self._drain_core()
        return len(self._events) > before or (held is not None and self._held is None)

    # -- datagram size -------------------------------------------------------------------

    @property
    def datagram_size(self) -> int:
        """The size the core builds now: the one it was made with, or less once the peer's
        ``max_udp_payload_size`` is known."""
        core = self._core
        if core is None:
            return int(self._configuration.max_datagram_size)
        return int(core.active_path[5])

    @property
    def peer_max_udp_payload_size(self) -> int:
        bridge = self._tls
        parameters = None if bridge is None else bridge.remote_transport_parameters
        size = None if parameters is None else parameters.max_udp_payload_size
        return UNLIMITED_UDP_PAYLOAD if size is None else int(size)

    @property
    def probe_timeout(self) -> float:
        rtt = None if self._core is None else self._core.smoothed_rtt
        return 3 * (rtt if rtt else float(self._configuration.initial_rtt))

    def set_datagram_size(self, size: int) -> None:
        """qh3 fixes the size when the connection is made (``live_datagram_size`` False)."""

    def send_mtu_probe(self, size: int, now: float) -> list[tuple[bytes, Any]]:
        return []  # no probes on qh3 (``mtu_probes`` False)


def _end_of_packets(data: bytes, cid_length: int) -> int:
    """Where the datagram's last parseable QUIC packet ends (its length if all parse)."""
    offset = 0
    while offset < len(data):
        try:
            end = qh3_pull_quic_header(data, offset, cid_length)[9]
        except ValueError:
            return offset
        if end <= offset:
            return len(data)
        offset = end
    return offset


def _start_of_last_packet(data: bytes, end: int, cid_length: int) -> int:
    offset = 0
    while True:
        following = qh3_pull_quic_header(data, offset, cid_length)[9]
        if following >= end:
            return offset
        offset = following
