"""The messenger mux between real nodes: scale, credit isolation, bad input, negotiation."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.conftest import StartNode
from velomux_quic.ids import StreamAnchorHandle
from velomux_quic.mux import SlotState
from velomux_quic.mux.config import CHAPTER_DISABLE_ENV, Manual, MuxConfig
from velomux_quic.mux.protocol import (
    BatchHeader,
    RecordType,
    credit_body,
    encode_batch,
    open_slot_body,
    slot_id,
)
from velomux_quic.node import Node
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.frames import encode_item


@pytest.fixture
def start_node(start_nodes: StartNode) -> StartNode:
    return start_nodes


async def pair(start_node: StartNode, **options: object) -> tuple[Node, Node]:
    b = await start_node("b", **options)
    a = await start_node("a", **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


def metric(node: Node, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + "$", node.metrics_text(), re.MULTILINE)
    assert match is not None, f"{name}{{{labels}}} not exported"
    return float(match.group(1))


async def drain(anchor: object, timeout: float = 60) -> list[object]:
    async with asyncio.timeout(timeout):
        return [item async for item in anchor]  # type: ignore[attr-defined]


async def test_1024_streams_of_64_records_on_one_lane_exactly_once_in_order(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    streams, records = 1024, 64
    anchors = [b.create_anchor() for _ in range(streams)]
    senders = await asyncio.gather(*(a.attach_anchor(x.handle) for x in anchors))
    assert {s.negotiated_transport() for s in senders} == {MESSENGER_MUX_KEY}

    async def produce() -> None:
        for n in range(records):  # the forward-pass shape: one record per stream per pass
            for index, sender in enumerate(senders):
                await sender.send([index, n])
        for sender in senders:
            sender.finalize()

    producer = asyncio.ensure_future(produce())
    results = await asyncio.gather(*(drain(x, 120) for x in anchors))
    await producer
    assert all(r == [[i, n] for n in range(records)] for i, r in enumerate(results))
    assert [await s.retired() for s in senders[:3]] and all(x.finished for x in anchors)
    for node in (a, b):
        # A slot frees when its terminal is written (producer) and when its close is
        # handled, in the same batch as the terminal the consumer just read (consumer).
        assert metric(node, "velo_streaming_mux_live_slots") == 0
        assert metric(node, "velo_streaming_mux_reader_stall_total") == 0
        assert metric(node, "velo_streaming_mux_credit_lost_total") == 0
    sent = metric(a, "velo_streaming_mux_records_total", 'direction="sent"')
    batches = metric(a, "velo_streaming_mux_batches_total", 'direction="sent"')
    assert sent / batches > 10  # batched: many records per message


async def test_a_consumer_that_stops_reading_holds_only_its_own_sender_at_its_credit_window(
    start_node: StartNode,
) -> None:
    credit = 8
    a, b = await pair(start_node, mux=MuxConfig(initial_credit=credit))
    stalled = b.create_anchor()
    others = [b.create_anchor() for _ in range(63)]
    stuck = await a.attach_anchor(stalled.handle)
    senders = await asyncio.gather(*(a.attach_anchor(x.handle) for x in others))
    for n in range(50):  # well past the window: these queue on the producer
        await stuck.send(n)

    async def produce() -> None:
        for n in range(40):
            for sender in senders:
                await sender.send(n)
        for sender in senders:
            sender.finalize()

    producer = asyncio.ensure_future(produce())
    results = await asyncio.gather(*(drain(x) for x in others))
    await producer
    assert all(r == list(range(40)) for r in results)  # the other streams never waited
    assert metric(a, "velo_streaming_slot_credit_exhausted_total") >= 1
    # The stalled stream's consumer holds exactly its window; the rest wait on the sender.
    assert [await stalled.next() for _ in range(credit)] == list(range(credit))
    stuck.finalize()
    assert await drain(stalled) == list(range(credit, 50))


async def test_manual_flush_writes_a_forward_pass_in_one_batch(start_node: StartNode) -> None:
    a, b = await pair(start_node, mux=MuxConfig(flush_policy=Manual()))
    anchors = [b.create_anchor() for _ in range(100)]
    senders = await asyncio.gather(*(a.attach_anchor(x.handle) for x in anchors))
    before = metric(a, "velo_streaming_mux_batches_total", 'direction="sent"')
    for index, sender in enumerate(senders):
        await sender.send(index)
    a.flush_batch()
    firsts = await asyncio.gather(*(x.next() for x in anchors))
    assert firsts == list(range(100))
    after = metric(a, "velo_streaming_mux_batches_total", 'direction="sent"')
    assert after - before == 1  # one write for the whole pass
    for sender in senders:
        sender.finalize()
    await asyncio.gather(*(drain(x) for x in anchors))


async def test_bad_batches_from_a_peer_cost_only_what_the_chapter_says(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send("before")
    assert await anchor.next() == "before"

    def batch(*records: tuple[int, int, int, bytes], lane: int = 0, epoch: int = 1) -> bytes:
        return encode_batch(BatchHeader(lane, len(records), epoch, 0), list(records))

    good = batch((RecordType.DATA, slot_id(500, 0), 1, encode_item("x")))
    bad_frames = [
        bytes([7]) + good[1:],  # wrong version
        good[:2] + (5).to_bytes(2, "big") + good[4:],  # record_count disagrees with the bytes
        good[:-3],  # a len past the end
        good[:16] + bytes([9]) + good[17:],  # unknown record type
    ]
    for frame in bad_frames:
        a.messenger.send_message_on_lane(b.instance_id, 0, "_stream_batch", frame)
    # Well-formed but wrong: an OpenSlot nobody bound, data for an unopened slot and for a
    # refused one, a stale epoch (lower than the live one), credit for an index never
    # allocated, a batch whose header lane is not its handler's.
    live = {"lane": 1, "epoch": 1 << 62}
    for frame in (
        batch((RecordType.OPEN_SLOT, slot_id(600, 0), 0, open_slot_body(1, 2)), **live),
        batch((RecordType.DATA, slot_id(601, 0), 1, encode_item("x")), **live),
        batch((RecordType.DATA, slot_id(600, 3), 1, encode_item("x")), **live),
        batch((RecordType.DATA, slot_id(600, 0), 1, encode_item("x")), lane=1, epoch=5),
        batch((RecordType.CREDIT_UPDATE, slot_id(9000, 0), 0, credit_body(4)), **live),
        batch((RecordType.DATA, slot_id(600, 0), 1, encode_item("x")), lane=2, epoch=1 << 62),
    ):
        a.messenger.send_message_on_lane(b.instance_id, 0, "_stream_batch.1", frame)
    # A wrong generation for the real stream's live slot (index 0), in the producer's live
    # epoch, on the real lane: dropped and counted, the stream itself untouched.
    assert a.mux is not None
    real_epoch = a.mux.snapshot().egress[(b.instance_id, 0)].epoch
    wrong_generation = batch(
        (RecordType.DATA, slot_id(0, 1), 2, encode_item("x")), epoch=real_epoch
    )
    a.messenger.send_message_on_lane(b.instance_id, 0, "_stream_batch", wrong_generation)
    await sender.send("after")
    sender.finalize()
    assert await drain(anchor) == ["after"]  # the real stream went on untouched
    # Every bad batch rode the same ordered QUIC stream ahead of "after": all were handled.
    assert metric(b, "velo_streaming_mux_malformed_batches_total") == 4
    for reason in ("stale_epoch", "closed_slot", "lane_mismatch", "generation"):
        labels = f'reason="{reason}"'
        assert metric(b, "velo_streaming_mux_records_dropped_total", labels) >= 1, reason
    assert metric(b, "velo_streaming_mux_control_refused_total") >= 1


async def test_the_mux_is_advertised_beside_the_per_stream_path_and_rolls_back(
    start_node: StartNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await pair(start_node)
    assert b.anchors.transport_keys == sorted([MESSENGER_MUX_KEY, PER_STREAM_KEY])
    disabled = await start_node("disabled", mux=MuxConfig(enabled=False))
    assert disabled.anchors.transport_keys == [PER_STREAM_KEY]
    # The chapter's rollback variable, which every node reads (the deprecated project name
    # for it: tests/unit/test_node_config.py).
    monkeypatch.setenv(CHAPTER_DISABLE_ENV, "yes")
    by_env = await start_node("by-env")
    assert by_env.anchors.transport_keys == [PER_STREAM_KEY]
    with pytest.raises(ValueError, match="mux-only"):
        await start_node("broken", mux=MuxConfig(mux_only=True))
    monkeypatch.delenv(CHAPTER_DISABLE_ENV)
    only = await start_node("only", mux=MuxConfig(mux_only=True))
    assert only.anchors.transport_keys == [MESSENGER_MUX_KEY]
    # An old sender (no keys) cannot reach a mux-only node: there is no per-stream listener.
    a.add_peer(only.instance_id, only.address)
    from velomux_quic.errors import AttachRefused

    unreachable = only.create_anchor()
    with pytest.raises(AttachRefused, match="no_common_transport"):
        await a.anchors.attach_anchor(unreachable.handle, offer=[])
    for bad in ({"initial_credit": 0}, {"credit_sweep_interval": 0}):
        with pytest.raises(ValueError):
            MuxConfig(**bad)  # type: ignore[arg-type]


async def test_under_manual_the_end_of_a_stream_needs_no_extra_flush(start_node: StartNode) -> None:
    a, b = await pair(start_node, mux=MuxConfig(flush_policy=Manual()))
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    for i in range(40):  # more than the 32-record credit window
        await sender.send(i)
        a.flush_batch()
    retired = sender.finalize()  # no flush_batch after this one
    assert await drain(anchor, 20) == list(range(40))
    assert (await asyncio.wait_for(retired, 10)).value == "sent"


# -- singletons: records larger than any batch ------------------------------------------------


def hold_pulls(producer: Node) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the producer's answers to pulls of what it staged until the second event is
    set (the first is set once a pull arrived), so a staged item stays in flight for as
    long as the test needs: an event, not a sleep, decides when it lands."""
    pulled, release = asyncio.Event(), asyncio.Event()
    serve = producer.messenger.serve_request

    async def held_pull(peer: object, request: bytes) -> bytes:
        pulled.set()
        await release.wait()
        return await serve(peer, request)  # type: ignore[arg-type]

    producer.messenger.serve_request = held_pull  # type: ignore[method-assign]
    return pulled, release


async def test_a_4_mib_item_mid_stream_arrives_in_order_while_100_other_streams_flow(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    pulled, release = hold_pulls(a)
    big_anchor = b.create_anchor()
    anchors = [b.create_anchor() for _ in range(100)]
    big = await a.attach_anchor(big_anchor.handle)
    senders = await asyncio.gather(*(a.attach_anchor(x.handle) for x in anchors))
    item = bytes(range(256)) * (4 * 1024 * 1024 // 256)  # 4 MiB, over every eager budget
    for n in range(5):
        await big.send(f"before {n}")
    await big.send(item)
    for n in range(10):  # withheld by the fence, then held at ingress behind the gap
        await big.send(f"after {n}")
    retired = big.finalize()
    assert [await big_anchor.next() for _ in range(5)] == [f"before {n}" for n in range(5)]
    async with asyncio.timeout(30):
        await pulled.wait()  # the consumer is pulling the item: it is in flight
    waiting = asyncio.ensure_future(big_anchor.next())

    async def produce() -> None:
        for n in range(20):
            for index, sender in enumerate(senders):
                await sender.send([index, n])
        for sender in senders:
            sender.finalize()

    producer = asyncio.ensure_future(produce())
    results = await asyncio.gather(*(drain(x) for x in anchors))
    await producer
    # Every other stream on the lane ran to its end while the big item was still held.
    assert all(r == [[i, n] for n in range(20)] for i, r in enumerate(results))
    assert not waiting.done()
    release.set()
    async with asyncio.timeout(30):
        assert await waiting == item
    assert await drain(big_anchor) == [f"after {n}" for n in range(10)]
    assert (await asyncio.wait_for(retired, 10)).value == "sent"
    assert metric(a, "velo_streaming_mux_singletons_total", 'path="staged"') == 1
    assert metric(a, "velo_streaming_mux_singletons_total", 'path="inline"') == 0
    assert metric(a, "velo_streaming_mux_fences_raised_total") == 1
    assert metric(b, "velo_streaming_mux_held_records") == 0
    for node in (a, b):
        assert metric(node, "velo_streaming_mux_live_slots") == 0
        assert metric(node, "velo_streaming_mux_epoch_deaths_total") == 0


async def test_two_large_items_in_a_row_on_one_stream_arrive_in_order(
    start_node: StartNode,
) -> None:
    """Both staged, a large item and a smaller one right behind it: the smaller must not be
    pulled first, or it would wait in the stream's hold, bounded at the slot budget (1 MiB)
    far below it, and end the stream."""
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    mib = 1024 * 1024
    first = bytes(range(256)) * (6 * mib // 256)
    second = bytes(reversed(range(256))) * (2 * mib // 256)
    await sender.send("before")
    await sender.send(first)
    await sender.send(second)
    await sender.send("after")
    retired = sender.finalize()
    assert await drain(anchor) == ["before", first, second, "after"]
    assert (await asyncio.wait_for(retired, 10)).value == "sent"
    assert metric(a, "velo_streaming_mux_singletons_total", 'path="staged"') == 2
    assert metric(b, "velo_streaming_mux_hold_overflow_total") == 0
    assert metric(b, "velo_streaming_mux_held_records") == 0


async def test_a_receiver_refuses_an_oversized_item_and_only_that_stream_ends(
    start_node: StartNode,
) -> None:
    from velomux_quic.errors import ChannelClosed, StreamTransportError
    from velomux_quic.messenger.config import MessengerConfig
    from velomux_quic.mux.protocol import BATCH_HEADER_SIZE, RECORD_HEADER_SIZE

    limit = 512 * 1024
    b = await start_node("b", messenger=MessengerConfig(staged_payload_max=limit))
    a = await start_node("a")
    a.add_peer(b.instance_id, b.address)
    doomed_anchor = b.create_anchor()
    anchors = [b.create_anchor() for _ in range(20)]
    doomed = await a.attach_anchor(doomed_anchor.handle)
    senders = await asyncio.gather(*(a.attach_anchor(x.handle) for x in anchors))
    await doomed.send("first")
    assert await doomed_anchor.next() == "first"
    item = b"x" * (1024 * 1024)
    stated = BATCH_HEADER_SIZE + RECORD_HEADER_SIZE + len(encode_item(item))
    await doomed.send(item)

    async def produce() -> None:
        for n in range(30):
            for sender in senders:
                await sender.send(n)
        for sender in senders:
            sender.finalize()

    producer = asyncio.ensure_future(produce())
    with pytest.raises(StreamTransportError) as refused:
        await asyncio.wait_for(doomed_anchor.next(), 30)
    assert str(stated) in str(refused.value) and str(limit) in str(refused.value)
    async with asyncio.timeout(30):
        await doomed.wait_cancelled()  # LifecycleSlot{cancel} reached the producer
    with pytest.raises(ChannelClosed):
        await doomed.send("next")
    results = await asyncio.gather(*(drain(x) for x in anchors))
    await producer
    assert all(r == list(range(30)) for r in results)  # the other streams never noticed
    assert metric(b, "velo_streaming_mux_staged_refusals_total", 'outcome="applied"') == 1
    assert metric(b, "velo_streaming_mux_lifecycle_records_total", 'direction="sent"') == 1
    assert metric(a, "velo_streaming_mux_lifecycle_records_total", 'direction="received"') == 1
    assert metric(a, "velo_streaming_mux_singletons_total", 'path="staged"') == 1
    for node in (a, b):
        assert metric(node, "velo_streaming_mux_live_slots") == 0
        assert metric(node, "velo_streaming_mux_epoch_deaths_total") == 0


async def test_a_staged_item_that_expires_unpulled_ends_its_stream_and_spares_its_index(
    start_node: StartNode,
) -> None:
    """The consumer's pull of a staged item is held past the producer's ``staged_ttl``: the
    payload expires unpulled. The producer's next stream takes the freed slot index while
    the consumer still waits for the lost item; it must be delivered, not refused as a
    collision, and the waiting consumer must end with an error naming the loss as soon as
    its pull fails, not at its watchdog."""
    from velomux_quic.errors import ChannelClosed, StreamTransportError
    from velomux_quic.messenger.config import MessengerConfig

    b = await start_node("b")
    a = await start_node("a", messenger=MessengerConfig(staged_ttl=0.5))
    a.add_peer(b.instance_id, b.address)
    pulled, release = hold_pulls(a)
    expired = asyncio.Event()
    a.messenger.add_staging_listener(
        lambda reason, _: expired.set() if reason == "expired" else None
    )
    lost_anchor = b.create_anchor()
    lost = await a.attach_anchor(lost_anchor.handle)
    await lost.send("first")
    assert await asyncio.wait_for(lost_anchor.next(), 20) == "first"
    await lost.send(b"x" * (4 * 1024 * 1024))  # over every eager budget: staged
    await lost.send("withheld")  # behind the fence, then discarded with the stream
    async with asyncio.timeout(30):
        await pulled.wait()
        await expired.wait()
        await lost.wait_cancelled()  # the producer's stream ended with its record
    with pytest.raises(ChannelClosed):
        await lost.send("late")
    waiting = asyncio.ensure_future(lost_anchor.next())
    for index in range(3):  # the first of them reuses the lost stream's slot index
        anchor = b.create_anchor()
        sender = await a.attach_anchor(anchor.handle)
        await sender.send(index)
        retired = sender.finalize()
        assert await drain(anchor, 20) == [index]
        assert (await asyncio.wait_for(retired, 10)).value == "sent"
    assert not waiting.done()
    release.set()  # the pull reaches the producer after the expiry and fails
    with pytest.raises(StreamTransportError, match="lost"):
        await asyncio.wait_for(waiting, 30)
    assert metric(b, "velo_streaming_mux_records_dropped_total", 'reason="slot_collision"') == 0
    assert metric(b, "velo_streaming_mux_staged_refusals_total", 'outcome="applied"') == 1
    for node in (a, b):
        assert metric(node, "velo_streaming_mux_live_slots") == 0
        assert metric(node, "velo_streaming_mux_epoch_deaths_total") == 0


def routing_session(consumer: Node, handle: StreamAnchorHandle) -> int:
    """The session the consumer's attach answer named for the stream to ``handle``."""
    (bound,) = [s for s in consumer.snapshot().streaming.bound_senders if s.handle == handle]
    return bound.routing_session_id


async def test_lifecycle_stop_then_cancel_reach_the_producer_by_session(
    start_node: StartNode,
) -> None:
    from velomux_quic.errors import ChannelClosed
    from velomux_quic.mux.protocol import LifecycleAction

    a, b = await pair(start_node)
    anchor, bystander = b.create_anchor(), b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    other = await a.attach_anchor(bystander.handle)
    await sender.send(1)
    assert await anchor.next() == 1
    assert b.mux is not None
    session = routing_session(b, anchor.handle)
    b.mux.post_lifecycle(a.instance_id, 0, session, LifecycleAction.STOP)
    async with asyncio.timeout(30):
        await sender.wait_stop_requested()
    assert not sender.is_cancelled
    await sender.send(2)  # a stop leaves the slot open for the remaining output
    assert await anchor.next() == 2
    stale = session ^ (1 << 62)  # a session no stream of this producer has
    assert stale != routing_session(b, bystander.handle)
    b.mux.post_lifecycle(a.instance_id, 0, stale, LifecycleAction.CANCEL)
    b.mux.post_lifecycle(a.instance_id, 0, session, LifecycleAction.CANCEL)
    async with asyncio.timeout(30):
        await sender.wait_cancelled()
    with pytest.raises(ChannelClosed):
        await sender.send(3)
    await other.send("untouched")
    other.finalize()
    assert await drain(bystander) == ["untouched"]
    assert metric(a, "velo_streaming_mux_lifecycle_records_total", 'direction="received"') == 3
    assert metric(b, "velo_streaming_mux_lifecycle_records_total", 'direction="sent"') >= 2
    anchor.cancel()


async def test_an_item_over_the_batch_cap_but_within_the_eager_budget_goes_inline(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    item = b"i" * (100 * 1024)  # over the 60 KiB batch cap, under the 256 KiB eager budget
    for value in ("before", item, "after"):
        await sender.send(value)
    retired = sender.finalize()
    assert await drain(anchor) == ["before", item, "after"]
    assert (await asyncio.wait_for(retired, 10)).value == "sent"
    assert metric(a, "velo_streaming_mux_singletons_total", 'path="inline"') == 1
    assert metric(a, "velo_streaming_mux_singletons_total", 'path="staged"') == 0
    assert metric(a, "velo_streaming_mux_fences_raised_total") == 0


async def test_the_snapshot_follows_a_stream_from_its_attach_to_its_end(
    start_node: StartNode,
) -> None:
    a, b = await pair(start_node)
    assert a.mux is not None and b.mux is not None
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    await sender.send(1)
    assert await anchor.next() == 1
    egress = a.mux.snapshot().egress[(b.instance_id, 0)]
    assert egress.live_slots == 1 and egress.slot_states[SlotState.OPEN] == 1
    assert (egress.queued_records, egress.withheld_records, egress.queued_bytes) == (0, 0, 0)
    consumer = b.mux.snapshot()
    assert consumer.ingress_slots(a.instance_id) == {0: 1}
    assert consumer.pending_binds == 0  # the OpenSlot claimed the attach's bind
    assert consumer.peer_budgets[a.instance_id].limit == MuxConfig().peer_byte_budget
    assert sum(consumer.lane_loads[a.instance_id]) == 1
    b.prebind_anchor(b.create_anchor().handle)
    assert b.mux.snapshot().unclaimed_prebinds == 1
    sender.finalize()
    assert [item async for item in anchor] == []
    assert a.mux.snapshot().egress_slots(b.instance_id) == 0
    after = b.mux.snapshot()
    assert after.ingress_slots(a.instance_id) == {}
    assert after.peer_budgets[a.instance_id].used == 0
    assert consumer.ingress_slots(a.instance_id) == {0: 1}  # an old snapshot never moves
