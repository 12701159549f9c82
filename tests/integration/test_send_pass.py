"""``Node.send_pass`` between real nodes over mutual-TLS QUIC: a forward pass in one call.

Every test checks what each consumer received against what was handed over (an oracle):
nothing lost, nothing duplicated, every stream's items in the order they were given.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import pytest

from tests.conftest import StartNode
from tests.polling import poll_until
from velomux_quic import (
    ChannelClosed,
    Manual,
    MpscEvent,
    MpscItem,
    MuxConfig,
    Node,
    PassOutcome,
    SerializationError,
    StreamAnchor,
    StreamSender,
    TransportConfig,
    UsageError,
)
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY


def metric(node: Node, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + "$", node.metrics_text(), re.MULTILINE)
    assert match is not None, f"{name}{{{labels}}} not exported"
    return float(match.group(1))


def batches_sent(node: Node) -> float:
    return metric(node, "velo_streaming_mux_batches_total", 'direction="sent"')


def backpressure(node: Node) -> float:
    return metric(node, "velo_streaming_producer_send_backpressure_total")


async def drain(anchor: StreamAnchor[Any], timeout: float = 60) -> list[Any]:
    async with asyncio.timeout(timeout):
        return [item async for item in anchor]


async def finish_all(senders: Sequence[StreamSender]) -> None:
    for sender in senders:
        sender.finalize()


async def test_passes_over_several_peers_and_lanes_mixed_with_send_arrive_exactly_once_in_order(
    start_nodes: StartNode,
) -> None:
    transport = TransportConfig(lanes=2)
    consumers = [await start_nodes(f"c{n}", transport=transport) for n in range(2)]
    engine = await start_nodes("engine", transport=transport)
    for node in consumers:
        engine.add_peer(node.instance_id, node.address)
    anchors = [consumers[i % 2].create_anchor() for i in range(96)]
    senders = await asyncio.gather(
        *(engine.attach_anchor(x.handle, key=i) for i, x in enumerate(anchors))
    )
    assert {s.negotiated_transport() for s in senders} == {MESSENGER_MUX_KEY}
    assert {s.lane for s in senders} == {0, 1}
    expected: list[list[Any]] = [[] for _ in senders]

    async def produce() -> None:
        for n in range(40):
            if n % 3 == 1:  # send() and send_pass() mixed on the same streams
                for i, sender in enumerate(senders):
                    await sender.send([i, n])
                    expected[i].append([i, n])
                continue
            # Two items per stream in some passes: a sender may appear twice.
            pairs = [(s, [i, n, k]) for k in range(1 + n % 2) for i, s in enumerate(senders)]
            outcome = await engine.send_pass(pairs, wait=True, timeout=30)
            assert outcome.complete and outcome.taken == len(pairs), outcome
            for s_index_item in pairs:
                item = s_index_item[1]
                expected[item[0]].append(item)
        await finish_all(senders)

    producer = asyncio.ensure_future(produce())
    results = await asyncio.gather(*(drain(x) for x in anchors))
    await producer
    assert results == expected
    assert all(x.finished for x in anchors)


async def test_an_autoflush_pass_ends_in_one_flush_per_peer_and_a_manual_one_waits_for_flush_batch(
    start_nodes: StartNode,
) -> None:
    for manual in (False, True):
        mux = MuxConfig(flush_policy=Manual()) if manual else MuxConfig()
        consumers = [await start_nodes(f"c{n}") for n in range(2)]
        consumers[0].register_handler("barrier", lambda ctx: None)
        engine = await start_nodes("engine", mux=mux)
        for node in consumers:
            engine.add_peer(node.instance_id, node.address)
        anchors = [consumers[i % 2].create_anchor() for i in range(64)]
        senders = await asyncio.gather(*(engine.attach_anchor(x.handle) for x in anchors))
        # A first pass writes every stream's OpenSlot; read it, so the slots are open.
        await engine.send_pass([(s, "warm") for s in senders])
        engine.flush_batch()
        assert [await x.next(timeout=30) for x in anchors] == ["warm"] * len(anchors)
        before = batches_sent(engine)
        outcome = await engine.send_pass([(s, i) for i, s in enumerate(senders)])
        assert outcome == PassOutcome(len(senders))
        # A round trip to a consumer: its reply arrives after every wake the pass
        # scheduled (call_soon) has run, so an AutoFlush batcher has written by then.
        await engine.call(consumers[0].instance_id, "barrier", timeout=30)
        if manual:
            assert batches_sent(engine) == before  # Manual: staged until flush_batch()
            engine.flush_batch()
        else:
            assert batches_sent(engine) - before == 2  # the barrier does see a write
        got = [await x.next(timeout=30) for x in anchors]
        assert got == list(range(len(senders)))
        assert batches_sent(engine) - before == 2  # one flush per peer (one lane each)
        await finish_all(senders)
        assert [await drain(x) for x in anchors] == [[]] * len(anchors)


async def test_credit_exhausted_mid_pass_returns_the_left_overs_and_takes_them_once_credit_returns(
    start_nodes: StartNode,
) -> None:
    # Two credits and room for about three queued records: the stalled stream's records
    # stop being taken mid-pass, while the other stream's are all taken.
    mux = MuxConfig(initial_credit=2, slot_byte_budget=150)
    consumer = await start_nodes("c", mux=mux)
    engine = await start_nodes("engine", mux=mux)
    engine.add_peer(consumer.instance_id, consumer.address)
    stalled, free = consumer.create_anchor(), consumer.create_anchor()
    slow, fast = await engine.attach_anchor(stalled.handle), await engine.attach_anchor(free.handle)
    before = backpressure(engine)
    items = [f"record {n:02d} " + "x" * 30 for n in range(12)]
    # The stalled stream's twelve records, then two of the other stream (within its room):
    # a stream out of room holds back none but its own later records.
    for item in items[:2]:  # the stalled stream's two credits go on its first records
        await slow.send(item)
    # Written at the end of the wake: then the credit is spent (no event says so).
    await poll_until(lambda: not slow.credit, "the stalled stream's credit spent", timeout=30)
    pairs = [(slow, item) for item in items[2:]] + [(fast, item) for item in items[:2]]
    taken_free = asyncio.ensure_future(drain(free))
    first = await engine.send_pass(pairs)
    assert not first.failed
    assert first.left, "the stalled stream should have run out of room"
    assert first.taken == len(pairs) - len(first.left)
    # Every record of the stalled stream from its first refusal on is left over (order).
    assert list(first.left) == list(range(first.left[0], len(items) - 2))
    assert backpressure(engine) - before == len(first.left)
    assert slow.credit == 0
    # The consumer reads: credit returns, and the left-overs are taken, in order.
    reading = asyncio.ensure_future(drain(stalled))
    second = await engine.send_pass([pairs[index] for index in first.left], wait=True, timeout=30)
    assert second == PassOutcome(len(first.left))
    await finish_all([slow, fast])
    assert await reading == items
    assert await taken_free == items[:2]


async def test_a_full_byte_budget_leaves_the_rest_over_and_wait_takes_it_after_a_flush(
    start_nodes: StartNode,
) -> None:
    # The consumer's terms carry the slot byte budget; only the engine flushes by hand.
    consumer = await start_nodes("c", mux=MuxConfig(slot_byte_budget=300))
    engine = await start_nodes("engine", mux=MuxConfig(flush_policy=Manual()))
    engine.add_peer(consumer.instance_id, consumer.address)
    anchor = consumer.create_anchor()
    sender = await engine.attach_anchor(anchor.handle)
    items = [bytes([n]) * 100 for n in range(8)]
    first = await engine.send_pass([(sender, item) for item in items])
    # Taken while the queue is below the budget (checked before adding): three of 100+ B.
    assert first.taken == 3 and first.left == tuple(range(3, 8)) and not first.failed
    assert sender.queued_bytes >= 300
    timed_out = await engine.send_pass([(sender, items[3])], wait=True, timeout=0.05)
    assert timed_out == PassOutcome(0, (0,))  # nothing was flushed: no room came
    waiting = asyncio.ensure_future(
        engine.send_pass([(sender, items[n]) for n in first.left], wait=True, timeout=30)
    )

    async def flush_until_done() -> None:
        while not waiting.done():
            engine.flush_batch()
            await asyncio.sleep(0.005)

    await asyncio.wait_for(flush_until_done(), 30)
    assert waiting.result() == PassOutcome(5)
    sender.finalize()
    engine.flush_batch()
    assert await drain(anchor) == items


async def test_cancelled_ended_and_unencodable_pairs_fail_alone_and_the_rest_is_taken(
    start_nodes: StartNode,
) -> None:
    consumer = await start_nodes("c")
    engine = await start_nodes("engine")
    engine.add_peer(consumer.instance_id, consumer.address)
    anchors = [consumer.create_anchor() for _ in range(4)]
    live, cancelled, ended, other = await asyncio.gather(
        *(engine.attach_anchor(x.handle) for x in anchors)
    )
    await cancelled.send("before")
    assert await anchors[1].next(timeout=30) == "before"
    anchors[1].cancel()
    async with asyncio.timeout(30):
        await cancelled.wait_cancelled()
    ended.finalize()
    pairs: list[tuple[StreamSender, Any]] = [
        (live, 0),
        (cancelled, 1),
        (ended, 2),
        (live, object()),  # MessagePack cannot hold it
        (other, 4),
        (live, 5),
    ]
    outcome = await engine.send_pass(pairs)
    assert outcome.taken == 3 and outcome.left == ()
    assert sorted(outcome.failed) == [1, 2, 3]
    assert isinstance(outcome.failed[1], ChannelClosed)
    assert "cancelled" in str(outcome.failed[1])
    assert isinstance(outcome.failed[2], ChannelClosed)
    assert isinstance(outcome.failed[3], SerializationError)
    assert not outcome.complete
    await finish_all([live, other])
    assert await drain(anchors[0]) == [0, 5]  # the stream goes on past its bad item
    assert await drain(anchors[2]) == []
    assert await drain(anchors[3]) == [4]
    with pytest.raises(UsageError, match="wait=True"):
        await engine.send_pass([(live, 1)], timeout=1)


async def test_per_stream_and_same_node_senders_take_a_pass_like_mux_senders(
    start_nodes: StartNode,
) -> None:
    consumer = await start_nodes("c")
    engine = await start_nodes("engine")
    engine.add_peer(consumer.instance_id, consumer.address)
    remote = [consumer.create_anchor() for _ in range(3)]
    local = [engine.create_anchor() for _ in range(3)]
    per_stream = await asyncio.gather(
        *(engine.anchors.attach_anchor(x.handle, offer=[PER_STREAM_KEY]) for x in remote)
    )
    assert {s.negotiated_transport() for s in per_stream} == {PER_STREAM_KEY}
    same_node = await asyncio.gather(*(engine.attach_anchor(x.handle) for x in local))
    senders = [*per_stream, *same_node]
    expected: list[list[Any]] = [[] for _ in senders]

    async def produce() -> None:
        for n in range(300):  # well past a local anchor's room: left-overs, then waits
            pairs = [(s, [i, n]) for i, s in enumerate(senders)]
            outcome = await engine.send_pass(pairs, wait=True, timeout=30)
            assert outcome == PassOutcome(len(pairs))
            for i in range(len(senders)):
                expected[i].append([i, n])
        await finish_all(senders)

    producer = asyncio.ensure_future(produce())
    results = await asyncio.gather(*(drain(x) for x in [*remote, *local]))
    await producer
    assert results == expected


async def test_mpsc_producers_on_two_nodes_hand_their_passes_over_each_in_order(
    start_nodes: StartNode,
) -> None:
    consumer = await start_nodes("c")
    engine = await start_nodes("engine")
    engine.add_peer(consumer.instance_id, consumer.address)
    anchor = consumer.create_mpsc_anchor()
    # Two producers over the mux, two on the anchor's own node.
    senders = [
        await (engine if i % 2 else consumer).attach_mpsc_anchor(anchor.handle) for i in range(4)
    ]
    passes = 200

    async def produce(node: Node, mine: list[int]) -> None:
        for n in range(passes):
            outcome = await node.send_pass([(senders[i], [i, n]) for i in mine], wait=True)
            assert outcome == PassOutcome(len(mine))
        for i in mine:
            senders[i].finalize()

    producers = asyncio.gather(produce(engine, [1, 3]), produce(consumer, [0, 2]))
    seen: dict[int, list[int]] = {}
    departed = 0
    async with asyncio.timeout(30):
        async for event in anchor:
            if isinstance(event, MpscItem):
                index, n = event.value
                assert event.sender_id == senders[index].sender_id
                seen.setdefault(index, []).append(n)
            else:
                assert isinstance(event, MpscEvent) and event.kind == "detached"
                departed += 1
                if departed == len(senders):
                    break
    await producers
    assert seen == {i: list(range(passes)) for i in range(len(senders))}
    anchor.cancel()
