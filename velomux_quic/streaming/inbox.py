"""An anchor's inbox: its own bounded channel plus the feeds it reads directly.

The chapter's rule is that a consumer reads the transport's per-stream buffer itself
(a *feed*), ahead of its own channel, with no task in between: one hop fewer per record,
and the buffer's consumption is what grants the producer credit. The channel still exists
for the other writers (a same-worker sender, the watchdog's ``Dropped``, control handlers),
which is why credit can never be issued against it.

Order rules:

* records already in the channel when a feed is installed are read first (a re-attached
  sender's records never overtake the ``Detached`` of the sender before it);
* after that, feeds are read before the channel, so a sentinel injected into the channel
  (the watchdog's ``Dropped``) never jumps ahead of a record the consumer can still read;
* several feeds (an MPSC anchor's senders) are read round-robin, each in its own order;
  a single-sender anchor (``ordered=True``) reads its feeds one after another instead, so
  a sender that attached after a detach is read only once its predecessor is drained.

Every item is ``(sender_id, body)``; single-sender anchors use sender id 0.

The reader's ``take`` and ``wait`` run once per record, so this module is one of the record
path's compiled modules (velomux_quic.recordpath): where built, this same file is compiled,
with the C types of ``inbox.pxd``; otherwise it runs as it is.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..errors import ChannelClosed

__all__ = ["Feed", "Inbox"]


class Feed(Protocol):
    """A buffer an anchor reads directly (the per-stream receiver, later the mux slot)."""

    def take(self) -> bytes | None:
        """The next record, accounting for its consumption; None when empty right now."""

    @property
    def exhausted(self) -> bool:
        """No record is left and none will come (the producer side ended)."""

    def withdraw(self) -> None:
        """The anchor drops this feed; unread records in it are discarded."""


Item = tuple[int, bytes]


class Inbox:
    """See the module docstring. Not thread-safe: everything runs on the event loop."""

    __slots__ = (
        "_barrier",
        "_capacity",
        "_channel",
        "_closed",
        "_create_future",
        "_feed_order",
        "_feeds",
        "_head",
        "_head_id",
        "_head_take",
        "_next_feed",
        "_ordered",
        "_space",
        "_waiter",
        "reading",
    )

    def __init__(self, capacity: int = 256, *, ordered: bool = False) -> None:
        self._capacity = capacity
        self._ordered = ordered
        self._channel: deque[Item] = deque()
        self._feeds: dict[int, Feed] = {}
        self._feed_order: list[int] = []
        self._head: Feed | None = None
        """An ordered inbox's feed read now (its first), kept so :meth:`take` reads it
        without a lookup: one call per record. None when unordered or without feeds."""
        self._head_id = 0
        self._head_take: Callable[[], bytes | None] | None = None
        """``_head.take``, bound once per head: compiled, a method called by name is looked
        up on the feed's type at every call, and this one runs once per record."""
        self._next_feed = 0
        self._barrier = 0
        self._waiter: asyncio.Future[None] | None = None
        self._create_future: Callable[[], asyncio.Future[None]] | None = None
        """The ``create_future`` of the loop the reader waits on, bound at its first wait
        (see :meth:`wait`)."""
        self._space: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self.reading = False
        """Its anchor's one reader is reading: a read holds it from the moment it does more
        than take a ready item, across every wait, and a second reader is refused. Kept
        here, a C field where compiled, because the read checks it once per item."""

    # -- writers -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def space(self) -> int:
        """Records the channel takes now without waiting (0 when full or closed)."""
        if self._closed:
            return 0
        free = self._capacity - len(self._channel)
        return free if free > 0 else 0

    def try_put(self, body: bytes, sender_id: int = 0) -> bool:
        """Put without waiting; False when the channel is full or closed."""
        if self._closed or len(self._channel) >= self._capacity:
            return False
        self._channel.append((sender_id, body))
        self.wake()
        return True

    async def put(self, body: bytes, sender_id: int = 0) -> None:
        """Put, waiting for space; raises ChannelClosed once the inbox is closed."""
        while not self.try_put(body, sender_id):
            if self._closed:
                raise ChannelClosed("the anchor is gone")
            space: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._space.append(space)
            try:
                await space
            finally:
                if not space.done():
                    space.cancel()

    def inject(self, body: bytes, sender_id: int = 0) -> None:
        """Put a sentinel even past capacity: a terminal must never be lost to a full channel."""
        if self._closed:
            return
        self._channel.append((sender_id, body))
        self.wake()

    def install_feed(self, feed: Feed, sender_id: int = 0) -> None:
        self._barrier = len(self._channel)
        self._feeds[sender_id] = feed
        if sender_id not in self._feed_order:
            self._feed_order.append(sender_id)
        self._find_head()
        self.wake()

    def withdraw_feed(self, sender_id: int = 0) -> None:
        feed = self._feeds.pop(sender_id, None)
        if feed is not None:
            self._feed_order.remove(sender_id)
            self._find_head()
            feed.withdraw()
            self.wake()

    def _find_head(self) -> None:
        order = self._feed_order
        if self._ordered and order:
            self._head_id = order[0]
            head = self._head = self._feeds[order[0]]
            self._head_take = head.take
        else:
            self._head = None
            self._head_take = None

    def feed(self, sender_id: int = 0) -> Feed | None:
        return self._feeds.get(sender_id)

    # -- the reader ----------------------------------------------------------------------

    def take(self) -> Item | None:
        channel = self._channel
        if self._barrier and channel:
            self._barrier -= 1
            return self._taken(channel.popleft())
        take = self._head_take
        if take is not None:  # ordered: the first feed only
            body = take()
            if body is not None:
                return self._head_id, body
        elif order := self._feed_order:
            count = len(order)
            for step in range(count):
                index = (self._next_feed + step) % count
                sender_id = order[index]
                body = self._feeds[sender_id].take()
                if body is not None:
                    self._next_feed = (index + 1) % count
                    return sender_id, body
        if channel:
            return self._taken(channel.popleft())
        return None

    def first_feed(self) -> tuple[int, Feed] | None:
        """The feed :meth:`take` reads before anything else right now, with its sender id:
        an ordered inbox's first feed while no channel record is owed ahead of it. None
        otherwise (unordered, no feed, or channel records come first).

        A reader draining a burst reads this feed's ``take()`` directly, one call per
        record instead of two, for as long as it yields records, and then goes back to
        :meth:`take`, which reads the channel behind it. Only valid until the reader
        gives something back (:meth:`push_front`) or a feed is installed or withdrawn.
        """
        head = self._head
        if head is None or (self._barrier and self._channel):
            return None
        return self._head_id, head

    def push_front(self, sender_id: int, body: bytes) -> None:
        """Give back an item the reader took but will not use yet: it is read next."""
        self._channel.appendleft((sender_id, body))
        self._barrier += 1

    def any_feed_exhausted(self) -> bool:
        # A plain loop, not any(genexpr): a reader asks this every time it finds nothing
        # to read (once per item for a reader that keeps up), and a generator costs more
        # than the one feed it usually checks.
        for feed in self._feeds.values():  # noqa: SIM110 (see above)
            if feed.exhausted:
                return True
        return False

    def feeds(self) -> list[tuple[int, Feed]]:
        return [(sender_id, self._feeds[sender_id]) for sender_id in self._feed_order]

    def _taken(self, item: Item) -> Item:
        while self._space:
            space = self._space.popleft()
            if not space.done():
                space.set_result(None)
                break
        return item

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """``await inbox.wait()``: until something may be readable (spurious wake-ups are
        allowed).

        Returns the waiter future itself rather than being a coroutine: a reader that
        keeps up waits once per record, and awaiting the future directly saves creating
        and running a coroutine each time. The loop is looked up once, at the first wait,
        and its ``create_future`` kept: ``asyncio.get_running_loop()`` makes a
        ``getpid()`` system call on every call (CPython checks for a fork), once per record
        for such a reader. An inbox is read on one loop, like every object of the node
        that owns it.
        """
        waiter = self._waiter
        if waiter is None or waiter.done():
            create = self._create_future
            if create is None:
                create = self._create_future = asyncio.get_running_loop().create_future
            waiter = self._waiter = create()
        return waiter

    def close(self) -> None:
        """No more writes; waiting writers get ChannelClosed. The reader is woken."""
        self._closed = True
        for sender_id in list(self._feeds):
            self.withdraw_feed(sender_id)
        while self._space:
            space = self._space.popleft()
            if not space.done():
                space.set_result(None)
        self.wake()

    def clear(self) -> None:
        self._channel.clear()
        self._barrier = 0

    def __len__(self) -> int:
        return len(self._channel)
