"""The consumer's read path, sans-IO: an Inbox's order rules and a StreamAnchor's readers.

The inbox keeps an ordered inbox's first feed at hand (one read per record without a
lookup) and the anchor reads the inbox inline; these tests pin the edge cases of both:
the feed that is read changes exactly when the order rules say, and ``__anext__``,
``take_ready`` and ``batches`` give the same stream and the same endings.
"""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from velomux_quic.errors import DeserializationError, ReadTimeout, SenderDropped, SenderError
from velomux_quic.ids import StreamAnchorHandle
from velomux_quic.streaming.anchor import AnchorEntry, StreamAnchor
from velomux_quic.streaming.frames import (
    DETACHED,
    DROPPED,
    FINALIZED,
    HEARTBEAT,
    encode_item,
    encode_sender_error,
)
from velomux_quic.streaming.inbox import Inbox


class ListFeed:
    """A Feed over a list (the transport's per-stream buffer, as a test double)."""

    def __init__(self, *bodies: bytes, ended: bool = False) -> None:
        self.bodies = deque(bodies)
        self.ended = ended
        self.withdrawn = False

    def take(self) -> bytes | None:
        return self.bodies.popleft() if self.bodies else None

    @property
    def exhausted(self) -> bool:
        return self.withdrawn or (self.ended and not self.bodies)

    def withdraw(self) -> None:
        self.withdrawn = True
        self.bodies.clear()


def drain(inbox: Inbox) -> list[tuple[int, bytes]]:
    out = []
    while (item := inbox.take()) is not None:
        out.append(item)
    return out


# -- Inbox ---------------------------------------------------------------------------------


def test_an_ordered_inbox_reads_its_first_feed_until_it_is_withdrawn() -> None:
    inbox = Inbox(ordered=True)
    first, second = ListFeed(b"a1", b"a2"), ListFeed(b"b1")
    inbox.install_feed(first, 1)
    inbox.install_feed(second, 2)
    assert inbox.take() == (1, b"a1")
    assert inbox.take() == (1, b"a2")
    assert inbox.take() is None  # the second sender waits behind the first
    inbox.withdraw_feed(1)
    assert first.withdrawn
    assert drain(inbox) == [(2, b"b1")]
    inbox.withdraw_feed(2)
    assert inbox.take() is None and inbox.feeds() == []


def test_reinstalling_the_first_senders_feed_reads_the_new_feed() -> None:
    inbox = Inbox(ordered=True)
    inbox.install_feed(ListFeed(b"old"), 0)
    assert inbox.take() == (0, b"old")
    inbox.install_feed(ListFeed(b"new"), 0)
    assert drain(inbox) == [(0, b"new")]


def test_a_feed_installed_after_the_last_was_withdrawn_is_read() -> None:
    inbox = Inbox(ordered=True)
    inbox.install_feed(ListFeed(b"x"), 3)
    inbox.withdraw_feed(3)
    inbox.install_feed(ListFeed(b"y"), 4)
    assert drain(inbox) == [(4, b"y")]


def test_an_unordered_inbox_reads_its_feeds_round_robin() -> None:
    inbox = Inbox()
    inbox.install_feed(ListFeed(b"a1", b"a2"), 1)
    inbox.install_feed(ListFeed(b"b1", b"b2"), 2)
    assert drain(inbox) == [(1, b"a1"), (2, b"b1"), (1, b"a2"), (2, b"b2")]


def test_channel_records_before_a_feed_come_first_then_feeds_then_the_channel() -> None:
    inbox = Inbox(ordered=True)
    assert inbox.try_put(b"early")
    inbox.install_feed(ListFeed(b"fed"), 0)
    inbox.inject(b"late")
    assert drain(inbox) == [(0, b"early"), (0, b"fed"), (0, b"late")]


def test_first_feed_is_offered_only_when_take_would_read_it_first() -> None:
    ordered = Inbox(ordered=True)
    assert ordered.first_feed() is None  # no feed yet
    assert ordered.try_put(b"owed")
    feed = ListFeed(b"fed")
    ordered.install_feed(feed, 5)
    assert ordered.first_feed() is None  # the channel record before the feed comes first
    assert ordered.take() == (0, b"owed")  # put by sender 0 (the default)
    assert ordered.first_feed() == (5, feed)
    ordered.push_front(5, b"given back")
    assert ordered.first_feed() is None  # what the reader gave back is read next
    unordered = Inbox()
    unordered.install_feed(ListFeed(b"x"), 1)
    assert unordered.first_feed() is None  # round robin: take decides


def test_closing_withdraws_every_feed() -> None:
    inbox = Inbox(ordered=True)
    feed = ListFeed(b"unread")
    inbox.install_feed(feed, 0)
    inbox.close()
    assert feed.withdrawn and inbox.take() is None


# -- StreamAnchor ------------------------------------------------------------------------


class Owner:
    """An AnchorOwner that records the calls and finishes the entry as the manager does."""

    def __init__(self, entry: AnchorEntry) -> None:
        self.entry = entry
        self.calls: list[tuple[str, int]] = []

    def anchor_dropped(self, local_id: int) -> None:
        self.calls.append(("dropped", local_id))

    def cancel_anchor(self, local_id: int) -> None:
        self.calls.append(("cancel", local_id))

    def request_stop(self, local_id: int) -> None:
        self.calls.append(("stop", local_id))

    def reader_ended(self, local_id: int) -> None:
        self.calls.append(("finish", local_id))
        self.entry.finished = True
        self.entry.inbox.close()

    def sender_detached(self, local_id: int, sender_id: int) -> None:
        self.calls.append(("detached", sender_id))

    def feed_exhausted(self, entry: AnchorEntry, sender_id: int | None) -> bool:
        return False


def anchor_over(*bodies: bytes) -> tuple[StreamAnchor[object], Owner]:
    inbox = Inbox(ordered=True)
    entry = AnchorEntry(7, StreamAnchorHandle.pack(1, 7), False, inbox, 1.0)
    owner = Owner(entry)
    inbox.install_feed(ListFeed(*bodies), 0)
    return StreamAnchor(owner, entry), owner


async def read_all(anchor: StreamAnchor[object]) -> list[object]:
    return [item async for item in anchor]


@pytest.mark.timeout(10)
async def test_iteration_skips_heartbeats_and_detaches_and_ends_on_finalized() -> None:
    anchor, owner = anchor_over(
        encode_item(1), HEARTBEAT, encode_item(2), DETACHED, encode_item(3), FINALIZED
    )
    assert await read_all(anchor) == [1, 2, 3]
    assert owner.calls == [("detached", 0), ("finish", 7)]
    assert anchor.finished


@pytest.mark.timeout(10)
async def test_take_ready_respects_its_limit_and_stops_before_a_sentinel() -> None:
    anchor, _ = anchor_over(
        encode_item(1), encode_item(2), HEARTBEAT, encode_item(3), encode_sender_error("soft"),
        encode_item(4), DROPPED,
    )  # fmt: skip
    assert await anchor.take_ready(2) == [1, 2]
    assert await anchor.take_ready() == [3]  # the heartbeat is skipped, the error waits
    with pytest.raises(SenderError, match="soft"):
        await anchor.take_ready()
    assert await anchor.take_ready() == [4]
    with pytest.raises(SenderDropped):
        await anchor.take_ready()


@pytest.mark.timeout(10)
async def test_take_ready_reads_the_channel_behind_the_feed_within_its_limit() -> None:
    anchor, owner = anchor_over(encode_item(1), encode_item(2))
    inbox = owner.entry.inbox
    inbox.inject(encode_item(3))  # a channel record behind the feed's burst
    inbox.inject(FINALIZED)
    assert await anchor.take_ready(3) == [1, 2, 3]
    with pytest.raises(StopAsyncIteration):
        await anchor.take_ready()
    assert ("finish", 7) in owner.calls


@pytest.mark.timeout(10)
async def test_batches_yield_the_items_before_an_undecodable_record_then_raise() -> None:
    anchor, owner = anchor_over(encode_item("a"), encode_item("b"), b"\xc1")
    got: list[list[object]] = []
    with pytest.raises(DeserializationError):
        async for items in anchor.batches():
            got.append(items)
    assert got == [["a", "b"]] and ("finish", 7) in owner.calls


@pytest.mark.timeout(10)
async def test_a_reader_waiting_on_an_empty_feed_is_woken_by_a_record() -> None:
    anchor, owner = anchor_over()
    inbox = owner.entry.inbox
    ((_, feed),) = inbox.feeds()
    assert isinstance(feed, ListFeed)
    reader = asyncio.ensure_future(anchor.next())
    await asyncio.sleep(0)  # one turn: the reader finds the feed empty and waits
    assert not reader.done()
    feed.bodies.append(encode_item("late"))
    inbox.wake()  # what the transport's buffer does on its first record
    assert await asyncio.wait_for(reader, 5) == "late"


@pytest.mark.timeout(10)
async def test_a_read_that_timed_out_leaves_the_next_read_able_to_wait_and_wake() -> None:
    anchor, owner = anchor_over()
    inbox = owner.entry.inbox
    ((_, feed),) = inbox.feeds()
    assert isinstance(feed, ListFeed)
    with pytest.raises(ReadTimeout):
        await anchor.next(timeout=0.01)  # its waiter is cancelled with it
    reader = asyncio.ensure_future(anchor.next())
    await asyncio.sleep(0)
    feed.bodies.append(encode_item("after"))
    inbox.wake()
    assert await asyncio.wait_for(reader, 5) == "after"


@pytest.mark.timeout(10)
async def test_an_item_read_by_await_or_stepped_by_hand_is_the_same() -> None:
    """``await`` resumes the read through the interpreter's send path (the compiled
    awaitable answers it from a C slot, with no StopIteration); an interpreter that does
    not use that slot (a tracing one, a newer one) steps it with ``send`` and ``__next__``
    instead, and StopIteration carries the item: both give the same items and waits."""
    anchor, owner = anchor_over(encode_item([1, 2]), encode_item(None), encode_item("c"))
    assert await anchor.__anext__() == [1, 2]
    with pytest.raises(StopIteration) as stop:
        anchor.__anext__().__await__().send(None)
    assert stop.value.value is None
    with pytest.raises(StopIteration) as stop:
        next(anchor.__anext__().__await__())
    assert stop.value.value == "c"
    ((_, feed),) = owner.entry.inbox.feeds()
    assert isinstance(feed, ListFeed)
    step = anchor.__anext__().__await__()
    waiter = step.send(None)  # nothing to read: the inbox's waiter, as an await yields it
    assert isinstance(waiter, asyncio.Future) and not waiter.done()
    feed.bodies.append(encode_item(("t", 3)))
    owner.entry.inbox.wake()
    assert waiter.done()
    with pytest.raises(StopIteration) as stop:
        step.send(None)
    assert stop.value.value == ["t", 3]
    feed.bodies.append(encode_item({"k": 1}))
    assert await anchor.__anext__() == {"k": 1}
