"""Backpressure on the per-stream QUIC path (``quic-stream-v1``), over real nodes.

A per-stream ``send`` waits while its stream holds ``per_stream_send_buffer`` bytes QUIC has
not transmitted, or while the connection's per-stream streams together hold
``streams_send_buffer`` bytes ready to go; it resumes when aioquic transmits or the
consumer's window opens, and a close releases it with ``ChannelClosed``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.conftest import StartNode, needs_stream_backpressure
from tests.polling import poll_until
from velomux_quic.errors import ChannelClosed
from velomux_quic.errors import ChannelClosed as TransportChannelClosed
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.control import PER_STREAM_KEY
from velomux_quic.streaming.frames import HEARTBEAT
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.streaming.sender import Retired, StreamSender
from velomux_quic.transport import (
    ADMITTED,
    ConnectionSnapshot,
    PeerLink,
    PerStreamOutbound,
    QuicEndpoint,
    SendAdmission,
    StreamData,
    TransportConfig,
    TransportHandler,
)

RECORD = bytes(1000)
"""A record about a kilobyte on the wire: a few fill a 4 KiB window."""

SMALL_STREAMING = StreamingConfig(per_stream_window=4096, per_stream_send_buffer=2048)
SMALL_TRANSPORT = TransportConfig(stream_window=4096, streams_send_buffer=2048)
"""A consumer window of four records, two more unsent on the producer, and a connection
bound no larger than one stream's: if a stuck stream's bytes counted against the
connection, every other stream would stall behind it."""


async def per_stream_pair(start_nodes: StartNode, **options: object) -> tuple[Node, Node]:
    """(producer a, consumer b) that can only negotiate the per-stream path."""
    options.setdefault("mux", MuxConfig(enabled=False))
    b = await start_nodes("b", **options)
    a = await start_nodes("a", **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


async def collect(anchor: StreamAnchor[Any], timeout: float = 20) -> list[object]:
    async with asyncio.timeout(timeout):
        return [item async for item in anchor]


def producer_connection(a: Node, b: Node) -> ConnectionSnapshot:
    """The producer's connection to the consumer, as its transport sees it now."""
    connection = a.messenger.transport.snapshot().to(b.instance_id)
    assert connection is not None
    return connection


def held_by_the_window(connection: ConnectionSnapshot) -> bool:
    return connection.held_by_peer_window == 1 and connection.send_backlog == 0


class Pump:
    """Sends ``total`` records on one sender, one at a time, then finalizes."""

    def __init__(self, sender: StreamSender, total: int) -> None:
        self.sender = sender
        self.total = total
        self.sent = 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        for n in range(self.total):
            await self.sender.send([n, RECORD])
            self.sent = n + 1
        await self.sender.finalize()


async def stuck_stream(a: Node, b: Node, total: int) -> tuple[StreamAnchor[Any], Pump]:
    """A pump whose consumer never reads, proven stuck: another stream's records all
    arrive meanwhile (QUIC had every chance to move the stuck one's)."""
    stalled, flowing = b.create_anchor(), b.create_anchor()
    stuck = await a.attach_anchor(stalled.handle)
    assert stuck.negotiated_transport() == PER_STREAM_KEY
    pump = Pump(stuck, total)
    free = await a.attach_anchor(flowing.handle)
    for n in range(200):
        await free.send(n)
    free.finalize()
    assert await collect(flowing) == list(range(200))
    # Held by the consumer's window: nothing the connection transmits can release it,
    # and everything inside that window has been transmitted.
    await poll_until(lambda: held_by_the_window(producer_connection(a, b)), timeout=20)
    assert not pump.task.done()
    # The consumer's window (4 records) and the producer's own bound (2 more) at most.
    assert 3 <= pump.sent <= 8, pump.sent
    return stalled, pump


@needs_stream_backpressure
async def test_a_sender_whose_consumer_stopped_waits_while_its_neighbours_flow(
    start_nodes: StartNode,
) -> None:
    a, b = await per_stream_pair(start_nodes, streaming=SMALL_STREAMING, transport=SMALL_TRANSPORT)
    stalled, pump = await stuck_stream(a, b, total=40)
    held = producer_connection(a, b)
    assert held.blocked_streams == 1 and held.send_backlog == 0  # it holds up nobody else
    assert a.anchors.metrics.producer_send_backpressure >= 1
    assert "velo_streaming_producer_send_backpressure_total" in a.metrics_text()

    # Still waiting, while a new stream on the same connection flows end to end.
    other = b.create_anchor()
    sender = await a.attach_anchor(other.handle)
    for n in range(300):
        await sender.send(n)
    sender.finalize()
    assert await collect(other) == list(range(300))
    assert not pump.task.done()

    # Reading again releases the producer: every record, once, in order.
    records = await collect(stalled)
    assert records == [[n, RECORD] for n in range(40)]
    async with asyncio.timeout(20):
        await pump.task
    assert await pump.sender.retired() is Retired.SENT


async def test_a_burst_over_hundreds_of_streams_arrives_exactly_once_in_order(
    start_nodes: StartNode,
) -> None:
    streaming = StreamingConfig(heartbeat_interval=1.0)  # the watchdog ends a stream after 3 s
    a, b = await per_stream_pair(start_nodes, streaming=streaming)
    streams, items = 512, 30
    pad = "x" * 40  # a token-sized record: ~55 bytes on the wire
    anchors = [b.create_anchor() for _ in range(streams)]
    senders = await asyncio.gather(*(a.attach_anchor(anchor.handle) for anchor in anchors))
    readers = [asyncio.ensure_future(collect(anchor, 60)) for anchor in anchors]
    async with asyncio.timeout(60):
        for item in range(items):  # unpaced: nothing yields unless a send has to wait
            for index, sender in enumerate(senders):
                await sender.send([index, item, pad])
        retired = await asyncio.gather(*(sender.finalize() for sender in senders))
        results = await asyncio.gather(*readers)
    assert all(outcome is Retired.SENT for outcome in retired)
    for index, result in enumerate(results):
        assert result == [[index, item, pad] for item in range(items)], index
    assert b.anchors.metrics.heartbeat_watchdog_firings == 0
    assert "velo_streaming_heartbeat_watchdog_firings_total 0.0" in b.metrics_text()
    # ~850 KB written without a yield: the connection's bound made the producer wait.
    assert a.anchors.metrics.producer_send_backpressure > 0
    connection = producer_connection(a, b)
    assert connection.send_backlog == 0 and connection.blocked_streams == 0
    assert connection.extra_streams == 0  # every stream finished and forgotten


@pytest.mark.timeout(60)
async def test_streams_finalized_just_before_the_producer_closes_arrive_whole(
    start_nodes: StartNode,
) -> None:
    """A producer that finalizes its streams and closes at once: the close waits (up to
    ``close_timeout``) until the consumer acknowledged what they hold, as it does for the
    mux's lanes, instead of cutting off what the engine had not sent yet. Together they
    hold more than the connection's send bound, so some of it is always still waiting to
    leave when the close comes; every stream fits its consumer window, which nobody reads
    until the producer is closed."""
    a, b = await per_stream_pair(start_nodes, transport=TransportConfig(close_timeout=30.0))
    anchors = [b.create_anchor() for _ in range(8)]
    senders = [await a.attach_anchor(anchor.handle) for anchor in anchors]
    assert {sender.negotiated_transport() for sender in senders} == {PER_STREAM_KEY}
    items = [bytes([number]) * 4000 for number in range(12)]
    retired = []
    for sender in senders:
        for item in items:
            await sender.send(item)
        retired.append(sender.finalize())
    await a.close()
    assert [await outcome for outcome in retired] == [Retired.SENT] * len(senders)
    async with asyncio.timeout(30):
        for anchor in anchors:
            assert [item async for item in anchor] == items


@needs_stream_backpressure
async def test_closing_the_producer_node_releases_a_waiting_sender_with_channel_closed(
    start_nodes: StartNode,
) -> None:
    a, b = await per_stream_pair(start_nodes, streaming=SMALL_STREAMING, transport=SMALL_TRANSPORT)
    _, pump = await stuck_stream(a, b, total=40)
    await a.close()
    async with asyncio.timeout(10):
        with pytest.raises(ChannelClosed):
            await pump.task
    assert pump.sender.is_cancelled


@needs_stream_backpressure
async def test_a_consumer_cancel_releases_a_waiting_sender_with_channel_closed(
    start_nodes: StartNode,
) -> None:
    a, b = await per_stream_pair(start_nodes, streaming=SMALL_STREAMING, transport=SMALL_TRANSPORT)
    stalled, pump = await stuck_stream(a, b, total=40)
    stalled.cancel()
    async with asyncio.timeout(10):
        with pytest.raises(ChannelClosed):
            await pump.task
    assert await pump.sender.retired() is Retired.DISCARDED


# -- the connection's shared bound, at the transport --------------------------------------


class Sink(TransportHandler):
    """Accepts every non-lane stream and keeps its bytes."""

    def __init__(self) -> None:
        self.data: dict[int, bytearray] = defaultdict(bytearray)

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        self.data[event.stream_id] += event.data
        return True


@pytest.fixture
async def transports(
    make_credentials: Callable[..., NodeCredentials],
) -> AsyncIterator[tuple[QuicEndpoint, QuicEndpoint]]:
    """(sender a with a 1,000-byte per-stream bound per connection, receiver b)."""
    b = await QuicEndpoint.start(make_credentials("b"), handler=Sink())
    a = await QuicEndpoint.start(
        make_credentials("a"),
        config=TransportConfig(streams_send_buffer=1000),
        handler=TransportHandler(),
    )
    try:
        a.register_peer(b.instance_id, b.address)
        await a.connect(b.instance_id)
        yield a, b
    finally:
        await a.close()
        await b.close()
    assert a.closed and b.closed


async def test_the_connection_bound_queues_streams_in_turn_and_a_close_refuses_them(
    transports: tuple[QuicEndpoint, QuicEndpoint],
) -> None:
    a, b = transports
    one, two, three = (a.open_stream(b.instance_id) for _ in range(3))
    assert all(isinstance(s, PerStreamOutbound) for s in (one, two, three))
    assert one.send(bytes(800)) is ADMITTED  # nothing queued: fits whatever its size
    second = two.send(bytes(800))  # 196 bytes of room left: waits for a transmit
    assert isinstance(second, SendAdmission) and not second.done()
    assert not three.gate.try_send(b"x")  # would fit, but would overtake the waiting one
    assert three.try_send(HEARTBEAT, shared=False)  # a heartbeat needs only its own room
    third = three.send(bytes(10))
    assert isinstance(third, SendAdmission)
    order: list[str] = []
    second.on_resolved(lambda _: order.append("second"))
    third.on_resolved(lambda _: order.append("third"))
    async with asyncio.timeout(10):
        await second
        await third
    assert order == ["second", "third"]

    # Queue more than the bound again, then lose the connection before anything is
    # transmitted: every waiter is refused, typed.
    outcomes = [stream.send(bytes(800)) for stream in (one, two, three)]
    waiting = [o for o in outcomes if isinstance(o, SendAdmission) and not o.done()]
    assert len(waiting) >= 2
    a.disconnect(b.instance_id)
    for outcome in waiting:
        with pytest.raises(TransportChannelClosed):
            await outcome
