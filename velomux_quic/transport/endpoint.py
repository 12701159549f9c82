"""The node's QUIC transport: one UDP endpoint that both dials and accepts.

Datagrams are demultiplexed to connections by destination connection ID, the way
aioquic's own server does, except that the same socket also carries the connections this
node dialed. One socket per node keeps the port story simple (a peer record is one
address) and lets the kernel's receive buffer serve every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import cast

from aioquic._buffer import Buffer  # typed there; aioquic.buffer re-exports it untyped
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.events import StreamDataReceived
from aioquic.quic.packet import (
    QuicPacketType,
    encode_quic_version_negotiation,
    pull_quic_header,
)
from prometheus_client.registry import CollectorRegistry

from ..ids import InstanceId
from ..security.certs import NodeCredentials
from ..security.tls import make_quic_configuration
from ..security.verify import PeerVerifier
from .admission import SendOutcome
from .config import MAX_LANES, TransportConfig
from .connection import CloseCode, ConnectionState, PeerConnection
from .engine import EngineConnection
from .errors import (
    ChannelClosed,
    LaneError,
    MessageTooLarge,
    PeerNotRegistered,
    RequestRefused,
    TransportClosed,
    TransportError,
)
from .lanes import OutboundStream
from .metrics import TransportCollector, TransportStats
from .udp import BufferSizes, open_udp_socket

__all__ = ["Address", "QuicTransport", "TransportHandler"]

logger = logging.getLogger(__name__)

Address = tuple[str, int]

_CID_LENGTH = 8
_MAX_HANDSHAKING = 256
"""Inbound connections allowed to be mid-handshake at once; more Initials are dropped."""


class TransportHandler:
    """What the layer above hears from the transport. Override what you need.

    Every method is called on the event loop, synchronously, and must not block:
    ``frame_received`` in particular runs once per frame on the receive path.
    """

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        """A whole frame arrived from a verified ``peer`` on ``lane``, in lane order."""

    def lane_reset(self, peer: InstanceId, lane: int) -> None:
        """The peer aborted one lane's stream; frames in flight on it are lost."""

    def send_failed(self, peer: InstanceId, lane: int, error: TransportError) -> None:
        """Admitted data was lost (its connection died before acknowledging it)."""
        logger.warning("send to %s on lane %d failed after admission: %s", peer, lane, error)

    def peer_connected(self, peer: InstanceId, outbound: bool) -> None:
        """A connection to (outbound) or from (inbound) ``peer`` completed mutual TLS."""

    def peer_disconnected(self, peer: InstanceId, outbound: bool) -> None:
        """A connection to or from ``peer`` ended."""

    def stream_received(self, connection: PeerConnection, event: StreamDataReceived) -> bool:
        """Data on a stream that is not a lane; return True to claim it (default: refuse)."""
        return False

    def stream_reset(self, connection: PeerConnection, stream_id: int, error_code: int) -> None:
        """The peer aborted a non-lane stream it was writing to us."""

    def stream_stopped(self, connection: PeerConnection, stream_id: int) -> None:
        """The peer asked us to stop writing a stream we opened (see ``open_stream``)."""

    def connection_lost(self, connection: PeerConnection) -> None:
        """An established connection ended (before ``peer_disconnected`` is called)."""

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        """Answer a request stream the accepting side opened toward us (see :meth:`request`).

        Raise to refuse: the requester gets :class:`RequestRefused`.
        """
        raise RequestRefused("this node serves no requests")


class QuicTransport(asyncio.DatagramProtocol):
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
        self.buffer_sizes = BufferSizes((0, 0))
        self._verifier = PeerVerifier(credentials.trust_roots, credentials.trust_domain)
        self._client_config, self._server_config = (
            make_quic_configuration(
                credentials,
                is_client=is_client,
                max_datagram_size=config.max_datagram_size,
                idle_timeout=config.idle_timeout,
                max_stream_data=config.stream_window,
                max_data=config.connection_window,
            )
            for is_client in (True, False)
        )
        self._udp: asyncio.DatagramTransport | None = None
        self._udp_closed: asyncio.Future[None] = self.loop.create_future()
        self._address: Address = ("", 0)
        self._addresses: dict[InstanceId, Address] = {}
        self._learned: set[InstanceId] = set()
        """Peers whose address came from their own inbound connection, not registration."""
        self._by_cid: dict[bytes, PeerConnection] = {}
        self._cids: dict[PeerConnection, set[bytes]] = {}
        self._outbound: dict[InstanceId, PeerConnection] = {}
        self._inbound: dict[InstanceId, set[PeerConnection]] = {}
        self._handshaking_inbound = 0
        self._paused: set[tuple[InstanceId, int]] = set()
        self._closing = False
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
    ) -> QuicTransport:
        """Bind the node's UDP endpoint and start accepting mutually authenticated peers."""
        config = config or TransportConfig()
        transport = cls(
            credentials, config, handler or TransportHandler(), registry or CollectorRegistry()
        )
        sock, sizes = open_udp_socket(
            host, port, receive_buffer=config.udp_receive_buffer, send_buffer=config.udp_send_buffer
        )
        transport.buffer_sizes = sizes
        try:
            await transport.loop.create_datagram_endpoint(lambda: transport, sock=sock)
        except BaseException:
            sock.close()
            transport.registry.unregister(transport._collector)
            raise
        return transport

    async def __aenter__(self) -> QuicTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- properties ----------------------------------------------------------------------

    @property
    def address(self) -> Address:
        """The (host, port) peers dial to reach this node."""
        return self._address

    def lanes(self, peer: InstanceId) -> int:
        """Ordered lanes to ``peer``: the configured count, the same for every peer."""
        return self.config.lanes

    def max_message_size(self, peer: InstanceId) -> int:
        return self.config.max_message_size

    def connection_count(self) -> int:
        return len(self._cids)

    # -- peers ---------------------------------------------------------------------------

    def register_peer(self, peer: InstanceId, address: Address) -> None:
        """Learn where ``peer`` listens. Its identity is still proven by its certificate."""
        self._addresses[peer] = address
        self._learned.discard(peer)
        self.stats.registered_peers = len(self._addresses)

    def unregister_peer(self, peer: InstanceId) -> None:
        self._addresses.pop(peer, None)
        self._learned.discard(peer)
        self.stats.registered_peers = len(self._addresses)

    def peer_address(self, peer: InstanceId) -> Address | None:
        return self._addresses.get(peer)

    # -- sending -------------------------------------------------------------------------

    def send(self, peer: InstanceId, lane: int, body: bytes) -> SendOutcome:
        """Queue ``body`` as one frame on ``lane`` to ``peer``; never blocks.

        Returns ``ADMITTED`` or a pending :class:`SendAdmission` that resolves in FIFO
        order per (peer, lane). Dials the peer on first use, and again after its
        connection closed. A lane at or above :meth:`lanes` maps to ``lane % lanes``.
        """
        if self._closing:
            raise TransportClosed("the transport is closed")
        if not 0 <= lane < MAX_LANES:
            raise LaneError(f"lane must be 0 to {MAX_LANES - 1}, got {lane}")
        if len(body) > self.config.max_message_size:
            raise MessageTooLarge(len(body), self.config.max_message_size)
        return self._outbound_connection(peer).send(lane % self.config.lanes, body)

    async def connect(self, peer: InstanceId) -> None:
        """Dial ``peer`` now (sends dial lazily); raises DialError if the handshake fails."""
        if self._closing:
            raise TransportClosed("the transport is closed")
        await self._outbound_connection(peer).wait_established()

    async def check_health(self, peer: InstanceId, timeout: float = 5.0) -> None:
        """Prove ``peer`` answers: complete the handshake if needed, then a PING round trip."""
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

    def open_stream(self, peer: InstanceId, *, send_buffer: int = 64 * 1024) -> OutboundStream:
        """A unidirectional stream of its own to ``peer`` (dialing if needed).

        Frames on it are ordered and flow-controlled apart from every lane; its gate
        admits like a lane's, with ``send_buffer`` bytes beyond the peer's window.
        """
        if self._closing:
            raise TransportClosed("the transport is closed")
        return self._outbound_connection(peer).open_stream(send_buffer)

    def known_peers(self) -> set[InstanceId]:
        """Peers with an address or a live verified connection, either direction."""
        return set(self._addresses) | set(self._inbound) | set(self._outbound)

    def outbound_connection(self, peer: InstanceId) -> PeerConnection | None:
        return self._outbound.get(peer)

    def inbound_connections(self, peer: InstanceId) -> list[PeerConnection]:
        return list(self._inbound.get(peer, ()))

    def disconnect(self, peer: InstanceId, *, outbound: bool = True, inbound: bool = True) -> None:
        """Abruptly close connections to/from ``peer`` (operators, and fault tests)."""
        connections: list[PeerConnection] = []
        if outbound and peer in self._outbound:
            connections.append(self._outbound[peer])
        if inbound:
            connections.extend(self._inbound.get(peer, ()))
        for connection in connections:
            connection.close(CloseCode.KILLED, "disconnected")

    def _outbound_connection(self, peer: InstanceId) -> PeerConnection:
        connection = self._outbound.get(peer)
        if connection is not None and connection.state in (
            ConnectionState.HANDSHAKING,
            ConnectionState.ESTABLISHED,
        ):
            return connection
        address = self._addresses.get(peer)
        if address is None:
            raise PeerNotRegistered(f"no address is registered for peer {peer}")
        quic = EngineConnection(
            configuration=self._client_config,
            verifier=self._verifier,
            peer_role="server",
            expected_peer=peer,
            max_concurrent_streams=self.config.max_concurrent_streams,
        )
        connection = PeerConnection(self, quic, is_client=True, peer=peer)
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
        self._paused.discard((peer, lane))
        for connection in list(self._inbound.get(peer, ())):
            connection.resume_reading(lane)

    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool:
        return (peer, lane) in self._paused

    # -- asyncio.DatagramProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._udp = cast(asyncio.DatagramTransport, transport)
        sockname = self._udp.get_extra_info("sockname")
        self._address = (sockname[0], sockname[1])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._udp_closed.done():
            self._udp_closed.set_result(None)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (port unreachable, ...) surface here; QUIC's own timers handle them.
        logger.debug("UDP error: %s", exc)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.stats.datagrams_in += 1
        if data and not data[0] & 0x80:  # short header: the hot path after the handshake
            connection = self._by_cid.get(data[1 : 1 + _CID_LENGTH])
            if connection is not None:
                connection.datagram_received(data, addr)
            return
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=_CID_LENGTH)
        except ValueError:
            self.stats.rejections["malformed_datagram"] += 1
            return
        connection = self._by_cid.get(header.destination_cid)
        if connection is not None:
            connection.datagram_received(data, addr)
            return
        if (
            header.packet_type != QuicPacketType.VERSION_NEGOTIATION
            and header.version is not None
            and header.version not in self._server_config.supported_versions
        ):
            self.sendto(
                encode_quic_version_negotiation(
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    supported_versions=self._server_config.supported_versions,
                ),
                addr,
            )
            return
        if header.packet_type != QuicPacketType.INITIAL or len(data) < SMALLEST_MAX_DATAGRAM_SIZE:
            return
        if self._closing or self._handshaking_inbound >= _MAX_HANDSHAKING:
            self.stats.rejections["handshake_overload"] += 1
            return
        self._accept(header.destination_cid, data, addr)

    def _accept(self, original_cid: bytes, data: bytes, addr: Address) -> None:
        quic = EngineConnection(
            configuration=self._server_config,
            original_destination_connection_id=original_cid,
            verifier=self._verifier,
            peer_role="client",
            expected_peer=None,
            max_concurrent_streams=self.config.max_concurrent_streams,
        )
        connection = PeerConnection(self, quic, is_client=False, peer=None)
        self._handshaking_inbound += 1
        self.register_cid(original_cid, connection)
        self.register_cid(quic.host_cid, connection)
        connection.start_handshake_deadline()
        connection.datagram_received(data, addr)

    # -- called by connections -----------------------------------------------------------

    def sendto(self, data: bytes, addr: Address) -> None:
        if self._udp is not None:
            self._udp.sendto(data, addr)

    def register_cid(self, cid: bytes, connection: PeerConnection) -> None:
        self._by_cid[cid] = connection
        self._cids.setdefault(connection, set()).add(cid)

    def unregister_cid(self, cid: bytes) -> None:
        connection = self._by_cid.pop(cid, None)
        if connection is not None:
            self._cids.get(connection, set()).discard(cid)

    def connection_established(self, connection: PeerConnection) -> None:
        assert connection.peer is not None
        if not connection.is_client:
            self._handshaking_inbound -= 1
            self._inbound.setdefault(connection.peer, set()).add(connection)
            self._learn_return_route(connection.peer, connection.remote_address)
            for peer, lane in self._paused:
                if peer == connection.peer:
                    connection.pause_reading(lane)
        self.handler.peer_connected(connection.peer, connection.is_client)

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
                inbound.discard(connection)
                if not inbound:
                    del self._inbound[peer]
        else:
            self._handshaking_inbound -= 1
        if connection.established_once:
            assert peer is not None
            self.handler.connection_lost(connection)
            self.handler.peer_disconnected(peer, connection.is_client)

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
    def closed(self) -> bool:
        return self._closing and self._udp_closed.done()
