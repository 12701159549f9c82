"""A hostile cluster member for tests: valid credentials, aioquic's own stack, no rules.

It holds a certificate from the victim's CA (so it passes mutual TLS), but runs plain
aioquic, not this project's transport, so a test can make it do what a well-behaved node
never does: leave request streams half-sent, reset them, send raw frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import HandshakeCompleted, QuicEvent

from velomux_quic.security.alerts import ALPN_PROTOCOL
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.security.tls import make_quic_configuration


class HostileServerProtocol(QuicConnectionProtocol):
    """One connection the victim dialed to the hostile server."""

    def __init__(
        self, quic: QuicConnection, *args: Any, deaf: Deafness | None = None, **kwargs: Any
    ) -> None:
        super().__init__(quic, *args, **kwargs)
        self.connection = quic  # aioquic's protocol keeps it as a private attribute
        self.handshake_done = asyncio.Event()
        self._deaf = deaf
        self._taken_at = 0.0
        self._pings: asyncio.TimerHandle | None = None
        self.ignored = 0
        """Datagrams from the victim dropped unread (never acknowledged)."""

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake_done.set()
            if self._deaf is not None:
                self._ping_soon()

    def datagram_received(self, data: bytes | bytearray, addr: Any) -> None:
        """Once deaf (its handshake done), take at most one datagram per ``trickle`` s
        (none when ``trickle`` is None): what it does not take it never acknowledges."""
        deaf = self._deaf
        if deaf is not None and self.handshake_done.is_set():
            now = asyncio.get_running_loop().time()
            if deaf.trickle is None or now - self._taken_at < deaf.trickle:
                self.ignored += 1
                return
            self._taken_at = now
        super().datagram_received(data, addr)

    def _ping_soon(self) -> None:
        """A PING a second: the victim hears from us, so the connection never idles out."""
        self._pings = asyncio.get_running_loop().call_later(1.0, self._ping)

    def _ping(self) -> None:
        self.connection.send_ping(0)
        self.transmit()
        self._ping_soon()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._pings is not None:
            self._pings.cancel()
        super().connection_lost(exc)

    def open_request(self, data: bytes, *, end_stream: bool = False) -> int:
        """Open a request stream toward the dialer (server-initiated bidirectional)."""
        stream_id = self.connection.get_next_available_stream_id(is_unidirectional=False)
        self.connection.send_stream_data(stream_id, data, end_stream=end_stream)
        self.transmit()
        return stream_id

    def reset(self, stream_id: int, code: int = 0x99) -> None:
        self.connection.reset_stream(stream_id, code)
        self.transmit()


@dataclass(frozen=True)
class Deafness:
    """How a hostile server treats the victim's datagrams once a handshake is done."""

    trickle: float | None = None
    """Take one datagram per this many seconds; None: take none, ever."""


class HostileServer:
    """The server side; :attr:`connections` lists what the victim dialed, in order."""

    def __init__(self, deaf: Deafness | None = None) -> None:
        self.connections: list[HostileServerProtocol] = []
        self.connected = asyncio.Event()
        self.address: tuple[str, int] = ("", 0)
        self.deaf = deaf

    def protocol(self, *args: Any, **kwargs: Any) -> HostileServerProtocol:
        protocol = HostileServerProtocol(*args, deaf=self.deaf, **kwargs)
        self.connections.append(protocol)
        self.connected.set()
        return protocol

    async def first_connection(self, timeout: float = 10.0) -> HostileServerProtocol:
        async with asyncio.timeout(timeout):
            await self.connected.wait()
            protocol = self.connections[0]
            await protocol.handshake_done.wait()
        return protocol


class HostileClientProtocol(QuicConnectionProtocol):
    """A connection the hostile peer dialed to the victim: it writes raw stream bytes."""

    def __init__(self, quic: QuicConnection, *args: Any, **kwargs: Any) -> None:
        super().__init__(quic, *args, **kwargs)
        self.connection = quic  # aioquic's protocol keeps it as a private attribute

    def quic_event_received(self, event: QuicEvent) -> None:
        """Whatever the victim says is ignored."""

    def write(self, stream_id: int, data: bytes, *, end_stream: bool = False) -> None:
        """Raw bytes on a stream of ours (lane k is stream 4k + 2; the per-stream path's
        streams start at 66), no framing but what the test wrote."""
        self.connection.send_stream_data(stream_id, data, end_stream=end_stream)
        self.transmit()

    def write_many(self, writes: list[tuple[int, bytes]]) -> None:
        """Raw bytes on many streams, sent together.

        One transmit for all of them, not one per stream: aioquic builds every transmit
        by walking all of its streams, so thousands of writes of one transmit each keep
        this (the test's) loop busy for seconds while the victim's acknowledgements wait
        unread. The client then takes that wait for its round-trip time: its loss timers
        and its close (three probe timeouts) grow with it, a lost packet is resent only
        after the victim's opening deadline, and the close can outlast the test."""
        for stream_id, data in writes:
            self.connection.send_stream_data(stream_id, data)
        self.transmit()


@asynccontextmanager
async def hostile_client(
    credentials: NodeCredentials, address: tuple[str, int]
) -> AsyncIterator[HostileClientProtocol]:
    """Dial the victim as ``credentials``' node with aioquic and no project code."""
    configuration = make_quic_configuration(
        credentials,
        is_client=True,
        max_datagram_size=1452,
        idle_timeout=30.0,
        max_stream_data=1 << 20,
        max_data=16 << 20,
    )
    async with connect(
        *address, configuration=configuration, create_protocol=HostileClientProtocol
    ) as protocol:
        assert isinstance(protocol, HostileClientProtocol)
        yield protocol


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def hostile_server(
    credentials: NodeCredentials,
    *,
    max_stream_data: int = 1 << 20,
    max_data: int = 16 << 20,
    deaf: Deafness | None = None,
) -> AsyncIterator[HostileServer]:
    """Listen on loopback as ``credentials``' node, with aioquic and no project code,
    granting the victim's streams ``max_stream_data`` and its connection ``max_data``."""
    configuration = make_quic_configuration(
        credentials,
        is_client=False,
        max_datagram_size=1452,
        # A deaf server takes no datagram, so nothing renews its own idle timer: it would
        # drop the connection (and stop the PINGs that keep the victim's alive) at 30 s.
        idle_timeout=30.0 if deaf is None else 600.0,
        max_stream_data=max_stream_data,
        max_data=max_data,
    )
    server = HostileServer(deaf)
    server.address = ("127.0.0.1", _free_udp_port())
    quic_server = await serve(
        *server.address, configuration=configuration, create_protocol=server.protocol
    )
    try:
        yield server
    finally:
        quic_server.close()


def real_initials(count: int) -> list[bytes]:
    """``count`` genuine client Initial packets (each a new connection), from aioquic's
    client: what a flood of dials that never continue sends."""
    initials = []
    for _ in range(count):
        client = QuicConnection(
            configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN_PROTOCOL])
        )
        client.connect(("127.0.0.1", 9), now=0.0)
        initials.append(client.datagrams_to_send(now=0.0)[0][0])
    return initials


class InitialFlood:
    """Sends Initials from one source address, over and over, until stopped."""

    def __init__(self, initials: list[bytes], source: str, target: tuple[str, int]) -> None:
        self.sent = 0
        self._initials = initials
        self._target = target
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((source, 0))
        self._socket.setblocking(False)
        self._stop = asyncio.Event()

    async def run(self, per_tick: int = 20, tick: float = 0.02) -> None:
        """About ``per_tick / tick`` Initials a second (1,000/s, 1.2 MB/s, by default)."""
        try:
            while not self._stop.is_set():
                for _ in range(per_tick):
                    packet = self._initials[self.sent % len(self._initials)]
                    with contextlib.suppress(BlockingIOError):
                        self._socket.sendto(packet, self._target)
                    self.sent += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), tick)  # pacing, not a sync
        finally:
            self._socket.close()

    async def run_once(self) -> None:
        """Each Initial of the pool once, then close the socket (the senders go silent)."""
        try:
            for packet in self._initials:
                self._socket.sendto(packet, self._target)
                self.sent += 1
        finally:
            self._socket.close()

    def stop(self) -> None:
        self._stop.set()
