"""The bare arm of ``perf/tokens.py``: the floor of the token workload on aioquic.

What any design on aioquic pays at least to carry the decode engine's tokens: a prototype
that only packs records into one QUIC stream per frontend, with none of the library's
streaming machinery (no anchors, no credit, no heartbeats, no per-stream state on the
wire). The mux is judged against it: it should stay within 10% of this floor.

Engine: per pass, for each stream in index order, ``msgpack.packb(stamped_token(...))``
(the same token and per-token clock stamp as every other arm) appended with a fixed
6-byte header (u32 stream index, u16 body length, a preallocated ``struct.Struct``) to
its frontend's ``bytearray``; at the end of the pass each frontend's bytes go to that
frontend's one unidirectional QUIC stream in one ``send_stream_data`` call, and the
connection transmits. The engine dials each frontend (one connection, one socket per
frontend), as the node arms' engine attaches to each frontend's anchors.

Memory is bounded as a real engine must at max rate: before a write, while more than
``UNACKED_LIMIT`` (1 MiB) of the stream is buffered and not yet acknowledged, the engine
waits on an ``asyncio.Event`` that the connection's protocol sets when an incoming
datagram's acknowledgements bring it back under the limit (aioquic has no public event
for acknowledged data, so the protocol reads the stream sender's buffer bounds after each
datagram). The end of the run is the stream's FIN; the engine's ``finish`` waits until
every stream's data and FIN are acknowledged, as the node arms' ``finalize`` waits for
their streams to retire.

Frontend: the stream's bytes are cut into records incrementally (a record may straddle
two ``StreamDataReceived`` events; the remainder is kept), each body decoded with
``msgpack.unpackb`` inside the QUIC event callback and appended to its stream's
:class:`Inbox`, a ``deque`` with one waiter future (no ``asyncio.Queue``). An inbox has
the surface the benchmark's readers use on a ``StreamAnchor`` (``async for``,
``take_ready()``, ``batches()``), so every consumer shape runs the same reader code and
the same ``StreamCheck`` on every arm. The inboxes end when the QUIC stream ends.

Transport settings are a velomux node's defaults: the same mutual TLS (the node's
certificates, both sides verified by the library's ``PeerVerifier`` inside the handshake,
as a node does), the datagram size a node on the arm's engine uses on loopback
(``loopback_datagram_size``, or the engine's own) or the one pinned with
``--datagram-size``, at most 16 KiB (raw aioquic's own limit, see
``RAW_AIOQUIC_LARGEST_DATAGRAM``), the node's UDP socket buffers
(``open_udp_socket``), the node's initial windows (a lane's 1 MiB for the stream, 16 MiB
for the connection; aioquic grows both as data arrives), on the same event loop (uvloop
where installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
from _harness import BenchFailure, CountingTransport, DatagramCount, stamped_token
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header

from velomux_quic.ids import InstanceId
from velomux_quic.security.alerts import Role
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.security.tls import install_peer_verification, make_quic_configuration
from velomux_quic.security.verify import PeerVerifier
from velomux_quic.transport import TransportConfig
from velomux_quic.transport.engine_choice import engine_features
from velomux_quic.transport.seam import EngineName
from velomux_quic.transport.udp import open_udp_socket

__all__ = ["RECORD", "TRANSPORT", "UNACKED_LIMIT", "BareEngine", "BareFrontend", "Inbox"]

RECORD = struct.Struct("!IH")
"""Every record's header: the stream's global index and the body's length."""

UNACKED_LIMIT = 1 << 20
"""Bytes of a frontend's stream the engine lets sit buffered and unacknowledged before its
next write waits: the order of what one mux lane queues beyond its window (1 MiB)."""

TRANSPORT = "aioquic-one-stream"
"""What the bare engine reports as its negotiated transport."""

ALPN = "velomux-bench-bare"
"""Not the nodes' ALPN: a node reached by mistake refuses the handshake."""

_HOST = "127.0.0.1"
_CLOSE_WAIT_S = 5.0
"""How long closing waits for aioquic's closing period, after the measured window."""

_NODE = TransportConfig()

RAW_AIOQUIC_LARGEST_DATAGRAM = 16_384
"""The largest datagram raw aioquic builds correctly: it writes a STREAM frame's length in
two bytes (at most 16,383), so a longer frame in a larger datagram reaches the peer cut
short. The library's aioquic engine writes the length whole (``EngineConnection``); this
arm is aioquic as shipped, so a larger pinned or loopback size is capped here."""


def chosen_datagram_size(pinned: int | None, engine: EngineName = "aioquic") -> int:
    """What a node on ``engine`` would use here: the pinned size, else its size for a peer
    on this host (the arm runs on loopback only). From the handshake on: the arm has no
    path to learn."""
    if pinned is not None:
        return pinned
    own = engine_features(engine).loopback_datagram_size
    return _NODE.loopback_size(own) or _NODE.base_datagram_size


def _configuration(
    credentials: NodeCredentials,
    *,
    is_client: bool,
    idle_timeout: float,
    datagram_size: int | None = None,
) -> QuicConfiguration:
    """A node's aioquic configuration (certificate, datagram size, windows), own ALPN.

    ``idle_timeout`` is the run's step timeout: a node keeps an idle connection alive with
    PINGs, this arm sends none, and a slow step of the benchmark between attaching and
    streaming (py-spy attaching) must not end the connection."""
    configuration = make_quic_configuration(
        credentials,
        is_client=is_client,
        max_datagram_size=min(chosen_datagram_size(datagram_size), RAW_AIOQUIC_LARGEST_DATAGRAM),
        idle_timeout=idle_timeout,
        max_stream_data=_NODE.lane_window,
        max_data=_NODE.connection_window,
    )
    configuration.alpn_protocols = [ALPN]
    return configuration


class VerifiedConnection(QuicConnection):
    """aioquic's connection with the nodes' peer verification installed in the handshake,
    as the node's own connection class does: mutual TLS, both chains checked."""

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

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        install_peer_verification(
            self.tls,
            self._bench_verifier,
            role=self._bench_peer_role,
            expected=self._bench_expected,
        )


class Counts:
    """One side's counters, read at the edges of the measured window like a node's."""

    def __init__(self) -> None:
        self.datagrams = DatagramCount()
        self.send_waits = 0
        self.writes = 0
        self.records = 0

    def snapshot(self) -> dict[str, float]:
        return {
            "datagrams_out": float(self.datagrams.out),
            "datagrams_in": float(self.datagrams.into),
            "send_waits": float(self.send_waits),
            "writes": float(self.writes),
            "records": float(self.records),
        }


# -- the engine --------------------------------------------------------------------------


class EnginePeer(QuicConnectionProtocol):
    """The engine's connection to one frontend, carrying every record on one stream.

    ``until(ready)`` waits for a condition on the stream's acknowledgements: the protocol
    tests it after every incoming datagram (where acknowledgements arrive) and sets the
    event when it holds; the connection's end sets it too, and the waiter raises."""

    def __init__(self, quic: QuicConnection, counts: Counts) -> None:
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

    def unacknowledged(self) -> int:
        """Bytes written on the stream and not yet acknowledged (still in aioquic's send
        buffer: it drops a prefix once the peer acknowledged it)."""
        stream = self.quic._streams.get(self.stream_id)
        if stream is None:  # not opened yet, or finished and discarded
            return 0
        sender = stream.sender
        return int(sender._buffer_stop) - int(sender._buffer_start)

    def under_limit(self) -> bool:
        return self.unacknowledged() <= UNACKED_LIMIT

    def sent_through(self) -> bool:
        """Every byte and the FIN acknowledged (aioquic then discards the stream)."""
        stream = self.quic._streams.get(self.stream_id)
        return stream is None or bool(stream.sender.is_finished)

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
    """One connection to one frontend, on a socket of its own, handshake completed."""
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


def route_streams(
    handoffs: Sequence[dict[str, Any]], streams: int
) -> tuple[list[bytearray], list[bytearray], list[int]]:
    """Each frontend's outbox, each stream's outbox (by global index), and how many streams
    each outbox carries; fails unless the frontends own every stream exactly once. Shared
    by every engine that packs records itself (this arm's and the ZeroMQ arm's)."""
    outboxes = [bytearray() for _ in handoffs]
    slots: list[bytearray | None] = [None] * streams
    for outbox, handoff in zip(outboxes, handoffs, strict=True):
        for index in handoff["indices"]:
            if not 0 <= index < streams or slots[index] is not None:
                raise BenchFailure(f"stream {index} is handed over twice or out of range")
            slots[index] = outbox
    targets = [slot for slot in slots if slot is not None]
    if len(targets) != streams:
        raise BenchFailure("the frontends handed over fewer streams than the run has")
    owned = [sum(target is outbox for target in targets) for outbox in outboxes]
    return outboxes, targets, owned


def pass_packer(
    targets: Sequence[bytearray], write_pass: Callable[[int], Awaitable[None]]
) -> Callable[[int], Awaitable[None]]:
    """One forward pass: every stream's token (the same body and clock stamp as every arm)
    packed with its record header into its frontend's bytes, in index order, then
    ``write_pass(pass_)``, which writes each frontend's bytes once."""
    pack = msgpack.packb
    header = RECORD.pack
    token = stamped_token
    clock = time.perf_counter_ns
    streams = len(targets)

    async def one_pass(pass_: int) -> None:
        base = pass_ * streams
        for index, out in enumerate(targets):
            body = pack(token(base + index, clock()))
            out += header(index, len(body))
            out += body
        await write_pass(pass_)

    return one_pass


class BareEngine:
    """The engine's end: one connection per frontend, one ``bytearray`` per frontend per
    pass, one write per frontend per pass."""

    def __init__(
        self,
        links: list[tuple[asyncio.DatagramTransport, EnginePeer]],
        outboxes: list[bytearray],
        targets: list[bytearray],
        owned: list[int],
        counts: Counts,
    ) -> None:
        self._links = links
        self._counts = counts
        self._targets = targets
        self._writes = [
            (peer, outbox, records)
            for (_, peer), outbox, records in zip(links, outboxes, owned, strict=True)
        ]

    @classmethod
    async def connect(
        cls,
        credentials: Path,
        handoffs: Sequence[dict[str, Any]],
        streams: int,
        timeout: float,
        datagram_size: int | None = None,
    ) -> BareEngine:
        """Dial every frontend named in ``handoffs`` (its identity, address and the global
        indices of its streams); fails unless they own every stream exactly once."""
        node = NodeCredentials.load(credentials)
        verifier = PeerVerifier(node.trust_roots, node.trust_domain)
        configuration = _configuration(
            node, is_client=True, idle_timeout=timeout, datagram_size=datagram_size
        )
        counts = Counts()
        outboxes, targets, owned = route_streams(handoffs, streams)
        links: list[tuple[asyncio.DatagramTransport, EnginePeer]] = []
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

    def counts(self) -> dict[str, float]:
        return self._counts.snapshot()

    def pass_body(self) -> Callable[[int], Awaitable[None]]:
        """One forward pass, packed by :func:`pass_packer`: one write per frontend."""
        return pass_packer(self._targets, self._write_pass)

    async def _write_pass(self, pass_: int) -> None:
        counts = self._counts
        for peer, outbox, records in self._writes:
            if not peer.under_limit():
                counts.send_waits += 1
                await peer.until(peer.under_limit)
            peer.write(bytes(outbox))
            outbox.clear()
            counts.writes += 1
            counts.records += records

    async def finish(self) -> None:
        """End every frontend's stream and wait until each is acknowledged to its FIN."""
        for _, peer in self._links:
            peer.write(b"", end=True)
        for _, peer in self._links:
            await peer.until(peer.sent_through)

    async def close(self) -> None:
        """Close every connection (waiting out aioquic's closing period, bounded) and
        every socket."""
        for _, peer in self._links:
            peer.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await asyncio.gather(*(peer.wait_closed() for _, peer in self._links))
        for transport, _ in self._links:
            transport.close()


# -- the frontend ------------------------------------------------------------------------


class Inbox:
    """One stream's tokens at the frontend: a deque and one waiter future.

    The feeder (the QUIC event callback) appends and resolves the waiter if a reader is
    parked on it; a reader pops while items remain and parks on a fresh future otherwise.
    ``async for`` gives one item per step; ``take_ready()`` and ``batches()`` give every
    item buffered per wake-up, as ``StreamAnchor``'s do. A clean end is seen after the
    last item; a failure is raised at once."""

    __slots__ = ("_ended", "_failure", "_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._failure: BenchFailure | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def end(self, failure: BenchFailure | None = None) -> None:
        self._ended = True
        self._failure = failure
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _failed(self) -> BenchFailure:
        """This inbox's own copy of the failure that ended every inbox (so the note its
        reader adds is not added to every other stream's)."""
        assert self._failure is not None
        failure = BenchFailure(*self._failure.args)
        failure.__cause__ = self._failure.__cause__
        return failure

    async def _wait(self) -> None:
        """Park until the feeder puts an item or ends the inbox (raises at the end)."""
        if self._failure is not None:
            raise self._failed()
        if self._ended:
            raise StopAsyncIteration
        waiter = self._loop.create_future()
        self._waiter = waiter
        await waiter

    def __aiter__(self) -> Inbox:
        return self

    async def __anext__(self) -> Any:
        items = self._items
        while not items:
            await self._wait()
        if self._failure is not None:
            raise self._failed()
        return items.popleft()

    async def take_ready(self) -> list[Any]:
        """Every item buffered (at least one: waits for the first); StopAsyncIteration
        once the stream ended and nothing is left."""
        items = self._items
        while not items:
            await self._wait()
        if self._failure is not None:
            raise self._failed()
        taken = list(items)
        items.clear()
        return taken

    async def batches(self) -> AsyncIterator[list[Any]]:
        """``async for items in inbox.batches()``: ``take_ready()`` until the end."""
        while True:
            try:
                items = await self.take_ready()
            except StopAsyncIteration:
                return
            yield items


class RecordParser:
    """Cuts one QUIC stream's bytes into records and feeds each decoded body to its
    stream's inbox; a record cut by an event boundary waits for the rest."""

    __slots__ = ("_inboxes", "_rest")

    def __init__(self, inboxes: Sequence[Inbox | None]) -> None:
        self._inboxes = inboxes
        self._rest = b""

    def feed(self, data: bytes) -> None:
        if self._rest:
            data = self._rest + data
        unpack_header = RECORD.unpack_from
        head = RECORD.size
        unpack = msgpack.unpackb
        inboxes = self._inboxes
        size = len(data)
        position = 0
        while position + head <= size:
            index, length = unpack_header(data, position)
            start = position + head
            stop = start + length
            if stop > size:
                break
            inbox = inboxes[index] if index < len(inboxes) else None
            if inbox is None:
                raise BenchFailure(f"a record for stream {index}, which is not this frontend's")
            inbox.put(unpack(data[start:stop]))
            position = stop
        self._rest = data[position:]

    @property
    def pending(self) -> int:
        """Bytes of a record not complete yet."""
        return len(self._rest)


class FrontendPeer(QuicConnectionProtocol):
    """A frontend's end of the engine's connection: every record of its one stream goes
    to its inbox; the stream's end ends every inbox, anything else fails them."""

    def __init__(self, quic: QuicConnection, counts: Counts, frontend: BareFrontend) -> None:
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
                self.close(reason_phrase=str(exc)[:100])
        elif isinstance(event, events.ConnectionTerminated):
            frontend.end(
                BenchFailure(
                    f"the engine's connection ended before its stream: error "
                    f"{event.error_code}, {event.reason_phrase!r}"
                )
            )


class BareFrontend(asyncio.DatagramProtocol):
    """A frontend's socket: accepts the engine's one connection (created on its first
    datagram, as a server does) and owns the inbox of each of its streams."""

    def __init__(
        self,
        configuration: QuicConfiguration,
        verifier: PeerVerifier,
        indices: Sequence[int],
        streams: int,
    ) -> None:
        self.configuration = configuration
        self.verifier = verifier
        self._counts = Counts()
        loop = asyncio.get_running_loop()
        self.inboxes = [Inbox(loop) for _ in indices]
        self.by_index: list[Inbox | None] = [None] * streams
        for index, inbox in zip(indices, self.inboxes, strict=True):
            self.by_index[index] = inbox
        self.ended = False
        self.peer: FrontendPeer | None = None
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def listen(
        cls,
        credentials: NodeCredentials,
        indices: Sequence[int],
        streams: int,
        timeout: float,
        datagram_size: int | None = None,
    ) -> BareFrontend:
        """Bind a node-sized socket on loopback and wait for the engine."""
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
                lambda: cls(configuration, verifier, indices, streams), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        return frontend

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return str(host), int(port)

    def counts(self) -> dict[str, float]:
        return self._counts.snapshot()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._counts.datagrams.into += 1
        if self.peer is None:
            try:
                header = pull_quic_header(
                    Buffer(data=data), host_cid_length=self.configuration.connection_id_length
                )
            except ValueError:
                return  # not QUIC: ignored, as a node does
            quic = VerifiedConnection(
                configuration=self.configuration,
                verifier=self.verifier,
                peer_role="client",
                original_destination_connection_id=header.destination_cid,
            )
            self.peer = FrontendPeer(quic, self._counts, self)
            assert self.transport is not None
            self.peer.connection_made(self.transport)
        self.peer.datagram_received(data, addr)

    def end(self, failure: BenchFailure | None = None) -> None:
        """The stream ended (cleanly, or with ``failure``): end every inbox."""
        if self.ended:
            return
        self.ended = True
        for inbox in self.inboxes:
            inbox.end(failure)

    async def close(self) -> None:
        """Close the connection (its closing period bounded) and the socket."""
        self.end(BenchFailure("the frontend closed"))
        peer = self.peer
        if peer is not None:
            peer.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await peer.wait_closed()
        if self.transport is not None:
            self.transport.close()
