"""Two PeerConnections on real engines that exchange datagrams in memory, on a fake clock.

No socket and no event loop: each connection is given a :class:`ConnectionClock` that
reads :class:`Wire`'s time, records the one deadline the connection asks to be woken at
and queues its call-soons; :meth:`Wire.run_until` delivers datagrams, runs the queued
calls and wakes each connection at its deadline, advancing time from deadline to
deadline. The endpoint's part (routing, the handler, the stats) is a small stand-in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from velomux_quic.ids import InstanceId
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.security.verify import PeerVerifier
from velomux_quic.transport.admission import PeerLedger
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.connection import PeerConnection
from velomux_quic.transport.engine_choice import make_engine_factory
from velomux_quic.transport.events import PeerLink, StreamData
from velomux_quic.transport.handler import TransportHandler
from velomux_quic.transport.metrics import TransportStats
from velomux_quic.transport.packets import parse_long_header
from velomux_quic.transport.resets import StatelessResets

CLIENT = ("127.0.0.1", 1111)
SERVER = ("127.0.0.1", 2222)


class Wire:
    """The fake clock and the in-memory path between the two connections."""

    def __init__(self) -> None:
        self.now = 100.0
        self.up = True
        """False: every datagram is lost."""
        self.max_size = 65535
        """Datagrams larger than this are lost (the path's MTU)."""
        self.in_flight: list[tuple[Endpoint, bytes, tuple[str, int]]] = []
        self.soon: list[Call] = []
        self.endpoints: list[Endpoint] = []

    def run_until(self, until: float) -> None:
        """Deliver, call and wake whatever is due up to ``until``, then stop there."""
        for _ in range(1_000_000):
            if self.soon or self.in_flight:
                calls, self.soon = self.soon, []
                for call in calls:
                    call()
                datagrams, self.in_flight = self.in_flight, []
                for endpoint, data, source in datagrams:
                    endpoint.receive(data, source)
                continue
            wakes = [
                e.clock.when
                for e in self.endpoints
                if e.connection is not None and e.clock.when is not None
            ]
            next_at = min(wakes, default=None)
            if next_at is None or next_at > until:
                self.now = until
                return
            self.now = max(self.now, next_at)
            for endpoint in self.endpoints:
                when = endpoint.clock.when
                if endpoint.connection is not None and when is not None and when <= self.now:
                    endpoint.clock.when = None
                    endpoint.connection.on_timer(self.now)
        raise AssertionError("the connections never went quiet")

    def settle(self, seconds: float = 0.5) -> None:
        self.run_until(self.now + seconds)


class Call:
    """A queued call-soon, cancellable like ``asyncio.Handle``."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None

    def __call__(self) -> None:
        if self.callback is not None:
            self.callback()


class FakeClock:
    """A connection's :class:`~velomux_quic.transport.deadlines.ConnectionClock` on a Wire."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.when: float | None = None

    def time(self) -> float:
        return self.wire.now

    def wake_at(self, when: float | None) -> None:
        self.when = when

    def soon(self, callback: Callable[[], None]) -> Call:
        call = Call(callback)
        self.wire.soon.append(call)
        return call


class OpeningsHandler(TransportHandler):
    """Claims every stream that is not a lane, as the per-stream path does."""

    def __init__(self) -> None:
        self.resets: list[int] = []

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        return True

    def stream_reset(self, link: PeerLink, event: object) -> None:
        self.resets.append(getattr(event, "stream_id", -1))


@dataclass
class Endpoint:
    """The stand-in for the node's endpoint: what a connection asks of its owner."""

    wire: Wire
    config: TransportConfig
    address: tuple[str, int]
    peer_address: tuple[str, int]
    credentials: NodeCredentials
    make: Callable[[bytes], PeerConnection] | None = None
    handler: TransportHandler = field(default_factory=OpeningsHandler)
    stats: TransportStats = field(default_factory=TransportStats)
    connection: PeerConnection | None = None
    established: int = 0
    closed: int = 0
    clock: FakeClock = field(init=False)
    peer_ledger: PeerLedger = field(init=False)
    other: Endpoint | None = None

    def __post_init__(self) -> None:
        self.clock = FakeClock(self.wire)
        self.peer_ledger = PeerLedger(
            self.config.max_unacked_bytes_per_peer,
            self.config.peer_turn_bytes,
            self.clock.soon,
            self.clock.time,
        )
        self.wire.endpoints.append(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        raise AssertionError("a connection on a fake clock asked for the event loop")

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.other is not None
        if self.wire.up and len(data) <= self.wire.max_size:
            self.wire.in_flight.append((self.other, data, self.address))

    def send_datagrams(self, datagrams: list[tuple[bytes, tuple[str, int]]]) -> None:
        for data, addr in datagrams:
            self.sendto(data, addr)

    def receive(self, data: bytes, source: tuple[str, int]) -> None:
        if self.connection is None:
            assert self.make is not None
            self.connection = self.make(parse_long_header(data).destination_cid)
        if self.connection.state.value != "closed":
            self.connection.datagram_received(data, source)

    def register_cid(self, cid: bytes, connection: PeerConnection) -> None:
        pass

    def unregister_cid(self, cid: bytes) -> None:
        pass

    def connection_established(self, connection: PeerConnection) -> None:
        self.established += 1

    def connection_closed(self, connection: PeerConnection) -> None:
        self.closed += 1

    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool:
        return False


@dataclass
class Pair:
    wire: Wire
    client: Endpoint
    server: Endpoint

    @property
    def dialer(self) -> PeerConnection:
        assert self.client.connection is not None
        return self.client.connection

    @property
    def acceptor(self) -> PeerConnection:
        assert self.server.connection is not None
        return self.server.connection


def connection_pair(
    make_credentials: Callable[..., NodeCredentials],
    config: TransportConfig,
    *,
    client_credentials: NodeCredentials | None = None,
    server_config: TransportConfig | None = None,
) -> Pair:
    """A dialer whose first Initial is queued; :meth:`Wire.run_until` runs the handshake.

    ``client_credentials``: the dialer's, when they are not the cluster's own (a client
    the server refuses); ``server_config``: the acceptor's, when it differs (another
    engine)."""
    client_creds = client_credentials or make_credentials("client")
    server_creds = make_credentials("server")
    wire = Wire()
    client = Endpoint(wire, config, CLIENT, SERVER, client_creds)
    server_config = server_config or config
    server = Endpoint(wire, server_config, SERVER, CLIENT, server_creds)
    client.other, server.other = server, client

    def factory(creds: NodeCredentials, settings: TransportConfig):  # type: ignore[no-untyped-def]
        verifier = PeerVerifier(creds.trust_roots, creds.trust_domain)
        return make_engine_factory(creds, settings, verifier, StatelessResets())

    server_engines = factory(server_creds, server_config)

    def accept(original_cid: bytes) -> PeerConnection:
        quic = server_engines.server(original_cid, None, SERVER[0], CLIENT[0])
        connection = PeerConnection(server, quic, is_client=False, peer=None, clock=server.clock)
        connection.start_handshake_deadline()
        return connection

    server.make = accept
    quic = factory(client_creds, config).client(server_creds.instance_id, CLIENT[0], SERVER[0])
    dialer = PeerConnection(
        client, quic, is_client=True, peer=server_creds.instance_id, clock=client.clock
    )
    client.connection = dialer
    quic.connect(SERVER, now=wire.now)
    dialer.start_handshake_deadline()
    dialer.transmit()
    return Pair(wire, client, server)
