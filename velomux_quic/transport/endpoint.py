"""The node's QUIC transport: one UDP endpoint that both dials and accepts.

Datagrams are demultiplexed to connections by destination connection ID, the way a
QUIC server does, except that the same socket also carries the connections this
node dialed. One socket per node keeps the port story simple (a peer record is one
address) and lets the kernel's receive buffer serve every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client.registry import CollectorRegistry

from ..errors import (
    ChannelClosed,
    ConfigurationError,
    CredentialsError,
    DialError,
    LaneError,
    MessageTooLarge,
    PeerNotRegistered,
    TransportClosed,
)
from ..eventlog import log_event
from ..ids import InstanceId
from ..security.certs import NodeCredentials
from ..security.rotation import (
    CertificateSummary,
    check_replacement,
    load_replacement,
    summarize_certificate,
)
from ..security.verify import PeerVerifier
from .admission import PeerLedger, SendOutcome
from .batched_udp import BatchedUdpTransport, gso_wanted
from .config import MAX_LANES, TransportConfig
from .connection import PeerConnection
from .engine_choice import EngineFactory, make_engine_factory
from .handler import TransportHandler
from .handshakes import HandshakeBudget, Verdict
from .lanes import CONTROL_LANE
from .metrics import TransportCollector, TransportStats
from .packets import (
    MIN_INITIAL_DATAGRAM,
    PacketType,
    encode_retry,
    encode_version_negotiation,
    parse_long_header,
    runs_by_connection,
)
from .perstream_send import PerStreamOutbound
from .resets import StatelessResets, reset_key_from
from .retry_tokens import RetryTokens
from .seam import EngineFeatures
from .snapshot import ConnectionSnapshot, TransportSnapshot
from .states import CloseCode, ConnectionState
from .udp import BufferSizes, open_udp_socket

__all__ = ["Address", "QuicEndpoint", "TransportHandler"]

logger = logging.getLogger(__name__)

_USABLE = (ConnectionState.HANDSHAKING, ConnectionState.ESTABLISHED)
"""The states of a connection a send may use (read per send: built once)."""

Address = tuple[str, int]

_CID_LENGTH = 8


def _serial(der: bytes | None) -> str | None:
    return None if der is None else f"{x509.load_der_x509_certificate(der).serial_number:x}"


def _with_certificates(connection: PeerConnection) -> ConnectionSnapshot:
    """A connection's snapshot with the certificates its own handshake exchanged."""
    own, peer = connection.quic.presented_certificates()
    return dataclasses.replace(
        connection.snapshot(),
        own_certificate_serial=_serial(own),
        peer_certificate_serial=_serial(peer),
    )


_ADDRESS_REASONS = frozenset({"handshake_timeout", "unreachable"})
"""Dial failures in which the address itself may be the mistake."""


def _address_text(address: Address | None) -> str:
    return "" if address is None else f"{address[0]}:{address[1]}"


def _bind_failure(host: str, port: int, error: OSError) -> str:
    """One line saying why ``host:port`` could not be bound, and what to do about it."""
    where = f"{host}:{port}"
    if isinstance(error, socket.gaierror):
        return f"cannot listen on UDP {where}: {host!r} does not resolve: fix the host name"
    if error.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on UDP {where}: another process holds that port (a node already "
            "running with this configuration?): stop it, or choose another port (0 for "
            "any free one)"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on UDP {where}: {host} is not an address of this machine: use "
            "one of its own addresses, or 0.0.0.0 / :: for all of them"
        )
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"cannot listen on UDP {where}: not permitted: choose a port above 1023"
    return f"cannot listen on UDP {where}: {error.strerror or error}"


class QuicEndpoint(asyncio.DatagramProtocol):
    """Mutually authenticated QUIC between nodes, with ordered lanes and admission gates.

    Create with :meth:`start`; close with :meth:`close` (or ``async with``).
    """

    def __init__(
        self,
        credentials: NodeCredentials,
        config: TransportConfig,
        handler: TransportHandler,
        registry: CollectorRegistry,
    ) -> None:
        self.credentials = credentials
        self.instance_id: InstanceId = credentials.instance_id
        self.config = config
        self.handler = handler
        self.registry = registry
        self.loop = asyncio.get_running_loop()
        self.stats = TransportStats()
        self.peer_ledger = PeerLedger(
            self.config.max_unacked_bytes_per_peer,
            self.config.peer_turn_bytes,
            self.loop.call_soon,
            self.loop.time,
        )
        """What each peer's connections hold together (unacknowledged, unfinished frames)."""
        self.buffer_sizes = BufferSizes((0, 0))
        self._verifier = PeerVerifier(credentials.trust_roots, credentials.trust_domain)
        self._resets = StatelessResets(
            reset_key_from(
                credentials.private_key.private_bytes(
                    serialization.Encoding.DER,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            ),
            now=self.loop.time(),
        )
        self._engines: EngineFactory = make_engine_factory(
            credentials, config, self._verifier, self._resets
        )
        self.stats.certificate_not_after = credentials.certificate.not_valid_after_utc.timestamp()
        self._udp: BatchedUdpTransport | None = None
        self._udp_closed: asyncio.Future[None] = self.loop.create_future()
        self._address: Address = ("", 0)
        self._addresses: dict[InstanceId, Address] = {}
        self._learned: set[InstanceId] = set()
        """Peers whose address came from their own inbound connection, not registration."""
        self._by_cid: dict[bytes, PeerConnection] = {}
        self._cids: dict[PeerConnection, set[bytes]] = {}
        self._outbound: dict[InstanceId, PeerConnection] = {}
        self._inbound: dict[InstanceId, dict[PeerConnection, None]] = {}
        """Each peer's accepted connections, oldest first (a dict keeps the order)."""
        self._handshakes = HandshakeBudget(
            retry_threshold=config.retry_threshold,
            max_half_open=config.max_half_open_handshakes,
            max_per_source=config.max_half_open_per_source,
        )
        """Inbound connections still handshaking, per source and address validation."""
        self._retry = RetryTokens()
        self._paused: set[tuple[InstanceId, int]] = set()
        self._closing = False
        self._live_with: dict[InstanceId, int] = {}
        """Established connections with each peer, both directions (for peer_connected
        and peer_lost, which are logged per peer, not per connection)."""
        self._loss_reasons: dict[InstanceId, str] = {}
        """Why this node is closing a peer's connections (disconnect), for peer_lost."""
        self._collector = TransportCollector.register(registry, self.stats, self.connection_count)

    @classmethod
    async def start(
        cls,
        credentials: NodeCredentials,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: TransportConfig | None = None,
        handler: TransportHandler | None = None,
        registry: CollectorRegistry | None = None,
    ) -> QuicEndpoint:
        """Bind the node's UDP endpoint and start accepting mutually authenticated peers."""
        config = config or TransportConfig()
        transport = cls(
            credentials, config, handler or TransportHandler(), registry or CollectorRegistry()
        )
        try:
            sock, sizes = open_udp_socket(
                host,
                port,
                receive_buffer=config.udp_receive_buffer,
                send_buffer=config.udp_send_buffer,
            )
        except OSError as exc:
            transport.registry.unregister(transport._collector)
            raise ConfigurationError(_bind_failure(host, port, exc)) from exc
        transport.buffer_sizes = sizes
        try:
            BatchedUdpTransport.open(
                sock, transport.loop, transport, transport.stats, gso=gso_wanted(config.gso)
            )
        except BaseException:
            sock.close()
            transport.registry.unregister(transport._collector)
            raise
        return transport

    def reload_credentials(self, credentials: NodeCredentials | str | Path) -> CertificateSummary:
        """Use ``credentials`` (certificate, key, trust roots) for every new connection.

        ``credentials`` is a :class:`NodeCredentials` or a credentials directory, read
        here so a file that is missing, unreadable or garbled is refused (and counted)
        like any other bad set.

        Connections already made keep the certificate, key and verifier they were made
        with until they end, so nothing in flight is disturbed; new dials and new accepts
        use the new set. Refused with :class:`~velomux_quic.errors.CredentialsError`,
        the current credentials staying in use, when the key does not match the
        certificate, the InstanceId or trust domain differs, the certificate is outside
        its validity or does not chain to the new trust roots. Counted either way in
        ``velo_transport_credential_reloads_total{outcome}``. Returns the new
        certificate's summary.
        """
        try:
            credentials = load_replacement(credentials)
            check_replacement(self.credentials, credentials)
            verifier = PeerVerifier(credentials.trust_roots, credentials.trust_domain)
            engines = make_engine_factory(credentials, self.config, verifier, self._resets)
        except CredentialsError as exc:
            self.stats.credential_reloads["refused"] += 1
            logger.warning("credentials reload refused: %s", exc)
            raise
        # One synchronous swap: the event loop runs no connection code between these.
        self.credentials = credentials
        self._verifier = verifier
        self._engines = engines
        self.stats.credential_reloads["ok"] += 1
        self.stats.certificate_not_after = credentials.certificate.not_valid_after_utc.timestamp()
        summary = summarize_certificate(credentials.certificate)
        logger.info(
            "credentials reloaded: new connections present serial %s (valid until %s)",
            summary.serial,
            summary.not_after.isoformat(),
        )
        return summary

    async def __aenter__(self) -> QuicEndpoint:
        """``async with`` closes the transport however the block ends."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close (see :meth:`close`); an exception of the block propagates."""
        await self.close()

    # -- properties ----------------------------------------------------------------------

    @property
    def address(self) -> Address:
        """The (host, port) peers dial to reach this node."""
        return self._address

    def lanes(self, peer: InstanceId) -> int:
        """Ordered lanes to ``peer``: the configured count, the same for every peer.

        Asked per peer so a layer above spreads its traffic over what each peer has.
        """
        return self.config.lanes

    def max_message_size(self, peer: InstanceId) -> int:
        """The largest frame body ``peer`` is sent (larger ones raise MessageTooLarge).

        Asked per peer so a layer above sizes its batches before it builds them.
        """
        return self.config.max_message_size

    @property
    def engine(self) -> EngineFeatures:
        """The QUIC engine this transport's connections run, and what it does."""
        return self._engines.features

    def connection_count(self) -> int:
        """Connections in any state, either direction (the active-connections gauge)."""
        return len(self._cids)

    def snapshot(self) -> TransportSnapshot:
        """What every connection holds now: lanes, waiting streams, backlog, requests.

        For operators and tests, in place of reading the connections' internals; it walks
        every connection, so call it for a picture, not per message.
        """
        return TransportSnapshot(
            tuple(_with_certificates(c) for c in self._cids),
            certificate=summarize_certificate(self.credentials.certificate),
            trust_roots=tuple(summarize_certificate(r) for r in self.credentials.trust_roots),
            engine=self._engines.features,
            udp=self._udp.batching if self._udp is not None else None,
        )

    # -- peers ---------------------------------------------------------------------------

    def register_peer(self, peer: InstanceId, address: Address) -> None:
        """Learn where ``peer`` listens. Its identity is still proven by its certificate."""
        self._addresses[peer] = address
        self._learned.discard(peer)
        self.stats.registered_peers = len(self._addresses)

    def unregister_peer(self, peer: InstanceId) -> None:
        """Forget where ``peer`` listens (it left); a live connection is not closed."""
        self._addresses.pop(peer, None)
        self._learned.discard(peer)
        self.stats.registered_peers = len(self._addresses)

    def peer_address(self, peer: InstanceId) -> Address | None:
        """Where ``peer`` is dialed: registered, or learned from its own connection."""
        return self._addresses.get(peer)

    # -- sending -------------------------------------------------------------------------

    def send(self, peer: InstanceId, lane: int, body: bytes) -> SendOutcome:
        """Queue ``body`` as one frame on ``lane`` to ``peer``; never blocks.

        Returns ``ADMITTED`` or a pending :class:`SendAdmission` that resolves in FIFO
        order per (peer, lane). Dials the peer on first use, and again after its
        connection closed. A lane at or above :meth:`lanes` maps to ``lane % lanes``, but
        :data:`CONTROL_LANE`, which keeps a stream of its own for control messages.
        """
        if self._closing:
            raise TransportClosed("the transport is closed")
        if not 0 <= lane < MAX_LANES:
            raise LaneError(f"lane must be 0 to {MAX_LANES - 1}, got {lane}")
        if len(body) > self.config.max_message_size:
            raise MessageTooLarge(len(body), self.config.max_message_size)
        if lane != CONTROL_LANE:  # the control lane keeps its own stream (see CONTROL_LANE)
            lane %= self.config.lanes
        return self._outbound_connection(peer).send(lane, body)

    async def connect(self, peer: InstanceId) -> None:
        """Dial ``peer`` now (sends dial lazily); raises DialError if the handshake fails."""
        if self._closing:
            raise TransportClosed("the transport is closed")
        address = self._addresses.get(peer)
        try:
            await self._outbound_connection(peer).wait_established()
        except DialError as exc:
            if address is None or exc.reason not in _ADDRESS_REASONS:
                raise  # refused by whoever answered: the address was right
            # Name the address tried: a peer configured at a wrong one only times out.
            raise DialError(f"{exc} (dialed {address[0]}:{address[1]})", reason=exc.reason) from exc

    def on_delivered(self, peer: InstanceId, lane: int, callback: Callable[[bool], None]) -> None:
        """``callback(True)`` once ``peer`` acknowledged every byte sent so far on ``lane``
        (its QUIC stack has them); ``callback(False)`` if the connection or the lane ends
        first, or no connection to ``peer`` exists. Never dials, never blocks."""
        connection = self._outbound.get(peer)
        if connection is None or not 0 <= lane < MAX_LANES:
            callback(False)
            return
        connection.on_delivered(lane % self.config.lanes, callback)

    async def check_health(self, peer: InstanceId, timeout: float | None = None) -> None:
        """Prove ``peer`` answers: complete the handshake if needed, then a PING round trip.

        A connection can look established long after its peer died (until the idle
        timeout); this finds out now. ``timeout`` defaults to
        ``TransportConfig.health_check_timeout``; raises TimeoutError, DialError or
        ChannelClosed when the peer does not answer.
        """
        if timeout is None:
            timeout = self.config.health_check_timeout
        connection = self._outbound_connection(peer)
        async with asyncio.timeout(timeout):
            await connection.wait_established()
            await connection.ping(timeout)

    async def request(
        self, peer: InstanceId, request: bytes, *, max_response: int, timeout: float
    ) -> bytes:
        """Ask ``peer`` for bytes over a new stream of a connection it dialed to us.

        Used to pull what a peer staged for us (rendezvous) without touching any lane.
        Raises ChannelClosed when ``peer`` has no live connection to us, RequestRefused
        when it refuses, ResponseTooLarge past ``max_response`` bytes, and TimeoutError.
        The stream is abandoned (STOP_SENDING) on timeout or cancellation.
        """
        connections = [c for c in self._inbound.get(peer, ()) if c.established]
        if not connections:
            raise ChannelClosed(f"peer {peer} has no live connection to this node")
        connection = connections[-1]
        future = connection.requests_out.start(request, max_response)
        return await asyncio.wait_for(future, timeout)

    def open_stream(self, peer: InstanceId, *, send_buffer: int = 64 * 1024) -> PerStreamOutbound:
        """A unidirectional stream of its own to ``peer`` (dialing if needed).

        For a layer above that needs flow control per stream, apart from every lane (the
        per-stream path): the peer's reader holds back this stream only. Its gate admits
        while the stream holds at most ``send_buffer`` bytes not yet transmitted and the
        connection's per-stream streams together at most ``streams_send_buffer``.
        """
        if self._closing:
            raise TransportClosed("the transport is closed")
        return self._outbound_connection(peer).open_stream(send_buffer)

    def known_peers(self) -> set[InstanceId]:
        """Peers with an address or a live verified connection, either direction."""
        return set(self._addresses) | set(self._inbound) | set(self._outbound)

    def knows(self, peer: InstanceId) -> bool:
        """Whether ``peer`` is one of :meth:`known_peers`, without building the set."""
        return peer in self._addresses or peer in self._inbound or peer in self._outbound

    def is_connected(self, peer: InstanceId, *, outbound: bool | None = None) -> bool:
        """Whether an established connection with ``peer`` remains: one this node dialed
        (``outbound=True``), one the peer dialed (``False``), or either (None)."""
        if outbound is not False:
            dialed = self._outbound.get(peer)
            if dialed is not None and dialed.state is ConnectionState.ESTABLISHED:
                return True
        if outbound is not True:
            for accepted in self._inbound.get(peer, ()):
                if accepted.state is ConnectionState.ESTABLISHED:
                    return True
        return False

    def is_dialing(self, peer: InstanceId) -> bool:
        """Whether the connection this node dialed to ``peer`` is still in its handshake
        (what a send to ``peer`` waits for now)."""
        dialed = self._outbound.get(peer)
        return dialed is not None and dialed.state is ConnectionState.HANDSHAKING

    def outbound_connection(self, peer: InstanceId) -> PeerConnection | None:
        """The live connection this node dialed to ``peer``, if any (no dial is started).

        For operators and tests that act on one connection (``reset_lane``, ``close``);
        to read its state, use :meth:`snapshot`.
        """
        return self._outbound.get(peer)

    def reset_lane(self, peer: InstanceId, lane: int) -> None:
        """Abort one outbound lane to ``peer`` (RESET_STREAM); the next send opens it anew.

        The peer's handler hears ``lane_reset`` and frames in flight on the lane are lost:
        for operators cutting a stuck lane, and for tests of that path. Nothing happens
        without a live connection or before the lane was used.
        """
        if not 0 <= lane < MAX_LANES:
            raise LaneError(f"lane must be 0 to {MAX_LANES - 1}, got {lane}")
        connection = self._outbound.get(peer)
        if connection is not None:
            connection.reset_lane(lane % self.config.lanes)

    def disconnect(
        self, peer: InstanceId, *, outbound: bool = True, inbound: bool = True, reason: str = ""
    ) -> None:
        """Abruptly close connections to/from ``peer`` (operators, liveness checks, fault
        tests); ``reason`` is what ``peer_lost`` says if no connection with it is left."""
        if reason:
            self._loss_reasons[peer] = reason
        connections: list[PeerConnection] = []
        if outbound and peer in self._outbound:
            connections.append(self._outbound[peer])
        if inbound:
            connections.extend(self._inbound.get(peer, ()))
        for connection in connections:
            connection.close(CloseCode.KILLED, "disconnected")

    def _outbound_connection(self, peer: InstanceId) -> PeerConnection:
        connection = self._outbound.get(peer)
        if connection is not None and connection.state in _USABLE:
            return connection
        address = self._addresses.get(peer)
        if address is None:
            raise PeerNotRegistered(
                f"no address is registered for peer {peer}: give it with "
                f"node.add_peer(InstanceId.parse('{peer}'), 'host:port') (or a [[peers]] "
                "entry in the configuration), or configure discovery so the node can find it"
            )
        quic = self._engines.client(peer, self._address[0], address[0])
        connection = PeerConnection(self, quic, is_client=True, peer=peer)
        quic.cid_minted = lambda cid: self.register_cid(cid, connection)
        self._outbound[peer] = connection
        self.register_cid(quic.host_cid, connection)
        self.stats.dials += 1
        quic.connect(address, now=self.loop.time())
        connection.start_handshake_deadline()
        connection.transmit()
        return connection

    # -- receiving -----------------------------------------------------------------------

    def pause_reading(self, peer: InstanceId, lane: int) -> None:
        """Stop taking frames from ``peer`` on ``lane``: its window closes, its sends go Pending."""
        self._paused.add((peer, lane))
        for connection in self._inbound.get(peer, ()):
            connection.pause_reading(lane)

    def resume_reading(self, peer: InstanceId, lane: int) -> None:
        """Take frames from ``peer`` on ``lane`` again: held frames first, then its window opens."""
        self._paused.discard((peer, lane))
        for connection in list(self._inbound.get(peer, ())):
            connection.resume_reading(lane)

    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool:
        """Whether :meth:`pause_reading` holds ``lane`` from ``peer`` (new connections too)."""
        return (peer, lane) in self._paused

    # -- asyncio.DatagramProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """asyncio: the socket is bound; learn the address peers dial."""
        self._udp = cast(BatchedUdpTransport, transport)
        sockname = self._udp.get_extra_info("sockname")
        self._address = (sockname[0], sockname[1])

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio: the socket closed; :meth:`close` waits for this."""
        if not self._udp_closed.done():
            self._udp_closed.set_result(None)

    def error_received(self, exc: Exception) -> None:
        """asyncio: an ICMP error on the socket, or a send it refused; logged only."""
        # ICMP errors (port unreachable, ...) surface here; QUIC's own timers handle them.
        # EMSGSIZE is a datagram above the device MTU (a path MTU probe): counted, and its
        # loss tells the search the size is too big.
        if isinstance(exc, OSError) and exc.errno == errno.EMSGSIZE:
            self.stats.datagrams_too_big += 1
        logger.debug("UDP error: %s", exc)

    def datagrams_received(self, datagrams: list[bytes], addr: Address) -> None:
        """The datagrams of one GRO buffer: each run of them for one connection goes to it
        at once, so the engine's events and the transmit are taken once a run, not once a
        datagram (see :meth:`PeerConnection.datagrams_received`). Any other datagram (a
        long header, an unknown connection ID) takes the one-datagram path."""
        for connection, run in runs_by_connection(datagrams, self._by_cid, _CID_LENGTH):
            if connection is None or len(run) == 1:
                self.datagram_received(run[0], addr)
            else:
                self.stats.datagrams_in += len(run)
                connection.datagrams_received(run, addr)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        """asyncio: route a datagram to its connection by connection ID, or accept a dial."""
        self.stats.datagrams_in += 1
        if data and not data[0] & 0x80:  # short header: the hot path after the handshake
            connection = self._by_cid.get(data[1 : 1 + _CID_LENGTH])
            if connection is not None:
                connection.datagram_received(data, addr)
            else:
                self._unroutable(data, addr)
            return
        try:
            header = parse_long_header(data)
        except ValueError:
            self.stats.rejections["malformed_datagram"] += 1
            return
        connection = self._by_cid.get(header.destination_cid)
        if connection is not None:
            connection.datagram_received(data, addr)
            return
        if (
            header.packet_type is not PacketType.VERSION_NEGOTIATION
            and header.version not in self._engines.supported_versions
        ):
            self.sendto(
                encode_version_negotiation(
                    destination_cid=header.source_cid,
                    source_cid=header.destination_cid,
                    supported_versions=self._engines.supported_versions,
                ),
                addr,
            )
            return
        if header.packet_type is not PacketType.INITIAL or len(data) < MIN_INITIAL_DATAGRAM:
            return
        if self._closing:
            return
        self._initial_received(
            header.version, header.destination_cid, header.source_cid, header.token, data, addr
        )

    def _unroutable(self, data: bytes, addr: Address) -> None:
        """A short-header datagram for no connection of ours: a peer's stateless reset of
        one of our connections, or a packet for a connection we no longer have, which we
        answer with a reset of our own (see :mod:`.resets`)."""
        for connection in self._cids:
            if connection.remote_address == addr and StatelessResets.matches(
                data, connection.quic.peer_reset_tokens()
            ):
                self.stats.stateless_resets_received += 1
                logger.info(
                    "%s reset the connection (it had lost its state); a new one will be dialed",
                    connection.peer or addr,
                )
                connection.reset_by_peer()
                return
        if self._resets.is_late_reset(data):
            self.stats.stateless_resets_late += 1
            return
        if self._closing:
            return
        reset = self._resets.build(data[1 : 1 + _CID_LENGTH], len(data), self.loop.time())
        if reset is None:
            self.stats.stateless_resets_suppressed = self._resets.suppressed
            return
        self.stats.stateless_resets_sent += 1
        self.sendto(reset, addr)

    def _initial_received(
        self,
        version: int,
        destination_cid: bytes,
        source_cid: bytes,
        token: bytes,
        data: bytes,
        addr: Address,
    ) -> None:
        """A new connection's first datagram: accept it, or answer with a Retry, or drop it.

        Address validation comes first: an Initial that carries one of our Retry tokens
        proved it receives at its source address, and is counted apart from those that
        did not, so a flood of unvalidated (possibly spoofed) Initials never spends the
        slots a validated peer needs. Which Initials get a slot, a Retry or nothing is
        :class:`~.handshakes.HandshakeBudget`'s rule.
        """
        retry_source_cid: bytes | None = None
        validated = bool(token)
        if validated:  # we never issue NEW_TOKEN: a token is one of our Retry tokens
            try:
                original_cid = self._retry.check(addr, destination_cid, token, self.loop.time())
            except ValueError:
                self.stats.rejections["invalid_retry_token"] += 1
                return
            retry_source_cid = destination_cid
        else:
            original_cid = destination_cid
        decision = self._handshakes.verdict(addr[0], validated=validated)
        if decision.reason is not None:
            self.stats.rejections[decision.reason] += 1
        if decision.verdict is Verdict.ACCEPT:
            self._accept(original_cid, destination_cid, retry_source_cid, data, addr, validated)
        elif decision.verdict is Verdict.RETRY:
            new_cid = os.urandom(_CID_LENGTH)
            token = self._retry.issue(addr, destination_cid, new_cid, self.loop.time())
            self.sendto(
                encode_retry(
                    version=version,
                    source_cid=new_cid,
                    destination_cid=source_cid,
                    original_destination_cid=destination_cid,
                    token=token,
                ),
                addr,
            )

    def _accept(
        self,
        original_cid: bytes,
        destination_cid: bytes,
        retry_source_cid: bytes | None,
        data: bytes,
        addr: Address,
        validated: bool,
    ) -> None:
        quic = self._engines.server(original_cid, retry_source_cid, self._address[0], addr[0])
        connection = PeerConnection(self, quic, is_client=False, peer=None)
        quic.cid_minted = lambda cid: self.register_cid(cid, connection)
        self._handshakes.opened(connection, addr[0], validated=validated)
        self.register_cid(destination_cid, connection)
        self.register_cid(quic.host_cid, connection)
        connection.start_handshake_deadline()
        connection.datagram_received(data, addr)

    def _half_open_ended(self, connection: PeerConnection) -> None:
        """An inbound handshake finished, either way: it no longer counts against the bounds."""
        self._handshakes.ended(connection)

    # -- called by connections -----------------------------------------------------------

    def sendto(self, data: bytes, addr: Address) -> None:
        """Put one datagram on the shared socket (connections transmit through here)."""
        if self._udp is not None:
            self._udp.sendto(data, addr)

    def send_datagrams(self, datagrams: list[tuple[bytes, Address]]) -> None:
        """Put one transmit's datagrams on the socket, in trains where the kernel allows."""
        if self._udp is not None:
            self._udp.send_datagrams(datagrams)

    def register_cid(self, cid: bytes, connection: PeerConnection) -> None:
        """Route datagrams addressed to ``cid`` to ``connection`` (one socket, many connections)."""
        self._by_cid[cid] = connection
        self._cids.setdefault(connection, set()).add(cid)

    def unregister_cid(self, cid: bytes) -> None:
        """Stop routing ``cid``: its connection retired it."""
        connection = self._by_cid.pop(cid, None)
        if connection is not None:
            self._cids.get(connection, set()).discard(cid)

    def connection_established(self, connection: PeerConnection) -> None:
        """A connection verified its peer: index it, apply paused lanes, tell the handler."""
        assert connection.peer is not None
        if not connection.is_client:
            self._half_open_ended(connection)
            inbound = self._inbound.setdefault(connection.peer, {})
            inbound[connection] = None
            self._limit_connections(connection.peer, inbound)
            self._learn_return_route(connection.peer, connection.remote_address)
            for peer, lane in self._paused:
                if peer == connection.peer:
                    connection.pause_reading(lane)
        self._note_connected(connection)
        self.handler.peer_connected(connection.peer, connection.is_client)

    def _limit_connections(self, peer: InstanceId, inbound: dict[PeerConnection, None]) -> None:
        """Past ``max_connections_per_peer``, close that peer's oldest connections.

        The oldest rather than the new one: a peer that restarted re-dials while its old
        connection waits for the idle timeout, and must not be locked out by it; and every
        connection closed here belongs to the same verified InstanceId as the one kept.
        """
        limit = self.config.max_connections_per_peer
        live = [c for c in inbound if c.state is ConnectionState.ESTABLISHED]
        for oldest in live[: max(0, len(live) - limit)]:
            self.stats.rejections["connections_per_peer"] += 1
            logger.info("closing the oldest connection from %s: more than %d at once", peer, limit)
            oldest.close(CloseCode.REPLACED, "too many connections from this peer")

    def _learn_return_route(self, peer: InstanceId, address: Address | None) -> None:
        """The return route: one UDP socket per node both dials and listens, so a verified
        peer's source address is where it listens. Registered addresses (discovery,
        config) always win over a learned one. A learned address that changed means the
        peer restarted elsewhere (same certificate, new port): the connection we dialed
        to the old address reaches nobody, so it is replaced and the next send re-dials."""
        if address is None or (peer in self._addresses and peer not in self._learned):
            return
        previous = self._addresses.get(peer)
        if previous == address:
            return
        self._addresses[peer] = address
        self._learned.add(peer)
        self.stats.registered_peers = len(self._addresses)
        stale = self._outbound.get(peer)
        if previous is not None and stale is not None:
            logger.info("%s now dials from %s (was %s): re-dialing it", peer, address, previous)
            stale.close(CloseCode.REPLACED, "the peer restarted at another address")

    def connection_closed(self, connection: PeerConnection) -> None:
        """A connection ended: forget it, and tell the handler if it had been established."""
        self._resets.remember(connection.quic.peer_reset_tokens())
        for cid in self._cids.pop(connection, set()):
            if self._by_cid.get(cid) is connection:
                del self._by_cid[cid]
        peer = connection.peer
        if connection.is_client:
            if peer is not None and self._outbound.get(peer) is connection:
                del self._outbound[peer]
        elif connection.established_once:
            assert peer is not None
            inbound = self._inbound.get(peer)
            if inbound is not None:
                inbound.pop(connection, None)
                if not inbound:
                    del self._inbound[peer]
        else:
            self._half_open_ended(connection)
        if connection.established_once:
            assert peer is not None
            assert connection.link is not None
            self._note_lost(connection)
            self.handler.connection_lost(connection.link)
            self.handler.peer_disconnected(peer, connection.is_client)

    def _note_connected(self, connection: PeerConnection) -> None:
        peer = connection.peer
        assert peer is not None
        count = self._live_with.get(peer, 0)
        self._live_with[peer] = count + 1
        direction = "outbound" if connection.is_client else "inbound"
        address = _address_text(connection.remote_address)
        if count == 0:
            self._loss_reasons.pop(peer, None)
            log_event(
                logger,
                logging.INFO,
                "peer_connected",
                peer=peer,
                address=address,
                direction=direction,
            )
        else:
            log_event(
                logger,
                logging.DEBUG,
                "connection_established",
                peer=peer,
                address=address,
                direction=direction,
            )

    def _note_lost(self, connection: PeerConnection) -> None:
        peer = connection.peer
        assert peer is not None
        left = self._live_with.get(peer, 0) - 1
        address = _address_text(connection.remote_address)
        if left > 0:
            self._live_with[peer] = left
            log_event(logger, logging.DEBUG, "connection_closed", peer=peer, address=address)
            return
        self._live_with.pop(peer, None)
        reason = self._loss_reasons.pop(peer, "connection closed")
        # This node's own close ends every connection: that is no news about the peer.
        level = logging.DEBUG if self._closing else logging.INFO
        log_event(logger, level, "peer_lost", peer=peer, address=address, reason=reason)

    # -- shutdown ------------------------------------------------------------------------

    def _all_connections(self) -> Iterable[PeerConnection]:
        return list(self._cids)

    async def close(self) -> None:
        """Close every connection (admitted data gets ``close_timeout`` to be acknowledged),
        then the socket. Pending admissions are refused with ChannelClosed. Idempotent."""
        if self._closing:
            await asyncio.shield(self._udp_closed)
            return
        self._closing = True
        connections = self._all_connections()
        if connections:
            await asyncio.gather(*(c.aclose(self.config.close_timeout) for c in connections))
        if self._udp is not None:
            self._udp.close()
        else:
            self._udp_closed.set_result(None)
        await asyncio.shield(self._udp_closed)
        with contextlib.suppress(KeyError):  # already unregistered by a second close
            self.registry.unregister(self._collector)

    @property
    def closing(self) -> bool:
        """True from the moment :meth:`close` began: the transport takes nothing new."""
        return self._closing

    @property
    def closed(self) -> bool:
        """True once :meth:`close` finished: every connection and the socket are closed."""
        return self._closing and self._udp_closed.done()
