"""Zero-RTT streams over the mux between real nodes: pre-bind, ticket, open, and every
rule of the pre-bind (adopt, refuse after claim, key mismatch, same-worker release, a
dropped request, cancel and stop reaching an idle producer, detach, the accept window)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.errors import (
    AlreadyAttached,
    AttachRefused,
    ChannelClosed,
    SenderDropped,
    StreamCancelled,
    TicketError,
)
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY, StreamOpenTicket
from velomux_quic.streaming.sender import StreamSender


async def pair(start_nodes: StartNode, **options: object) -> tuple[Node, Node]:
    b = await start_nodes("b", **options)
    a = await start_nodes("a", **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


def metric(node: Node, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + "$", node.metrics_text(), re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


def ticket_of(node: Node, handle: Any) -> StreamOpenTicket:
    ticket = node.prebind_anchor(handle)
    return StreamOpenTicket.decode(ticket.encode())  # it travels in the app's envelope


async def test_a_ticket_opens_5000_streams_with_no_attach_message(start_nodes: StartNode) -> None:
    a, b = await pair(start_nodes)
    served_before = b.anchors.snapshot().attaches_served

    async def one(index: int) -> None:
        anchor = b.create_anchor()
        ticket = ticket_of(b, anchor.handle)
        sender = await a.open_anchor_stream(anchor.handle, ticket)
        assert sender.negotiated_transport() == MESSENGER_MUX_KEY
        assert sender.credit == ticket.initial_credit
        await sender.send(index)
        sender.finalize()
        assert [item async for item in anchor] == [index]

    async with asyncio.timeout(120):
        for start in range(0, 5000, 100):
            await asyncio.gather(*(one(i) for i in range(start, start + 100)))
    assert b.anchors.snapshot().attaches_served == served_before  # no attach handler ran
    assert metric(b, "velo_streaming_mux_live_slots") == 0
    assert metric(b, "velo_streaming_mux_unclaimed_binds") == 0
    assert metric(b, "velo_streaming_mux_records_sent_total", 'record_type="credit_update"') >= 0
    labels = 'operation="prebind",outcome="success",transport_scheme="messenger-mux-v2"'
    assert metric(b, "velo_streaming_anchor_operations_total", labels) == 5000


async def test_the_accept_window_reaps_an_unclaimed_ticket(start_nodes: StartNode) -> None:
    b = await start_nodes("b", mux=MuxConfig(prebind_timeout=0.3, credit_sweep_interval=0.05))
    anchor = b.create_anchor()
    assert ticket_of(b, anchor.handle).lane == 0
    assert metric(b, "velo_streaming_mux_unclaimed_binds") == 1
    with pytest.raises(SenderDropped):
        async with asyncio.timeout(10):
            await anchor.next()
    assert metric(b, "velo_streaming_unclaimed_bind_reaped_total") == 1
    assert metric(b, "velo_streaming_mux_unclaimed_binds") == 0


async def test_prebind_refusals_raise_a_ticket_error_that_says_why(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes)
    with pytest.raises(TicketError, match=r"MPSC anchor.*attach_mpsc_anchor"):
        b.prebind_anchor(b.create_mpsc_anchor().handle)
    with pytest.raises(TicketError, match="no such live anchor on this node"):
        b.prebind_anchor(a.create_anchor().handle)  # another node's handle
    anchor = b.create_anchor()
    b.prebind_anchor(anchor.handle)
    with pytest.raises(TicketError, match="already pre-bound"):
        b.prebind_anchor(anchor.handle)
    attached = b.create_anchor()
    await a.attach_anchor(attached.handle)
    with pytest.raises(TicketError, match="already has a sender"):
        b.prebind_anchor(attached.handle)
    gone = b.create_anchor()
    gone.cancel()
    with pytest.raises(TicketError, match="no such live anchor"):
        b.prebind_anchor(gone.handle)
    no_mux = await start_nodes("plain", mux=MuxConfig(enabled=False))
    with pytest.raises(TicketError, match=r"no mux.*enabled"):
        no_mux.prebind_anchor(no_mux.create_anchor().handle)
    labels = 'operation="prebind",outcome="error",transport_scheme="none"'
    assert metric(b, "velo_streaming_anchor_operations_total", labels) == 5
    assert metric(no_mux, "velo_streaming_anchor_operations_total", labels) == 1
    with pytest.raises(AttachRefused, match="minted on this node"):
        await b.open_anchor_stream(anchor.handle, ticket_of(b, b.create_anchor().handle))


async def test_an_attach_adopts_an_unclaimed_prebind_and_is_refused_after_a_claim(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes)
    c = await start_nodes("c")
    c.add_peer(b.instance_id, b.address)
    anchor = b.create_anchor()
    ticket = ticket_of(b, anchor.handle)
    sender = await a.attach_anchor(anchor.handle)  # adopts: same slot, same session
    assert sender.negotiated_transport() == MESSENGER_MUX_KEY
    bound = [s for s in b.anchors.snapshot().bound_senders if s.handle == anchor.handle]
    assert [(s.node, s.routing_session_id) for s in bound] == [
        (a.instance_id, ticket.routing_session_id)
    ]
    await sender.send("adopted")
    sender.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == ["adopted"]

    claimed = b.create_anchor()
    opened = await a.open_anchor_stream(claimed.handle, ticket_of(b, claimed.handle))
    await opened.send("claimed")
    assert await asyncio.wait_for(claimed.next(), 20) == "claimed"
    with pytest.raises(AlreadyAttached):
        await c.attach_anchor(claimed.handle)
    with pytest.raises(AlreadyAttached):
        await b.attach_anchor(claimed.handle)  # same-worker, over a claimed pre-bind
    opened.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in claimed] == []


async def test_a_sender_without_the_mux_is_refused_and_releases_the_prebind(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    ticket_of(b, anchor.handle)
    with pytest.raises(AttachRefused, match="pre-bind is released"):
        await a.anchors.attach_anchor(anchor.handle, offer=[PER_STREAM_KEY])
    assert metric(b, "velo_streaming_mux_unclaimed_binds") == 0
    retry = await a.anchors.attach_anchor(anchor.handle, offer=[PER_STREAM_KEY])
    assert retry.negotiated_transport() == PER_STREAM_KEY
    await retry.send("per-stream")
    retry.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == ["per-stream"]


async def test_a_same_worker_attach_releases_the_prebind(start_nodes: StartNode) -> None:
    b = await start_nodes("b")
    anchor = b.create_anchor()
    ticket_of(b, anchor.handle)
    sender = await b.attach_anchor(anchor.handle)
    assert sender.negotiated_transport() is None
    assert metric(b, "velo_streaming_mux_unclaimed_binds") == 0
    await sender.send("local")
    sender.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == ["local"]


async def test_a_dropped_request_gives_the_bind_back_and_the_late_ticket_fails(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    ticket = ticket_of(b, anchor.handle)
    handle = anchor.handle
    anchor.cancel()
    assert metric(b, "velo_streaming_mux_unclaimed_binds") == 0
    sender = await a.open_anchor_stream(handle, ticket)  # the OpenSlot finds no bind
    async with asyncio.timeout(20):
        await sender.wait_cancelled()  # CloseSlot{UnknownSlot} reached the producer
    with pytest.raises(ChannelClosed):
        await sender.send("nobody")


async def wait_idle_then(sender: StreamSender, anchor: Any, action: str) -> None:
    await sender.send("one")
    assert await asyncio.wait_for(anchor.next(), 20) == "one"
    getattr(anchor, action)()


async def test_cancel_reaches_an_idle_ticket_producer(start_nodes: StartNode) -> None:
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    sender = await a.open_anchor_stream(anchor.handle, ticket_of(b, anchor.handle))
    await wait_idle_then(sender, anchor, "cancel")
    async with asyncio.timeout(20):
        await sender.wait_cancelled()  # the producer sent nothing more to learn of it
    assert sender.is_stop_requested
    with pytest.raises(ChannelClosed):
        await sender.send("late")
    with pytest.raises(StreamCancelled):
        await anchor.next()


@pytest.mark.parametrize("opening", ["ticket", "attach"])
async def test_the_stream_after_a_cancelled_one_reuses_its_slot_and_is_delivered(
    start_nodes: StartNode, opening: str
) -> None:
    """A consumer's cancel frees the producer's slot index at once, and the next stream
    to that consumer takes the index before the consumer's table has retired the old slot
    (its visit held back here for 30 s): that stream is delivered, never refused."""
    a, b = await pair(start_nodes, mux=MuxConfig(drain_visit_floor=30.0))
    for index in range(6):
        anchor = b.create_anchor()
        if opening == "ticket":
            sender = await a.open_anchor_stream(anchor.handle, ticket_of(b, anchor.handle))
        else:
            sender = await a.attach_anchor(anchor.handle)
        await sender.send(index)
        async with asyncio.timeout(20):
            assert await anchor.next() == index
        anchor.cancel()
        async with asyncio.timeout(20):
            await sender.wait_cancelled()
    assert metric(b, "velo_streaming_mux_records_dropped_total", 'reason="slot_collision"') == 0
    assert metric(b, "velo_streaming_mux_refused_slots") == 0


async def test_stop_reaches_an_idle_ticket_producer_which_then_finishes(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    sender = await a.open_anchor_stream(anchor.handle, ticket_of(b, anchor.handle))
    await wait_idle_then(sender, anchor, "request_stop")
    async with asyncio.timeout(20):
        await sender.wait_stop_requested()
    assert not sender.is_cancelled
    await sender.send("last words")
    sender.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == ["last words"]


async def test_a_detached_ticket_sender_gives_the_slot_back(start_nodes: StartNode) -> None:
    a, b = await pair(start_nodes)
    c = await start_nodes("c")
    c.add_peer(b.instance_id, b.address)
    anchor = b.create_anchor()
    first = await a.open_anchor_stream(anchor.handle, ticket_of(b, anchor.handle))
    await first.send(1)
    first.detach()
    handle = first.handle
    second = await c.attach_anchor(handle)
    await second.send(2)
    second.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == [1, 2]
    assert metric(b, "velo_streaming_mux_live_slots") == 0


async def test_a_ticket_opens_one_stream_and_its_reuse_is_refused(
    start_nodes: StartNode,
) -> None:
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    ticket = ticket_of(b, anchor.handle)
    sender = await a.open_anchor_stream(anchor.handle, ticket)
    with pytest.raises(TicketError, match="already opened a stream"):
        await a.open_anchor_stream(anchor.handle, StreamOpenTicket.decode(ticket.encode()))
    await sender.send("first and only")  # the first stream is untouched by the refusal
    sender.finalize()
    async with asyncio.timeout(20):
        assert [item async for item in anchor] == ["first and only"]


async def test_a_ticket_opens_to_each_consumer_that_dialed_in_even_a_later_one(
    start_nodes: StartNode,
) -> None:
    """The producer has no record of its consumers: each dialed it. It finds each by its
    handle's WorkerId among the transport's peers, a consumer that dialed in after the
    first opens too, and a handle of a node it never met is refused."""
    producer = await start_nodes("producer")

    async def dial_in(name: str) -> Node:
        consumer = await start_nodes(name)
        consumer.add_peer(producer.instance_id, producer.address)
        await consumer.connect(producer.instance_id)
        return consumer

    async def one(consumer: Node, item: int) -> None:
        anchor = consumer.create_anchor()
        ticket = ticket_of(consumer, anchor.handle)
        sender = await producer.open_anchor_stream(anchor.handle, ticket)
        await sender.send(item)
        sender.finalize()
        assert [got async for got in anchor] == [item]

    async with asyncio.timeout(60):
        consumers = [await dial_in("consumer-0"), await dial_in("consumer-1")]
        for index, consumer in enumerate(consumers):
            await one(consumer, index)
        consumers.append(await dial_in("consumer-2"))
        for round_ in range(1, 3):
            for index, consumer in enumerate(consumers):
                await one(consumer, 10 * round_ + index)
        stranger = await start_nodes("stranger")  # never dialed the producer
        anchor = stranger.create_anchor()
        with pytest.raises(AttachRefused, match="no known node has WorkerId"):
            await producer.open_anchor_stream(anchor.handle, ticket_of(stranger, anchor.handle))
        await one(consumers[0], 100)
