"""Faults that once broke one engine and not the other, run on both (aioquic and qh3).

Real nodes on loopback, the second dialing the first through the impairment proxy, so the
proxy can cut the path (blackhole) for a given time. Each test names the engine of both
nodes; qh3 cases skip where the ``velomux_quic[qh3]`` extra is not installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.errors import TransportError
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.programs.demo.proxy import Impairment, ImpairmentProxy
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.config import StreamingConfig
from velomux_quic.streaming.control import PER_STREAM_KEY
from velomux_quic.streaming.sender import Retired, StreamSender
from velomux_quic.transport.config import TransportConfig


@pytest.fixture(params=["aioquic", "qh3"])
def engine(request: pytest.FixtureRequest) -> str:
    if request.param == "qh3":
        pytest.importorskip("qh3")
    return str(request.param)


@pytest.fixture
async def pair_through_proxy(
    start_nodes: StartNode, engine: str
) -> AsyncIterator[tuple[Node, Node, ImpairmentProxy]]:
    """``(dialer, accepter, proxy)``: the dialer knows the accepter only at the proxy."""
    transport = TransportConfig(engine=engine, max_datagram_size=1452)
    accepter = await start_nodes("accepter", transport=transport)
    async with ImpairmentProxy(accepter.address, Impairment()) as proxy:
        dialer = await start_nodes("dialer", transport=transport)
        dialer.add_peer(accepter.instance_id, proxy.address)
        yield dialer, accepter, proxy


async def cut_lasts(seconds: float) -> None:
    """The cut's duration is what the test is about: a wait for time itself."""
    await asyncio.sleep(seconds)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", [0.5, 1.5, 3.0])
async def test_a_health_check_whose_ping_is_lost_in_a_short_cut_is_answered_after_it(
    pair_through_proxy: tuple[Node, Node, ImpairmentProxy], engine: str, cut: float
) -> None:
    """The check's PING leaves into a cut path and is lost; once the path is back, the
    check is answered within its window: aioquic resends a lost PING, and the qh3 adapter
    queues it again when its core probes or detects the loss (qh3's core alone never
    answered such a check)."""
    dialer, accepter, proxy = pair_through_proxy
    transport = dialer.messenger.transport
    await transport.check_health(accepter.instance_id, timeout=10)  # connected, path known
    proxy.blackhole(True)
    check = asyncio.ensure_future(transport.check_health(accepter.instance_id, timeout=cut + 8))
    try:
        await cut_lasts(cut)
    finally:
        proxy.blackhole(False)
    restored = time.monotonic()
    await check  # answered, not TimeoutError
    answered_after = time.monotonic() - restored
    dropped = proxy.counters.client_to_server.dropped_blackhole
    assert dropped >= 1  # the PING really went into the cut
    print(f"\nping-in-cut {engine} cut={cut:.1f}s answered {answered_after:.2f}s after it")


STREAMS = 32
ITEM = bytes(2048)
"""Items of 2 KiB at 50 per second: a stalled reader's stream is a window (64 KiB) ahead of
it within a second."""


async def produce(sender: StreamSender, sent: list[int], index: int, stop: asyncio.Event) -> None:
    """50 items per second until ``stop``; ``sent[index]`` counts what ``send`` took."""
    while not stop.is_set():
        await sender.send([index, ITEM])
        sent[index] += 1
        await asyncio.sleep(0.02)  # the stream's own pace, not a wait for an event


async def read(
    anchor: StreamAnchor[Any], got: list[int], index: int, changed: asyncio.Event
) -> None:
    async for _ in anchor:
        got[index] += 1
        changed.set()


@pytest.mark.timeout(90)
async def test_with_the_mux_off_a_stalled_reader_holds_no_other_stream(
    start_nodes: StartNode, engine: str
) -> None:
    """32 per-stream streams between two nodes (the mux off); one reader stops reading.
    Its 31 neighbours go on at their pace: aioquic holds the stalled stream alone (its
    receive window); qh3, which cannot, holds the connection for at most a second, then
    keeps taking its data up to a bound (qh3 once froze all 32, and the watchdog then
    dropped them)."""
    options: dict[str, Any] = {
        "transport": TransportConfig(engine=engine),
        "mux": MuxConfig(enabled=False),
    }
    consumer = await start_nodes("consumer", **options)
    producer = await start_nodes("producer", **options)
    producer.add_peer(consumer.instance_id, consumer.address)
    anchors = [consumer.create_anchor() for _ in range(STREAMS)]
    senders = list(
        await asyncio.gather(*(producer.attach_anchor(anchor.handle) for anchor in anchors))
    )
    assert {sender.negotiated_transport() for sender in senders} == {PER_STREAM_KEY}
    stop = asyncio.Event()
    sent = [0] * STREAMS
    got = [0] * STREAMS
    changed = asyncio.Event()
    tasks = [
        asyncio.ensure_future(produce(sender, sent, index, stop))
        for index, sender in enumerate(senders)
    ]
    readers = [
        asyncio.ensure_future(read(anchor, got, index, changed))
        for index, anchor in enumerate(anchors)
        if index != 0  # stream 0's reader has stalled
    ]
    try:
        window = 64 * 1024
        async with asyncio.timeout(20):
            while sent[0] * len(ITEM) < window:
                changed.clear()
                await changed.wait()  # stream 0 is now a window ahead of its reader
        stalled_at = time.monotonic()
        before = list(got)
        async with asyncio.timeout(30):
            while min(got[i] - before[i] for i in range(1, STREAMS)) < 100:
                changed.clear()
                await changed.wait()
        elapsed = time.monotonic() - stalled_at
        rate = sum(got[i] - before[i] for i in range(1, STREAMS)) / (STREAMS - 1) / elapsed
        print(f"\nstalled-reader {engine}: neighbours {rate:.1f} items/s each over {elapsed:.1f}s")
        snapshot = consumer.snapshot()
        assert snapshot.streaming is not None
    finally:
        stop.set()
        for task in tasks + readers:
            task.cancel()
        await asyncio.gather(*tasks, *readers, return_exceptions=True)


@pytest.mark.timeout(60)
async def test_on_qh3_a_reader_too_far_behind_has_its_stream_cut_and_counted(
    start_nodes: StartNode, engine: str
) -> None:
    """The bound on what qh3 takes for a stalled per-stream reader: 16 windows. Past it the
    stream is stopped (its producer's send fails), counted as a ``reader_behind``
    rejection, and the reader keeps what arrived; the connection's other streams go on."""
    if engine != "qh3":
        pytest.skip("aioquic holds a stalled stream back alone (per-stream receive window)")
    window = 16 * 1024
    options: dict[str, Any] = {
        "transport": TransportConfig(engine=engine),
        "mux": MuxConfig(enabled=False),
        "streaming": StreamingConfig(per_stream_window=window),
    }
    consumer = await start_nodes("consumer", **options)
    producer = await start_nodes("producer", **options)
    producer.add_peer(consumer.instance_id, consumer.address)
    stalled, other = consumer.create_anchor(), consumer.create_anchor()
    sender = await producer.attach_anchor(stalled.handle)
    neighbour = await producer.attach_anchor(other.handle)
    sent = 0
    with pytest.raises(TransportError):
        async with asyncio.timeout(30):
            while True:  # never read: cut once 16 windows (256 KiB) behind
                await sender.send([0, ITEM])
                sent += 1
    assert sent * len(ITEM) >= 16 * window
    registry = consumer.registry
    cut = registry.get_sample_value(
        "velo_transport_rejections_total", {"transport": "quic", "reason": "reader_behind"}
    )
    assert cut == 1.0
    for number in range(20):
        await neighbour.send([1, number])
    await neighbour.finalize()
    assert [item async for item in other] == [[1, n] for n in range(20)]


LOSSY = Impairment(loss=0.02, delay=0.005, seed=7)


async def flat_out(sender: StreamSender, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await sender.send([0, ITEM])


@pytest.mark.timeout(90)
async def test_finalize_resolves_soon_after_the_reader_took_the_stream_under_constant_load(
    start_nodes: StartNode, engine: str
) -> None:
    """A per-stream stream read whole while its neighbours keep a lossy connection busy
    (2% loss, 5 ms each way): its ``finalize()`` resolves SENT within seconds. qh3 keeps
    no acknowledged offset per stream; its adapter settles a stream once the core ends it
    (every byte and its FIN acknowledged), not only once nothing at all is in flight."""
    options: dict[str, Any] = {
        "transport": TransportConfig(engine=engine),
        "mux": MuxConfig(enabled=False),
    }
    consumer = await start_nodes("consumer", **options)
    proxy = await ImpairmentProxy(consumer.address, LOSSY).start()
    producer = await start_nodes("producer", **options)
    producer.add_peer(consumer.instance_id, proxy.address)
    busy_anchors = [consumer.create_anchor() for _ in range(8)]
    busy = [await producer.attach_anchor(anchor.handle) for anchor in busy_anchors]
    stop = asyncio.Event()
    got = [0] * len(busy)
    changed = asyncio.Event()
    tasks = [asyncio.ensure_future(flat_out(sender, stop)) for sender in busy]
    tasks += [
        asyncio.ensure_future(read(anchor, got, index, changed))
        for index, anchor in enumerate(busy_anchors)
    ]
    try:
        anchor = consumer.create_anchor()
        sender = await producer.attach_anchor(anchor.handle)
        for number in range(50):
            await sender.send([1, number])
        retired = sender.finalize()
        assert [x async for x in anchor] == [[1, n] for n in range(50)]
        read_at = time.monotonic()
        assert await asyncio.wait_for(retired, 10) is Retired.SENT
        assert min(got) > 0 and not stop.is_set()  # the neighbours were busy throughout
        print(f"\nfinalize-under-load {engine}: SENT {time.monotonic() - read_at:.2f}s after read")
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await producer.close()
        proxy.close()
