"""A producer overloads a slow, lossy path: it is pushed back, it does not drop streams.

Two real nodes over real QUIC, the producer's connection (and the consumer's connection
back, which carries attach answers and credit) through the impairment proxy: 2% loss and
10 ms each way, so congestion control holds the path to well under a megabyte a second.
Every producer sends as fast as ``send()`` lets it. What must hold while it does:

* memory is bounded: the producer's staged bytes per (peer, lane) never exceed
  ``peer_queue_bytes`` plus one record per live slot (sampled from ``node.snapshot()``);
* new streams still attach, within ``attach_timeout``, while the data is queued;
* no stream is ended by a watchdog merely because the path is slow (the consumer's
  heartbeat window is short here, so a producer queueing far ahead of the path would
  starve streams past it);
* every retirement matches what the consumer saw: SENT for each stream it read to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.errors import StreamTransportError
from velomux_quic.messenger.config import MessengerConfig
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.programs.demo.proxy import Impairment, ImpairmentProxy
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.config import StreamingConfig
from velomux_quic.streaming.sender import Retired, StreamSender
from velomux_quic.transport.config import TransportConfig

KiB = 1024
IMPAIRMENT = Impairment(loss=0.02, delay=0.01, seed=3)
BOUND = 128 * KiB
PAD = 2000
"""Bytes of padding per item: a record of about 2 KiB."""
RECORD = PAD + 64
"""An upper bound on one encoded record with its header (the bound's per-slot slack)."""
HEARTBEAT = 1.0
"""The consumer's heartbeat window: a stream silent for 3 windows (3 s) is dropped."""


@dataclass
class Run:
    """What one overload run saw."""

    bound: int = 0
    peak_queued: int = 0
    peak_slots: int = 0
    attach_seconds: list[float] = field(default_factory=list)
    received_bytes: int = 0
    seconds: float = 0.0


def item(stream: int, number: int, pad: int = PAD) -> list[object]:
    return [stream, number, b"p" * pad]


HEAVY_MIX = (200, 2000, 200, 16 * KiB, 200, 2000, 64 * KiB, 200)
"""The soak's heavy size mix: mostly small items, now and then 16 and 64 KiB ones."""


async def produce(
    index: int, sender: StreamSender, stop: asyncio.Event, sizes: tuple[int, ...] = (PAD,)
) -> tuple[int, Retired]:
    """Send as fast as the stream takes items until told to stop, then finalize."""
    sent = 0
    while not stop.is_set():
        await sender.send(item(index, sent, sizes[(index + sent) % len(sizes)]))
        sent += 1
    return sent, await sender.finalize()


async def consume(anchor: StreamAnchor[Any], run: Run) -> tuple[str, list[int]]:
    """('end', numbers) for a stream read to its end, else the error's type name."""
    numbers: list[int] = []
    try:
        async for received in anchor:
            numbers.append(received[1])
            run.received_bytes += len(received[2])
    except Exception as exc:
        return type(exc).__name__, numbers
    return "end", numbers


async def sample(node: Node, run: Run, stop: asyncio.Event, bound: int) -> None:
    """The producer's staged bytes per (peer, lane), every 10 ms, while it overloads."""
    while not stop.is_set():
        mux = node.snapshot().mux
        assert mux is not None
        for lane in mux.egress.values():
            run.peak_queued = max(run.peak_queued, lane.queued_bytes)
            run.peak_slots = max(run.peak_slots, lane.live_slots)
            assert lane.queue_limit == bound
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.01)


async def overload(
    a: Node,
    b: Node,
    streams: int,
    extra: int,
    seconds: float,
    bound: int,
    sizes: tuple[int, ...] = (PAD,),
) -> Run:
    """``streams`` producers flat out for ``seconds``, ``extra`` more attached meanwhile."""
    run = Run()
    stop = asyncio.Event()
    anchors: list[StreamAnchor[Any]] = []
    producers: list[asyncio.Future[tuple[int, Retired]]] = []
    consumers: list[asyncio.Future[tuple[str, list[int]]]] = []

    async def attach() -> None:
        anchor: StreamAnchor[Any] = b.create_anchor()
        started = time.monotonic()
        sender = await a.attach_anchor(anchor.handle)  # AttachTimeout past attach_timeout
        run.attach_seconds.append(time.monotonic() - started)
        index = len(anchors)
        anchors.append(anchor)
        consumers.append(asyncio.ensure_future(consume(anchor, run)))
        producers.append(asyncio.ensure_future(produce(index, sender, stop, sizes)))

    began = time.monotonic()
    await asyncio.gather(*(attach() for _ in range(streams)))
    sampler = asyncio.ensure_future(sample(a, run, stop, bound))
    try:
        for _ in range(extra):  # attaches while the path is full of queued data
            await asyncio.sleep(seconds / (extra + 1))  # pacing the load, not synchronising
            await attach()
        await asyncio.sleep(seconds / (extra + 1))
        stop.set()
        sent = await asyncio.gather(*producers)
        seen = await asyncio.gather(*consumers)
        await sampler
    finally:
        stop.set()
        everything: list[asyncio.Future[Any]] = [*producers, *consumers, sampler]
        for task in everything:
            task.cancel()
        await asyncio.gather(*producers, *consumers, sampler, return_exceptions=True)
    run.seconds = time.monotonic() - began
    for index, ((count, retired), (outcome, numbers)) in enumerate(zip(sent, seen, strict=True)):
        assert outcome == "end", f"stream {index} ended with {outcome} after {len(numbers)} items"
        assert numbers == list(range(count)), f"stream {index} lost or reordered items"
        assert retired is Retired.SENT, f"stream {index} was read to its end, retired {retired}"
    return run


async def run_overload(
    start_nodes: StartNode,
    *,
    engine: str,
    streams: int,
    extra: int,
    seconds: float,
    defaults: bool = False,
    sizes: tuple[int, ...] = (PAD,),
) -> tuple[Run, int]:
    """Small buffers and a 1 s heartbeat window (a short run that still shows starvation),
    or with ``defaults`` every library default (the figures docs/reliability.md quotes)."""
    transport = TransportConfig(engine=engine, lane_window=128 * KiB, send_buffer=32 * KiB)
    streaming = StreamingConfig(heartbeat_interval=HEARTBEAT)
    mux = MuxConfig(peer_queue_bytes=BOUND)
    if defaults:
        transport, streaming, mux = TransportConfig(engine=engine), StreamingConfig(), MuxConfig()
    b = await start_nodes("consumer", transport=transport, streaming=streaming)
    async with ImpairmentProxy(b.address, IMPAIRMENT) as proxy:
        a = await start_nodes("producer", transport=transport, mux=mux)
        a.add_peer(b.instance_id, proxy.address)
        async with asyncio.timeout(60 + 2 * seconds):
            run = await overload(a, b, streams, extra, seconds, mux.peer_queue_bytes, sizes)
        engine_failures = a.registry.get_sample_value(
            "velo_transport_engine_failures_total", {"transport": "quic"}
        )
        assert not engine_failures, f"{engine}: {engine_failures} connections lost to the engine"
        run.bound = mux.peer_queue_bytes
        dropped = proxy.counters.client_to_server.dropped_loss
        await a.close()
        await b.close()
    return run, dropped


def check(run: Run, dropped: int, streams: int, record: int = RECORD) -> None:
    assert dropped >= 10, "the path must really have lost packets"
    assert 0 < run.peak_queued <= run.bound + run.peak_slots * record, run
    assert len(run.attach_seconds) == streams
    assert max(run.attach_seconds) < StreamingConfig().attach_timeout
    rate = run.received_bytes / run.seconds
    print(
        f"\noverload: {streams} streams, {run.seconds:.1f} s, path carried {rate / 1e6:.2f} MB/s;"
        f" peak staged {run.peak_queued} B (bound {run.bound} B, {run.peak_slots} slots);"
        f" attach p50 {sorted(run.attach_seconds)[len(run.attach_seconds) // 2] * 1000:.0f} ms,"
        f" max {max(run.attach_seconds) * 1000:.0f} ms"
    )


@pytest.fixture(params=["aioquic", "qh3"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every overload runs on both QUIC engines (qh3's where the extra is installed)."""
    if request.param == "qh3":
        pytest.importorskip("qh3")
    return str(request.param)


@pytest.mark.timeout(90)
async def test_an_overloaded_path_pushes_back_and_drops_no_stream(
    start_nodes: StartNode, engine: str
) -> None:
    run, dropped = await run_overload(start_nodes, engine=engine, streams=24, extra=6, seconds=3.0)
    check(run, dropped, 30)


@pytest.mark.timeout(180)
async def test_the_soak_shape_shortened_drops_no_stream(
    start_nodes: StartNode, engine: str
) -> None:
    """The overload soak's shape (a heavy size mix, 500 live streams, 2% loss) for a few
    seconds at the library defaults: no stream dropped, no connection lost to its engine
    (qh3's core once raised while sending and stalled a lane for good)."""
    run, dropped = await run_overload(
        start_nodes,
        engine=engine,
        streams=500,
        extra=0,
        seconds=8.0,
        defaults=True,
        sizes=HEAVY_MIX,
    )
    check(run, dropped, 500, max(HEAVY_MIX) + 64)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_soak_shape_for_100_seconds_drops_no_stream(
    start_nodes: StartNode, engine: str
) -> None:
    run, dropped = await run_overload(
        start_nodes,
        engine=engine,
        streams=500,
        extra=0,
        seconds=100.0,
        defaults=True,
        sizes=HEAVY_MIX,
    )
    check(run, dropped, 500, max(HEAVY_MIX) + 64)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_minute_of_overload_at_the_defaults_stays_bounded_and_drops_no_stream(
    start_nodes: StartNode, engine: str
) -> None:
    run, dropped = await run_overload(
        start_nodes, engine=engine, streams=96, extra=32, seconds=60.0, defaults=True
    )
    check(run, dropped, 128)


# -- what SENT promises -------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_an_item_over_the_receivers_staged_payload_max_never_retires_sent(
    start_nodes: StartNode,
) -> None:
    b = await start_nodes("b", messenger=MessengerConfig(staged_payload_max=512 * KiB))
    a = await start_nodes("a")
    a.add_peer(b.instance_id, b.address)
    anchor: StreamAnchor[Any] = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send("first")
    await sender.send(b"x" * (1024 * KiB))  # staged: the receiver refuses to pull it
    retired = sender.finalize()  # the terminal waits behind the staged record's fate
    assert await asyncio.wait_for(anchor.next(), 30) == "first"
    with pytest.raises(StreamTransportError):
        await asyncio.wait_for(anchor.next(), 30)
    assert await asyncio.wait_for(retired, 30) is Retired.DISCARDED


@pytest.mark.timeout(60)
async def test_a_terminal_admitted_but_never_acknowledged_does_not_retire_sent(
    start_nodes: StartNode,
) -> None:
    b = await start_nodes("b")
    async with ImpairmentProxy(b.address, Impairment()) as proxy:
        a = await start_nodes("a")
        a.add_peer(b.instance_id, proxy.address)
        anchor: StreamAnchor[Any] = b.create_anchor()
        sender = await a.attach_anchor(anchor.handle)
        await sender.send("first")
        assert await asyncio.wait_for(anchor.next(), 10) == "first"
        proxy.blackhole(True)  # the path goes dark: what leaves now is never acknowledged
        retired = sender.finalize()
        # The terminal's packet reached the dead path (wait_until bounds the wait itself).
        await proxy.wait_until(lambda counters: counters.client_to_server.dropped_blackhole > 0)
        assert not retired.done(), "admitted is not delivered: SENT must wait for the ack"
        a.messenger.transport.disconnect(b.instance_id)  # the connection is lost with it
        assert await asyncio.wait_for(retired, 10) is Retired.DISCARDED
        await a.close()
        await b.close()


@pytest.mark.timeout(60)
async def test_a_terminal_retires_sent_once_acknowledged(start_nodes: StartNode) -> None:
    b = await start_nodes("b")
    a = await start_nodes("a")
    a.add_peer(b.instance_id, b.address)
    anchor: StreamAnchor[Any] = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send("only")
    retired = sender.finalize()
    assert await asyncio.wait_for(retired, 10) is Retired.SENT
    assert [x async for x in anchor] == ["only"]
