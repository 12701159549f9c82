"""Streaming over two real nodes, on both transports: every test runs on the messenger mux
(``messenger-mux-v2``, the default) and on the per-stream QUIC path (``quic-stream-v1``,
what a node with the mux disabled negotiates)."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode, needs_stream_backpressure
from velomux_quic.errors import (
    AlreadyAttached,
    AnchorNotFound,
    AttachRefused,
    ChannelClosed,
    ReadTimeout,
    SenderDropped,
    SenderError,
    SendTimeout,
    StreamCancelled,
    UsageError,
    WrongHandleKind,
)
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.streaming.anchor import MpscEvent, MpscItem, StreamAnchor
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.streaming.perstream import PerStreamTransport
from velomux_quic.streaming.sender import Retired


@pytest.fixture(params=[MESSENGER_MUX_KEY, PER_STREAM_KEY])
def path(request: pytest.FixtureRequest) -> str:
    """The transport every node of the test negotiates."""
    return str(request.param)


@pytest.fixture
def start_node(start_nodes: StartNode, path: str) -> StartNode:
    """Nodes that negotiate ``path``: a node with the mux disabled speaks only per-stream."""

    async def start(name: str = "node", **options: object) -> Node:
        if path == PER_STREAM_KEY:
            options.setdefault("mux", MuxConfig(enabled=False))
        return await start_nodes(name, **options)

    return start


async def pair(start_node: StartNode, **options: object) -> tuple[Node, Node]:
    """(producer a, consumer b), a knowing where b is."""
    b = await start_node("b", **options)
    a = await start_node("a", **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


async def collect(anchor: object, timeout: float = 20) -> list[object]:
    async with asyncio.timeout(timeout):
        return [item async for item in anchor]  # type: ignore[attr-defined]


async def test_items_then_finalize_arrive_in_order_and_end_the_iteration(
    start_node: StartNode, path: str
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    assert sender.negotiated_transport() == path
    for i in range(10):
        await sender.send({"i": i})
    retired = sender.finalize()
    assert await collect(anchor) == [{"i": i} for i in range(10)]
    assert await asyncio.wait_for(retired, 10) is Retired.SENT
    assert anchor.finished
    with pytest.raises(ChannelClosed):
        await sender.send("after the end")


async def test_sender_error_is_raised_and_the_stream_goes_on(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send(1)
    await sender.send_err("could not serialise item 2")
    await sender.send(3)
    sender.finalize()
    assert await anchor.next() == 1
    with pytest.raises(SenderError, match="item 2"):
        await anchor.next()
    assert await collect(anchor) == [3]


async def test_a_killed_producer_process_ends_the_stream_within_the_watchdog_bound(
    start_node: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    window = 0.5
    b = await start_node("b", streaming=StreamingConfig(heartbeat_interval=window))
    credentials = make_credentials("producer")
    credentials.save(tmp_path / "producer")
    anchor = b.create_anchor()
    hi, lo = anchor.handle.to_wire()["hi"], anchor.handle.to_wire()["lo"]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.procs.producer",
        "--credentials",
        str(tmp_path / "producer"),
        "--peer",
        f"{b.instance_id}@{b.address[0]}:{b.address[1]}",
        "--handle",
        f"{hi}:{lo}",
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        assert line.strip() == b"attached"
        received = 0
        async with asyncio.timeout(20):
            while received < 20:
                await anchor.next()
                received += 1
        process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(SenderDropped):
            async with asyncio.timeout(20):
                while True:
                    await anchor.next()
        elapsed = time.monotonic() - killed_at
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
    # Detection lands 3 to 4 windows after the last arrival, which was at most one
    # window (a heartbeat) before the kill.
    assert 2 * window <= elapsed <= 4 * window + 1.0, elapsed
    assert "velo_streaming_heartbeat_watchdog_firings_total 1.0" in b.metrics_text()


async def test_detach_then_another_sender_continues_the_stream(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    c = await start_node("c")
    c.add_peer(b.instance_id, b.address)
    anchor = b.create_anchor()
    first = await a.attach_anchor(anchor.handle)
    for i in range(5):
        await first.send(i)
    retired = first.detach()  # the retirement, as finalize() returns it
    assert first.state == "detached"
    second = await c.attach_anchor(first.handle)  # may attach before the consumer read
    for i in range(5, 10):
        await second.send(i)
    second.finalize()
    assert await collect(anchor) == list(range(10))
    assert await asyncio.wait_for(retired, 10) is Retired.SENT


async def test_a_second_attach_while_one_is_live_is_refused(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    live = await a.attach_anchor(anchor.handle)
    with pytest.raises(AlreadyAttached):
        await a.attach_anchor(anchor.handle)
    with pytest.raises(AlreadyAttached):
        await b.attach_anchor(anchor.handle)  # same-worker attempt too
    live.finalize()
    assert await collect(anchor) == []
    with pytest.raises(AnchorNotFound):
        await a.attach_anchor(anchor.handle)
    mpsc = b.create_mpsc_anchor()
    with pytest.raises(WrongHandleKind):
        await a.attach_anchor(mpsc.handle)


async def test_cancel_from_the_consumer_reaches_an_idle_producer(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send("one")
    assert await anchor.next() == "one"
    anchor.cancel()
    await asyncio.wait_for(sender.wait_cancelled(), 10)  # idle: it sent nothing since
    assert sender.is_stop_requested
    with pytest.raises(ChannelClosed):
        await sender.send("two")
    assert await asyncio.wait_for(sender.retired(), 10) is Retired.DISCARDED
    with pytest.raises(StreamCancelled):
        await anchor.next()


async def test_stop_request_lets_the_producer_finish_gracefully(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    anchor.request_stop()
    await asyncio.wait_for(sender.wait_stop_requested(), 10)
    assert not sender.is_cancelled
    await sender.send("last words")
    sender.finalize()
    assert await collect(anchor) == ["last words"]


async def test_mpsc_eight_senders_on_two_nodes_each_in_order_exactly_once(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_mpsc_anchor()
    senders = [await (a if i % 2 else b).attach_mpsc_anchor(anchor.handle) for i in range(8)]
    assert len({s.sender_id for s in senders}) == 8
    per_sender = 300

    async def produce(index: int) -> None:
        for n in range(per_sender):
            await senders[index].send([index, n])
        senders[index].finalize()

    producers = asyncio.gather(*(produce(i) for i in range(8)))
    seen: dict[int, list[int]] = {}
    departed = 0
    async with asyncio.timeout(30):
        async for event in anchor:
            if isinstance(event, MpscItem):
                index, n = event.value
                seen.setdefault(index, []).append(n)
            else:
                assert isinstance(event, MpscEvent) and event.kind == "detached"
                departed += 1
                if departed == 8:
                    break
    await producers
    assert {i: seen[i] for i in range(8)} == {i: list(range(per_sender)) for i in range(8)}
    anchor.cancel()


async def test_negotiation_matrix(start_node: StartNode, path: str) -> None:
    a, b = await pair(start_node)
    # An old sender advertising nothing gets the per-stream default.
    anchor = b.create_anchor()
    old = await a.anchors.attach_anchor(anchor.handle, offer=[])
    assert old.negotiated_transport() == PER_STREAM_KEY
    old.finalize()
    assert await collect(anchor) == []
    # A new sender offering both gets the mux from a receiver that has it, and the
    # per-stream path from one whose mux is disabled (the rollback).
    anchor = b.create_anchor()
    new = await a.anchors.attach_anchor(anchor.handle, offer=[MESSENGER_MUX_KEY, PER_STREAM_KEY])
    assert new.negotiated_transport() == path
    new.finalize()
    assert await collect(anchor) == []
    # Only an unknown key: refused with the reason, and the anchor stays attachable.
    anchor = b.create_anchor()
    with pytest.raises(AttachRefused, match="no_common_transport"):
        await a.anchors.attach_anchor(anchor.handle, offer=["carrier-pigeon-v1"])
    sender = await a.attach_anchor(anchor.handle)
    sender.finalize()
    assert await collect(anchor) == []


async def test_same_worker_attach_uses_no_transport_and_waits_when_full(
    start_node: StartNode,
) -> None:
    b = await start_node("b")
    anchor = b.create_anchor()
    sender = await b.attach_anchor(anchor.handle)
    assert sender.negotiated_transport() is None
    for i in range(256):  # the anchor's channel holds 256
        await asyncio.wait_for(sender.send(i), 5)
    blocked = asyncio.ensure_future(sender.send(256))
    with pytest.raises(TimeoutError):  # full: the send waits (a negative check, never flaky)
        await asyncio.wait_for(asyncio.shield(blocked), 0.05)
    assert await anchor.next() == 0
    await asyncio.wait_for(blocked, 5)
    sender.finalize()
    assert await collect(anchor) == list(range(1, 257))


async def test_a_dropped_sender_still_ends_the_stream(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send("only")
    del sender
    gc.collect()
    assert await anchor.next() == "only"
    with pytest.raises(SenderDropped):
        await asyncio.wait_for(anchor.next(), 10)


async def test_one_thousand_and_twenty_four_concurrent_per_stream_streams(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    streams = 1024
    anchors = [b.create_anchor() for _ in range(streams)]
    senders = await asyncio.gather(*(a.attach_anchor(anchor.handle) for anchor in anchors))
    for round_ in range(3):
        for index, sender in enumerate(senders):
            await sender.send([index, round_])
    for sender in senders:
        sender.finalize()
    results = await asyncio.gather(*(collect(anchor, 60) for anchor in anchors))
    assert all(r == [[i, 0], [i, 1], [i, 2]] for i, r in enumerate(results))


@needs_stream_backpressure
async def test_a_consumer_that_stops_reading_holds_only_its_own_producer(
    start_node: StartNode, path: str
) -> None:
    if path != PER_STREAM_KEY:
        pytest.skip("per-stream window semantics; the mux's credit version is in test_mux.py")
    a, b = await pair(start_node)
    stalled, flowing = b.create_anchor(), b.create_anchor()
    stuck = await a.attach_anchor(stalled.handle)
    free = await a.attach_anchor(flowing.handle)
    sent = 0

    async def pump() -> None:
        nonlocal sent
        while True:
            await stuck.send(bytes(1000))
            sent += 1

    def held_by_the_window() -> bool:
        # A send may also wait on the connection (its congestion window, a transmit
        # not yet run) and then completes without the consumer reading; only a stream
        # whose unsent bytes lie beyond the consumer's window, with nothing left to
        # transmit inside it, waits for the consumer.
        connection = a.messenger.transport.snapshot().to(b.instance_id)
        assert connection is not None
        return connection.held_by_peer_window == 1 and connection.send_backlog == 0

    blocked = asyncio.ensure_future(pump())
    try:
        async with asyncio.timeout(20):
            while not held_by_the_window():  # no event says so: polled
                assert not blocked.done()
                await asyncio.sleep(0.005)
        held_at = sent
        assert held_at < 1000  # window + send buffer hold ~130 such records
        for n in range(500):
            await free.send(n)
        free.finalize()
        assert await collect(flowing) == list(range(500))  # the other stream never waited
        assert sent == held_at and not blocked.done()
        per_stream = b.anchors.transports.get(PER_STREAM_KEY)
        assert isinstance(per_stream, PerStreamTransport)
        async with asyncio.timeout(20):  # the consumer's window fills (polled, as above)
            while "velo_streaming_reader_pump_backpressure_total 1.0" not in b.metrics_text():
                await asyncio.sleep(0.005)
        assert per_stream.snapshot().receivers == 1  # the stalled stream's, still open
        assert await stalled.next() == bytes(1000)  # reading again releases the producer
        async with asyncio.timeout(20):
            while sent == held_at:
                await stalled.next()
    finally:
        blocked.cancel()
    stalled.cancel()


async def test_batches_yields_every_buffered_item_per_step_and_ends_like_iteration(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    for i in range(50):
        await sender.send(i)
    await sender.send_err("soft")  # a SenderError ends a batch; the stream goes on
    for i in range(50, 60):
        await sender.send(i)
    sender.finalize()
    seen: list[object] = []
    steps = 0
    errors = 0
    async with asyncio.timeout(20):
        while True:
            try:
                async for items in anchor.batches():
                    assert items  # never an empty step
                    seen.extend(items)
                    steps += 1
                break
            except SenderError:
                errors += 1
    assert seen == list(range(60)) and errors == 1
    assert steps < 60  # at least one step carried more than one item

    dropped = b.create_anchor()
    doomed = await a.attach_anchor(dropped.handle)
    await doomed.send("last")
    await doomed.aclose()  # the producer goes away: Dropped
    got: list[object] = []
    with pytest.raises(SenderDropped):
        async with asyncio.timeout(20):
            async for items in dropped.batches():
                got.extend(items)
    assert got == ["last"]


async def test_an_anchor_has_one_reader_and_is_read_once(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor: StreamAnchor[str] = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    first = asyncio.ensure_future(anchor.next())
    await asyncio.sleep(0)  # the first reader runs up to its wait for an item
    with pytest.raises(UsageError, match="already reading this anchor"):
        await anchor.next()
    with pytest.raises(UsageError, match="already reading this anchor"):
        await anchor.take_ready()
    with pytest.raises(UsageError, match="already reading this anchor"):
        async for _ in anchor:
            pass
    await sender.send("only")
    assert await asyncio.wait_for(first, 10) == "only"  # the refused readers took nothing
    sender.finalize()
    assert await collect(anchor) == []  # the first loop ends normally
    with pytest.raises(UsageError, match="already ended"):
        async for _ in anchor:
            pass
    with pytest.raises(UsageError, match="already ended"):
        async for _ in anchor.batches():
            pass


async def test_an_mpsc_anchor_has_one_reader(start_node: StartNode) -> None:
    """A second reader of an MPSC anchor is refused while the first waits, takes nothing,
    and once the first read ended the anchor can be read again."""
    a, b = await pair(start_node)
    anchor = b.create_mpsc_anchor()
    sender = await a.attach_mpsc_anchor(anchor.handle)
    first = asyncio.ensure_future(anchor.next())
    await asyncio.sleep(0)  # the first reader runs up to its wait for an item
    with pytest.raises(UsageError, match="already reading this anchor"):
        await anchor.next()
    await sender.send("one")
    got = await asyncio.wait_for(first, 10)
    assert isinstance(got, MpscItem) and got.value == "one"  # the refused reader took nothing
    await sender.send("two")
    again = await anchor.next(timeout=10)  # the flag was given back
    assert isinstance(again, MpscItem) and again.value == "two"
    anchor.cancel()


async def test_reads_time_out_and_the_stream_goes_on(start_node: StartNode) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    with pytest.raises(ReadTimeout):
        await anchor.next(timeout=0.05)
    with pytest.raises(ReadTimeout):
        await anchor.take_ready(timeout=0.05)
    await sender.send("after")
    assert await anchor.take_ready(timeout=10) == ["after"]
    sender.finalize()
    assert await collect(anchor) == []


async def test_a_send_times_out_on_a_full_stream_and_the_stream_goes_on(
    start_node: StartNode, path: str
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    waits_before = a.anchors.metrics.producer_send_backpressure
    sent = 0
    for _ in range(10_000):  # bounded: the consumer reads nothing, so the window closes
        try:
            await sender.send(bytes(1000), timeout=0.5)
        except SendTimeout:
            break
        sent += 1
    else:
        pytest.fail("the stream never filled")
    # Counted on every path, the mux's included.
    assert a.anchors.metrics.producer_send_backpressure > waits_before
    assert sender.queued_bytes > 0  # staged, not on the wire
    if path == MESSENGER_MUX_KEY:
        assert sender.credit == 0  # the consumer's window is used up
    else:
        assert sender.credit is None  # QUIC's window is in bytes
    assert sender.state == "open"
    reader = asyncio.ensure_future(collect(anchor, 60))
    await sender.send("after", timeout=30)  # reading again releases the producer
    sender.finalize()
    got = await reader
    assert len(got) == sent + 1 and got[-1] == "after"  # the timed-out item was not taken


async def test_a_local_sender_shows_its_credit_and_times_out_when_full(
    start_node: StartNode,
) -> None:
    b = await start_node("b")
    anchor = b.create_anchor()
    sender = await b.attach_anchor(anchor.handle)
    assert sender.credit == 256 and sender.queued_bytes == 0
    for i in range(256):
        await sender.send(i, timeout=5)
    assert sender.credit == 0
    waits_before = b.anchors.metrics.producer_send_backpressure
    with pytest.raises(SendTimeout, match="not sent"):
        await sender.send("dropped", timeout=0.05)
    assert b.anchors.metrics.producer_send_backpressure == waits_before + 1
    assert await anchor.next() == 0
    assert sender.credit == 1
    await sender.send("kept", timeout=5)
    sender.finalize()
    assert await collect(anchor) == [*range(1, 256), "kept"]


async def test_cancelling_an_anchor_cancels_its_same_node_sender(start_node: StartNode) -> None:
    b = await start_node("b")
    anchor = b.create_anchor()
    sender = await b.attach_anchor(anchor.handle)
    anchor.cancel()
    assert sender.is_cancelled and sender.is_stop_requested
    assert sender.state == "cancelled"
    await asyncio.wait_for(sender.wait_cancelled(), 1)
    with pytest.raises(ChannelClosed):
        await sender.send("late")


async def test_attaching_to_a_node_that_is_not_a_peer_names_the_fix(
    start_node: StartNode,
) -> None:
    b = await start_node("b")
    stranger = await start_node("stranger")  # never told where b is
    anchor = b.create_anchor()
    with pytest.raises(AttachRefused, match=r"no known node has WorkerId 0x.*add_peer"):
        await stranger.attach_anchor(anchor.handle)


async def test_the_snapshot_shows_anchors_senders_and_heartbeats(
    start_node: StartNode, path: str
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    mpsc = b.create_mpsc_anchor()
    sender = await a.attach_anchor(anchor.handle)
    local = await b.attach_mpsc_anchor(mpsc.handle)
    await local.send("buffered")

    consumer = b.anchors.snapshot()
    by_handle: dict[Any, Any] = {entry.handle: entry for entry in consumer.anchors}
    spsc_view, mpsc_view = by_handle[anchor.handle], by_handle[mpsc.handle]
    assert (spsc_view.kind, spsc_view.attached, spsc_view.senders) == ("spsc", True, 1)
    assert (mpsc_view.kind, mpsc_view.senders, mpsc_view.buffered_records) == ("mpsc", 1, 1)
    assert not spsc_view.finished and not spsc_view.cancelled and not spsc_view.prebound
    assert [(s.handle, s.node, s.transport_key) for s in consumer.bound_senders] == [
        (anchor.handle, a.instance_id, path)
    ]
    assert consumer.bound_per_transport == {path: 1}
    assert consumer.attaches_served == 1
    assert consumer.senders_per_transport == {"local": 1}

    producer = a.anchors.snapshot()
    [mine] = producer.senders
    assert (mine.handle, mine.state, mine.target) == (anchor.handle, "open", b.instance_id)
    assert mine.transport_key == path and mine.queued_bytes >= 0
    assert producer.heartbeat_task_running and producer.pending_attaches == 0
    assert producer.senders_per_transport == {path: 1}

    sender.finalize()
    assert await collect(anchor) == []
    mpsc.cancel()
    assert local.state == "cancelled"
    assert b.anchors.snapshot().anchors == ()
    assert a.anchors.snapshot().senders == ()
