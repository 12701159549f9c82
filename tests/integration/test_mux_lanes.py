"""Mux lanes between real nodes: placement (keyed, least load), fewer-lane senders,
lane_mismatch, a reset lane touching only its own slots, a dead consumer's health check."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.errors import ChannelClosed, SenderDropped
from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.lanes import splitmix64
from velomux_quic.mux.protocol import BatchHeader, RecordType, encode_batch
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.frames import encode_item
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.streaming.sender import StreamSender
from velomux_quic.transport import TransportConfig


async def pair(start_nodes: StartNode, lanes: int = 8, **options: object) -> tuple[Node, Node]:
    b = await start_nodes("b", transport=TransportConfig(lanes=lanes), **options)
    a = await start_nodes("a", transport=TransportConfig(lanes=lanes), **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


def lane_of(sender: StreamSender) -> int:
    lane = sender.lane
    assert lane is not None, "the stream is not on the mux"
    return lane


def consumer_lanes(b: Node, a: Node) -> Counter[int]:
    """Live ingress slots per arrival lane on the consumer, from ``a``."""
    assert b.mux is not None
    return Counter(b.mux.snapshot().ingress_slots(a.instance_id))


def metric(node: Node, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + "$", node.metrics_text(), re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


async def finish(
    senders: list[StreamSender], anchors: list[StreamAnchor[Any]], records: int
) -> None:
    """Every stream carries its own numbers, in order, exactly once."""

    async def produce(index: int, sender: StreamSender) -> None:
        for n in range(records):
            await sender.send([index, n])
        sender.finalize()

    async def consume(index: int, anchor: StreamAnchor[Any]) -> None:
        assert [item async for item in anchor] == [[index, n] for n in range(records)]

    async with asyncio.timeout(60):
        await asyncio.gather(
            *(produce(i, s) for i, s in enumerate(senders)),
            *(consume(i, x) for i, x in enumerate(anchors)),
        )


async def first_records(senders: list[StreamSender], anchors: list[StreamAnchor[Any]]) -> None:
    """One record through every stream: each slot is open on the consumer afterwards."""
    for index, sender in enumerate(senders):
        await sender.send(["first", index])
    async with asyncio.timeout(20):
        for index, anchor in enumerate(anchors):
            assert await anchor.next() == ["first", index]


async def test_eight_lanes_keyed_and_unkeyed_streams_spread_as_specified(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes, lanes=8)
    # Keyed: lane = splitmix64(key) % 8, on both ends.
    keys = list(range(40))
    keyed = [b.create_anchor() for _ in keys]
    keyed_senders = [
        await a.attach_anchor(x.handle, key=k) for x, k in zip(keyed, keys, strict=True)
    ]
    expected = Counter(splitmix64(k) % 8 for k in keys)
    assert [lane_of(s) for s in keyed_senders] == [splitmix64(k) % 8 for k in keys]
    await first_records(keyed_senders, keyed)
    assert consumer_lanes(b, a) == expected
    # Unkeyed, attached all at once: least load from this sender, unclaimed binds counted,
    # ties to the lowest lane. Top every lane up to the same level, then 8 more go one each.
    level = max(expected.values())
    top_up = sum(level - expected[lane] for lane in range(8)) + 8
    unkeyed = [b.create_anchor() for _ in range(top_up)]
    unkeyed_senders = await asyncio.gather(*(a.attach_anchor(x.handle) for x in unkeyed))
    total = expected + Counter(lane_of(s) for s in unkeyed_senders)
    assert total == Counter(dict.fromkeys(range(8), level + 1))
    await first_records(list(unkeyed_senders), unkeyed)
    assert consumer_lanes(b, a) == total
    await finish(keyed_senders + list(unkeyed_senders), keyed + unkeyed, records=20)
    assert metric(b, "velo_streaming_mux_live_slots") == 0
    assert metric(a, "velo_streaming_mux_live_slots") == 0
    assert metric(b, "velo_streaming_mux_reader_stall_total") == 0


async def test_unkeyed_prebinds_spread_by_node_load_and_one_key_shares_a_lane(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes, lanes=8)
    # Eight streams with one key share its lane...
    key = 12345
    shared = [b.create_anchor() for _ in range(8)]
    shared_senders = [await a.attach_anchor(x.handle, key=key) for x in shared]
    assert {lane_of(s) for s in shared_senders} == {splitmix64(key) % 8}
    # ...and pre-binds, which know no sender, weigh the node's live slots: the next seven
    # go to the seven other lanes, lowest first.
    anchors = [b.create_anchor() for _ in range(7)]
    tickets = [b.prebind_anchor(x.handle) for x in anchors]
    lanes = [t.lane for t in tickets if t is not None]
    assert lanes == sorted(set(range(8)) - {splitmix64(key) % 8})
    keyed_ticket = b.prebind_anchor(b.create_anchor().handle, key=7)
    assert keyed_ticket is not None and keyed_ticket.lane == splitmix64(7) % 8
    opened = [
        await a.open_anchor_stream(x.handle, t) for x, t in zip(anchors, tickets, strict=True) if t
    ]
    assert [lane_of(s) for s in opened] == lanes
    await finish(shared_senders + opened, shared + anchors, records=10)


async def test_a_sender_with_fewer_lanes_uses_the_chosen_lane_modulo_its_count(
    start_nodes: StartNode,
) -> None:
    b = await start_nodes("b", transport=TransportConfig(lanes=8))
    a = await start_nodes("a", transport=TransportConfig(lanes=2))
    a.add_peer(b.instance_id, b.address)
    anchors = [b.create_anchor() for _ in range(8)]
    senders = [await a.attach_anchor(x.handle) for x in anchors]
    # The receiver spread the streams over its 8 lanes (load counted on the chosen lane,
    # not the arrival lane); the sender folds them onto its 2.
    assert sorted(lane_of(s) for s in senders) == [0, 0, 0, 0, 1, 1, 1, 1]
    await first_records(senders, anchors)
    assert consumer_lanes(b, a) == Counter({0: 4, 1: 4})
    assert b.mux is not None
    assert b.mux.snapshot().lane_loads[a.instance_id] == (1,) * 8
    await finish(senders, anchors, records=10)


async def test_a_batch_for_lane_one_sent_on_lane_two_is_dropped_and_counted(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes, lanes=4)
    key = next(k for k in range(100) if splitmix64(k) % 4 == 2)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle, key=key)  # a real stream on lane 2
    assert lane_of(sender) == 2
    await sender.send("before")
    assert await asyncio.wait_for(anchor.next(), 20) == "before"
    header = BatchHeader(lane=1, record_count=1, peer_epoch=1 << 62, batch_seq=0)
    body = encode_batch(header, [(RecordType.DATA, 0, 1, encode_item("x"))])
    a.messenger.send_message_on_lane(b.instance_id, 2, "_stream_batch.2", body)
    # The real stream's next record rides the same ordered lane behind the bad batch.
    await sender.send("after")
    assert await asyncio.wait_for(anchor.next(), 20) == "after"
    labels = 'reason="lane_mismatch"'
    assert metric(b, "velo_streaming_mux_records_dropped_total", labels) == 1
    await sender.send("last")
    sender.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == ["last"]


async def test_a_reset_lane_ends_only_its_own_slots(start_nodes: StartNode) -> None:
    a, b = await pair(start_nodes, lanes=4)
    anchors = [b.create_anchor() for _ in range(8)]
    senders = [
        await a.attach_anchor(x.handle, key=key) for x, key in zip(anchors, range(8), strict=True)
    ]
    by_lane = [lane_of(s) for s in senders]
    cut = by_lane[0]
    for index, sender in enumerate(senders):
        await sender.send(index)
    for index, anchor in enumerate(anchors):
        assert await asyncio.wait_for(anchor.next(), 20) == index
    a.messenger.transport.reset_lane(b.instance_id, cut)
    for index, (sender, anchor) in enumerate(zip(senders, anchors, strict=True)):
        if by_lane[index] == cut:
            with pytest.raises(SenderDropped):
                await asyncio.wait_for(anchor.next(), 20)
        else:
            await sender.send("more")
            sender.finalize()
            async with asyncio.timeout(20):
                assert [item async for item in anchor] == ["more"]


@pytest.mark.timeout(90)
async def test_a_killed_consumer_fails_the_health_check_and_releases_a_starved_producer(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    """The consumer's process dies (SIGKILL: no CONNECTION_CLOSE) while the producer holds no
    credit, so nothing the producer does would ever fail: only the health check can end its
    streams, and it must, within about one interval plus one timeout."""
    make_credentials("consumer").save(tmp_path / "consumer")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.procs.consumer",
        "--credentials", str(tmp_path / "consumer"), "--anchors", "4",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        assert process.stdout is not None
        hello = json.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        fast = MuxConfig(initial_credit=2, health_check_interval=0.3, health_check_timeout=0.5)
        a = await start_nodes("a", mux=fast, streaming=StreamingConfig(heartbeat_interval=30))
        a.add_peer(InstanceId.parse(hello["instance"]), (hello["host"], hello["port"]))
        handles = [StreamAnchorHandle.pack(h["hi"], h["lo"]) for h in hello["handles"]]
        senders = [await a.attach_anchor(handle) for handle in handles]
        for sender in senders:
            for n in range(2):  # spend the whole window; nobody reads it
                await sender.send(n)
        assert metric(a, "velo_streaming_slot_credit_exhausted_total") == 0
        process.send_signal(signal.SIGKILL)
        await process.wait()
        for sender in senders:
            async with asyncio.timeout(20):
                with pytest.raises(ChannelClosed):
                    while True:  # queues until the slot's byte budget is full, then waits
                        await sender.send("never")
            assert sender.is_cancelled
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
    assert metric(a, "velo_streaming_mux_health_check_failures_total") == 1
    assert metric(a, "velo_streaming_mux_live_slots") == 0


async def test_async_open_ack_returns_before_admission_and_keeps_order(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes, lanes=2, mux=MuxConfig(async_open_ack=True))
    anchors = [b.create_anchor() for _ in range(32)]
    senders = [await a.attach_anchor(x.handle) for x in anchors]
    # The OpenSlot went out in a flush of its own before connect returned; the records
    # sent at once queue behind it on the lane, so every stream arrives whole and in order.
    await finish(senders, anchors, records=10)
    assert metric(b, "velo_streaming_mux_records_dropped_total", 'reason="closed_slot"') == 0


async def test_evicting_a_peer_ends_the_streams_produced_to_it(start_nodes: StartNode) -> None:
    a, b = await pair(start_nodes, lanes=2)
    c = await start_nodes("c")
    a.add_peer(c.instance_id, c.address)
    anchors = [b.create_anchor() for _ in range(4)]
    senders = [await a.attach_anchor(x.handle) for x in anchors]
    other_anchor = c.create_anchor()
    other = await a.attach_anchor(other_anchor.handle)
    a.remove_peer(b.instance_id)  # discovery dropped it, or the application did
    for sender in senders:
        assert sender.is_cancelled
        with pytest.raises(ChannelClosed):
            await sender.send("after eviction")
    await other.send("unaffected")  # streams to other peers go on
    other.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in other_anchor] == ["unaffected"]
    assert metric(a, "velo_streaming_mux_epoch_deaths_total") >= 1
