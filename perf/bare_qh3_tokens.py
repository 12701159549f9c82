"""The bare arm of ``perf/tokens.py`` on qh3: the floor of the token workload on qh3's engine.

The twin of ``perf/bare_tokens.py`` (read its docstring for the workload): the same
records, the same pass packer, the same inboxes and record parser, the same node
certificates with mutual TLS checked by the library's ``PeerVerifier`` inside the handshake
(qh3's TLS context made verifying, and asking for the client's certificate, by the
library's ``install_qh3_peer_verification``), the same datagram size and windows; only the
QUIC connection and its asyncio protocol are qh3's (``qh3.asyncio.QuicConnectionProtocol``).

Memory is bounded as in the aioquic arm: a write waits while more than ``UNACKED_LIMIT``
bytes of its stream may be unacknowledged. qh3 keeps no per-stream acknowledged offset,
so "may be unacknowledged" is the stream's bytes not yet transmitted plus the connection's
bytes in flight (the stream is the connection's only one); its end waits until the core
has nothing of it left to send and nothing in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _harness import BenchFailure, CountingTransport
from bare_tokens import (
    _HOST,
    _NODE,
    ALPN,
    UNACKED_LIMIT,
    BareEngine,
    BareFrontend,
    Counts,
    RecordParser,
    chosen_datagram_size,
    route_streams,
)
from qh3._hazmat import pull_quic_header
from qh3.asyncio.protocol import QuicConnectionProtocol
from qh3.quic import events
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection
from qh3.quic.tls_bridge import QuicTlsBridge

from velomux_quic.ids import InstanceId
from velomux_quic.security.alerts import Role
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.security.qh3_tls import install_qh3_peer_verification, make_qh3_configuration
from velomux_quic.security.verify import PeerVerifier
from velomux_quic.transport.udp import open_udp_socket

__all__ = ["TRANSPORT", "Qh3BareEngine", "Qh3BareFrontend"]

TRANSPORT = "qh3-one-stream"
"""What the bare qh3 engine reports as its negotiated transport."""


def _configuration(
    credentials: NodeCredentials,
    *,
    is_client: bool,
    idle_timeout: float,
    datagram_size: int | None = None,
) -> QuicConfiguration:
    """A node's qh3 configuration (certificate, datagram size, windows), own ALPN."""
    configuration = make_qh3_configuration(
        credentials,
        is_client=is_client,
        max_datagram_size=chosen_datagram_size(datagram_size, "qh3"),
        idle_timeout=idle_timeout,
        max_stream_data=_NODE.lane_window,
        max_data=_NODE.connection_window,
    )
    configuration.alpn_protocols = [ALPN]
    return configuration


class VerifiedConnection(QuicConnection):
    """qh3's connection with the nodes' peer verification installed in the handshake."""

    def __init__(
        self,
        *,
        configuration: QuicConfiguration,
        verifier: PeerVerifier,
        peer_role: Role,
        expected: InstanceId | None = None,
        original_destination_connection_id: bytes | None = None,
    ) -> None:
        super().__init__(
            configuration=configuration,
            original_destination_connection_id=original_destination_connection_id,
        )
        self._bench_verifier = verifier
        self._bench_peer_role: Role = peer_role
        self._bench_expected = expected

    def _create_tls(self, remote_source_cid: bytes | None) -> QuicTlsBridge:
        bridge = super()._create_tls(remote_source_cid)
        install_qh3_peer_verification(
            bridge.tls,
            self._bench_verifier,
            role=self._bench_peer_role,
            expected=self._bench_expected,
        )
        return bridge


class EnginePeer(QuicConnectionProtocol):
    """The engine's connection to one frontend (see the aioquic twin's ``EnginePeer``)."""

    def __init__(self, quic: VerifiedConnection, counts: Counts) -> None:
        super().__init__(quic)
        self.quic = quic
        self.counts = counts
        self.stream_id = quic.get_next_available_stream_id(is_unidirectional=True)
        self.failure: str | None = None
        self._wake = asyncio.Event()
        self._ready: Callable[[], bool] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        counting = CountingTransport(transport, self.counts.datagrams)  # type: ignore[arg-type]
        super().connection_made(counting)  # type: ignore[arg-type]

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.counts.datagrams.into += 1
        super().datagram_received(data, addr)
        ready = self._ready
        if ready is not None and ready():
            self._ready = None
            self._wake.set()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.ConnectionTerminated) and self.failure is None:
            self.failure = (
                f"the connection to the frontend ended: error {event.error_code}, "
                f"{event.reason_phrase!r}"
            )
            self._ready = None
            self._wake.set()

    def _in_flight(self) -> int:
        core = self.quic._core
        return 0 if core is None else int(core.bytes_in_flight)

    def unacknowledged(self) -> int:
        return int(self.quic.get_send_buffer_size(self.stream_id)) + self._in_flight()

    def under_limit(self) -> bool:
        return self.unacknowledged() <= UNACKED_LIMIT

    def sent_through(self) -> bool:
        return self.unacknowledged() == 0

    async def until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.failure is not None:
                raise BenchFailure(self.failure)
            self._ready = ready
            self._wake.clear()
            await self._wake.wait()
        if self.failure is not None:
            raise BenchFailure(self.failure)

    def write(self, data: bytes, *, end: bool = False) -> None:
        if self.failure is not None:
            raise BenchFailure(self.failure)
        self.quic.send_stream_data(self.stream_id, data, end_stream=end)
        self.transmit()


async def _dial(
    configuration: QuicConfiguration,
    verifier: PeerVerifier,
    expected: InstanceId,
    address: tuple[str, int],
    counts: Counts,
) -> tuple[asyncio.DatagramTransport, EnginePeer]:
    quic = VerifiedConnection(
        configuration=configuration, verifier=verifier, peer_role="server", expected=expected
    )
    sock, _ = open_udp_socket(
        _HOST, 0, receive_buffer=_NODE.udp_receive_buffer, send_buffer=_NODE.udp_send_buffer
    )
    loop = asyncio.get_running_loop()
    try:
        transport, peer = await loop.create_datagram_endpoint(
            lambda: EnginePeer(quic, counts), sock=sock
        )
    except BaseException:
        sock.close()
        raise
    try:
        peer.connect(address)
        await peer.wait_connected()
    except ConnectionError:
        transport.close()
        raise BenchFailure(f"the handshake with the frontend at {address} failed") from None
    except BaseException:
        transport.close()
        raise
    return transport, peer


class Qh3BareEngine(BareEngine):
    """The aioquic twin's engine (one connection and one write per frontend per pass),
    dialing with qh3."""

    @classmethod
    async def connect(
        cls,
        credentials: Path,
        handoffs: Sequence[dict[str, Any]],
        streams: int,
        timeout: float,
        datagram_size: int | None = None,
    ) -> BareEngine:
        node = NodeCredentials.load(credentials)
        verifier = PeerVerifier(node.trust_roots, node.trust_domain)
        configuration = _configuration(
            node, is_client=True, idle_timeout=timeout, datagram_size=datagram_size
        )
        counts = Counts()
        outboxes, targets, owned = route_streams(handoffs, streams)
        links: list[tuple[asyncio.DatagramTransport, Any]] = []
        try:
            async with asyncio.timeout(timeout):
                for handoff in handoffs:
                    host, port = handoff["address"]
                    expected = InstanceId.parse(handoff["instance_id"])
                    links.append(
                        await _dial(configuration, verifier, expected, (host, int(port)), counts)
                    )
        except TimeoutError:
            for transport, _ in links:
                transport.close()
            raise BenchFailure(
                f"{len(links)} of {len(handoffs)} frontends connected within {timeout:g} s"
            ) from None
        except BaseException:
            for transport, _ in links:
                transport.close()
            raise
        return cls(links, outboxes, targets, owned, counts)


class FrontendPeer(QuicConnectionProtocol):
    """A frontend's end on qh3 (see the aioquic twin's ``FrontendPeer``)."""

    def __init__(self, quic: VerifiedConnection, counts: Counts, frontend: BareFrontend) -> None:
        super().__init__(quic)
        self.counts = counts
        self.frontend = frontend
        self.parser = RecordParser(frontend.by_index)
        self.stream_id: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        counting = CountingTransport(transport, self.counts.datagrams)  # type: ignore[arg-type]
        super().connection_made(counting)  # type: ignore[arg-type]

    def quic_event_received(self, event: events.QuicEvent) -> None:
        frontend = self.frontend
        if frontend.ended:
            return
        if isinstance(event, events.StreamDataReceived):
            try:
                if self.stream_id is None:
                    self.stream_id = event.stream_id
                elif event.stream_id != self.stream_id:
                    raise BenchFailure(f"data on a second QUIC stream ({event.stream_id})")
                self.parser.feed(event.data)
                if event.end_stream:
                    if self.parser.pending:
                        raise BenchFailure("the stream ended inside a record")
                    frontend.end()
            except BenchFailure as exc:
                frontend.end(exc)
                self.close()
        elif isinstance(event, events.ConnectionTerminated):
            frontend.end(
                BenchFailure(
                    f"the engine's connection ended before its stream: error "
                    f"{event.error_code}, {event.reason_phrase!r}"
                )
            )


class Qh3BareFrontend(BareFrontend):
    """The aioquic twin's frontend socket, accepting the engine's connection with qh3."""

    @classmethod
    async def listen(
        cls,
        credentials: NodeCredentials,
        indices: Sequence[int],
        streams: int,
        timeout: float,
        datagram_size: int | None = None,
    ) -> BareFrontend:
        configuration = _configuration(
            credentials, is_client=False, idle_timeout=timeout, datagram_size=datagram_size
        )
        verifier = PeerVerifier(credentials.trust_roots, credentials.trust_domain)
        sock, _ = open_udp_socket(
            _HOST, 0, receive_buffer=_NODE.udp_receive_buffer, send_buffer=_NODE.udp_send_buffer
        )
        loop = asyncio.get_running_loop()
        try:
            _, frontend = await loop.create_datagram_endpoint(
                lambda: cls(configuration, verifier, indices, streams),  # type: ignore[arg-type]
                sock=sock,
            )
        except BaseException:
            sock.close()
            raise
        return frontend

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._counts.datagrams.into += 1
        if self.peer is None:
            try:
                header = pull_quic_header(data, 0, self.configuration.connection_id_length)
            except ValueError:
                return
            quic = VerifiedConnection(
                configuration=self.configuration,  # type: ignore[arg-type]
                verifier=self.verifier,
                peer_role="client",
                original_destination_connection_id=header[3],
            )
            self.peer = FrontendPeer(quic, self._counts, self)  # type: ignore[assignment]
            assert self.transport is not None
            self.peer.connection_made(self.transport)  # type: ignore[union-attr]
        self.peer.datagram_received(data, addr)  # type: ignore[union-attr]
