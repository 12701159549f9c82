"""The consumer's end of a stream: StreamAnchor (one sender at a time) and MpscAnchor.

An anchor is an async iterator. It reads its inbox (its own channel plus the transport's
buffer, see :mod:`.inbox`), decodes each record, filters heartbeats, and turns sentinels
into the end of iteration or a typed :class:`StreamError`:

=================  ===========================================================
``Item``           yielded
``SenderError``    raises :class:`SenderError`; the stream goes on (iterate again)
``Heartbeat``      never surfaced
``Finalized``      iteration ends; the anchor is removed
``Detached``       not surfaced; another sender may attach and continue the stream
``Dropped``        raises :class:`SenderDropped`; the anchor is removed
``TransportError`` raises :class:`StreamTransportError`; the anchor is removed
=================  ===========================================================

Dropping (garbage-collecting) an anchor cancels it, as ``cancel()`` does.

An anchor has one reader: a second ``async for`` (or ``next()``, ``take_ready()``) while
one is waiting raises :class:`UsageError` instead of splitting the items between the two,
and a new iteration after the stream ended says so instead of yielding nothing. Reads
take ``timeout=`` (:class:`ReadTimeout`; the stream goes on).

The anchor reaches its node's manager only through :class:`AnchorOwner`, the few calls
this module needs, so it imports nothing above it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, NoReturn, Protocol, TypeVar, cast

from ..errors import (
    DeserializationError,
    ReadTimeout,
    StreamCancelled,
    UsageError,
)
from ..ids import InstanceId, StreamAnchorHandle
from .frames import FrameDecodeError, FrameKind, decode_frame
from .inbox import Inbox
from .reader import ONE_READER, anchor_next, take_items
from .watchdog import WatchdogClock

__all__ = [
    "AnchorEntry",
    "AnchorOwner",
    "MpscAnchor",
    "MpscEvent",
    "MpscItem",
    "RemoteSender",
    "StreamAnchor",
]

T = TypeVar("T")

# The frame kinds as module constants: reading a member off an Enum class is an attribute
# lookup through its metaclass, several times dearer than a global, and the readers below
# compare a kind once or twice per item.
_ITEM: Final = FrameKind.ITEM
_HEARTBEAT: Final = FrameKind.HEARTBEAT
_SENDER_ERROR: Final = FrameKind.SENDER_ERROR
_DETACHED: Final = FrameKind.DETACHED
_FINALIZED: Final = FrameKind.FINALIZED


@dataclass(slots=True)
class RemoteSender:
    """What the consumer knows of one attached remote producer."""

    node: InstanceId | None
    """The producer's node; None only while the stream is an unclaimed pre-bind."""
    sender_stream_id: int
    session_id: int
    transport_key: str
    sender_id: int = 0
    last_arrival: float = 0.0
    watchdog: asyncio.TimerHandle | None = None
    watchdog_clock: WatchdogClock | None = None
    """Where the watchdog counts silence from (see :mod:`.watchdog`); set when bound."""
    receiver: Any = None
    """The transport's receiving end (per-stream receiver, mux ingress slot)."""
    probe: Callable[[], tuple[float, bool]] | None = None
    """Transport-specific liveness: (last arrival, window exempt). None: ``last_arrival``."""
    lane_key: int | None = None
    """The placement key the attach (or pre-bind) named; None lets the receiver choose."""
    lane: int = 0
    """The lane the receiver chose for this stream when it bound it."""
    attach_session_id: int = 0
    """The ``session_id`` of the attach request that made this bind (0: a pre-bind), which
    a retry of a timed-out attach names to replace it."""
    prebound: bool = False
    """A pre-bind no sender has adopted or claimed yet: ``node`` is not known, and the
    watchdog counts no window as dead (the accept window is the backstop)."""
    observed: Any = None
    """What the manager's stream observer (tracing) keeps for this stream from its bind to
    its end; None when nothing observes the node's streams."""


@dataclass(slots=True)
class AnchorEntry:
    """The manager's record of one anchor; shared by the anchor object and the handlers."""

    local_id: int
    handle: StreamAnchorHandle
    mpsc: bool
    inbox: Inbox
    heartbeat_interval: float
    max_senders: int | None = None
    attached: bool = False
    senders: dict[int, RemoteSender] = field(default_factory=dict)
    local_senders: set[int] = field(default_factory=set)
    next_sender_id: int = 1
    finished: bool = False
    cancelled: bool = False
    unattached_timeout: float | None = None
    unattached_timer: asyncio.TimerHandle | None = None
    prebind: RemoteSender | None = None
    """The zero-RTT bind waiting for its first sender (also in ``senders``)."""

    @property
    def sender_count(self) -> int:
        """Live senders, remote (and an unclaimed pre-bind) and on this node."""
        return len(self.senders) + len(self.local_senders)


class AnchorOwner(Protocol):
    """What an anchor asks of its node's manager (the manager satisfies it)."""

    def anchor_dropped(self, local_id: int) -> None:
        """The anchor object was garbage-collected (maybe on another thread): cancel it."""

    def cancel_anchor(self, local_id: int) -> None:
        """Remove the anchor and tell its producers."""

    def request_stop(self, local_id: int) -> None:
        """Ask the anchor's producers to finish gracefully."""

    def reader_ended(self, local_id: int) -> None:
        """The reader took the stream's end (its terminal, or an error): forget the anchor."""

    def sender_detached(self, local_id: int, sender_id: int) -> None:
        """The reader took a sender's Detached (or an MPSC sender's terminal)."""

    def feed_exhausted(self, entry: AnchorEntry, sender_id: int | None) -> bool:
        """Whether a feed ran dry for good; if so its Dropped was injected to be read.

        A single-sender reader asks only once ``entry.inbox.any_feed_exhausted()`` is
        true, so this must answer False whenever no feed of the inbox is exhausted."""


class _AnchorBase:
    __slots__ = ("__weakref__", "_ended", "_entry", "_finalizer", "_inbox", "_owner")

    def __init__(self, owner: AnchorOwner, entry: AnchorEntry) -> None:
        self._owner = owner
        self._entry = entry
        self._inbox = entry.inbox
        """The entry's inbox, held here too: a read finds it, and the reading flag on it,
        with one attribute lookup per item rather than three."""
        self._ended: str | None = None
        """How the stream ended for this reader (None while it goes on)."""
        self._finalizer = weakref.finalize(self, owner.anchor_dropped, entry.local_id)

    @property
    def handle(self) -> StreamAnchorHandle:
        """The handle producers attach with; send it to them (it is 16 bytes)."""
        return self._entry.handle

    @property
    def finished(self) -> bool:
        """True once the stream is over (read to its end, cancelled or removed)."""
        return self._entry.finished

    def cancel(self) -> None:
        """Remove the anchor and tell its producers; idempotent. Buffered records are lost."""
        self._finalizer.detach()
        self._owner.cancel_anchor(self._entry.local_id)

    def request_stop(self) -> None:
        """Ask the producers to finish gracefully (their ``wait_stop_requested()`` returns)."""
        self._owner.request_stop(self._entry.local_id)

    def _begin_iteration(self) -> None:
        """A new ``async for``: refused once the stream ended (it would yield nothing)."""
        if self._ended is not None:
            raise UsageError(
                f"the stream of {self._entry.handle} already ended ({self._ended}); an "
                "anchor is read once: create a new anchor for a new stream"
            )

    def _take(self) -> tuple[int, FrameKind, Any] | None:
        item = self._inbox.take()
        if item is None:
            return None
        sender_id, body = item
        try:
            kind, value = decode_frame(body)
        except FrameDecodeError as exc:
            self._end("a record did not decode")
            raise DeserializationError(str(exc)) from exc
        return sender_id, kind, value

    def _end(self, how: str) -> None:
        self._ended = how
        self._finalizer.detach()
        self._owner.reader_ended(self._entry.local_id)

    def _ended_finished(self) -> NoReturn:
        """The reader found the anchor finished with nothing left: raise its ending."""
        if self._entry.cancelled:
            self._ended = self._ended or "cancelled"
            raise StreamCancelled("the anchor was cancelled")
        self._ended = self._ended or "finished"
        raise StopAsyncIteration


class StreamAnchor(_AnchorBase, Generic[T]):
    """A single-sender stream's consumer. ``async for item in anchor`` reads it.

    Typed by its items for the reader's benefit (``StreamAnchor[dict[str, int]]``); the
    items are what the producer sent, decoded from MessagePack, and are not checked.
    """

    __slots__ = ()

    def __aiter__(self) -> AsyncIterator[T]:
        """Start reading; :class:`UsageError` if the stream already ended."""
        self._begin_iteration()
        return self

    # The reader's functions are the methods themselves, with no call in between (each
    # runs once per item); typed here, since the reader does not import this module.
    __anext__ = cast("Callable[[StreamAnchor[T]], Awaitable[T]]", anchor_next)
    """The next item (an awaitable); StopAsyncIteration at the end, a StreamError if it
    broke. Written in :mod:`.reader`, as ``_take_items`` is (see there)."""

    async def next(self, *, timeout: float | None = None) -> T:
        """The next item (``anext(anchor)``), raising StopAsyncIteration at the end.

        ``timeout`` bounds the wait: :class:`ReadTimeout` when no item came in time; the
        stream goes on and the next read continues it.
        """
        if timeout is None:
            return await self.__anext__()
        try:
            async with asyncio.timeout(timeout):
                return await self.__anext__()
        except TimeoutError:
            raise ReadTimeout(
                f"no item from {self._entry.handle} within {timeout} s; the stream goes on"
            ) from None

    async def batches(self, limit: int = 1 << 16) -> AsyncIterator[list[T]]:
        """``async for items in anchor.batches()``: every item already buffered per step.

        The same stream as ``async for item in anchor``, in the same order, ending the same
        way (StopAsyncIteration, or the StreamError raised after the items before it were
        yielded), but one wake-up per burst instead of one per item: a frontend task per
        request that relays tokens keeps up with a decode engine's forward passes for less
        CPU. ``limit`` caps a list's length.
        """
        self._begin_iteration()
        while True:
            try:
                items = await self.take_ready(limit)
            except StopAsyncIteration:
                return
            yield items

    async def take_ready(self, limit: int = 1 << 16, *, timeout: float | None = None) -> list[T]:
        """Every item already buffered (at least one: waits for the first), in one await.

        A frontend task per request pays one wake-up per call instead of one per item.
        Sentinels behave as in ``__anext__``; if one ends the stream after some items were
        taken, those items are returned first and the ending is raised on the next call.
        ``timeout`` bounds the wait for the first item (:class:`ReadTimeout`).
        """
        if self._inbox.reading:  # checked before taking anything; __anext__ checks it again
            raise UsageError(ONE_READER)
        items: list[T] = []
        self._take_items(items, limit)
        if not items:
            # Nothing ready, or a sentinel or undecodable record comes first: __anext__
            # waits for the first item or raises the ending, exactly as iteration would.
            if timeout is None:
                items.append(await self.__anext__())
            else:
                try:
                    async with asyncio.timeout(timeout):
                        items.append(await self.__anext__())
                except TimeoutError:
                    raise ReadTimeout(
                        f"no item from {self._entry.handle} within {timeout} s; the stream goes on"
                    ) from None
            self._take_items(items, limit)
        return items

    _take_items = cast("Callable[[StreamAnchor[T], list[T], int], None]", take_items)


@dataclass(frozen=True, slots=True)
class MpscItem:
    """One item of an MPSC stream, with the id of the producer that sent it."""

    sender_id: int
    value: Any


@dataclass(frozen=True, slots=True)
class MpscEvent:
    """A producer left (``detached``: finished or detached; ``dropped``: vanished) or
    reported a soft error (``sender_error``). The stream itself goes on."""

    kind: str
    sender_id: int
    message: str = ""


class MpscAnchor(_AnchorBase):
    """A stream many producers write into; each record says which producer sent it.

    One producer leaving does not end the stream; it ends when the consumer cancels it or
    the unattached timeout fires after every producer left.
    """

    __slots__ = ()

    def __aiter__(self) -> AsyncIterator[MpscItem | MpscEvent]:
        """Start reading; :class:`UsageError` if the stream already ended."""
        self._begin_iteration()
        return self

    async def __anext__(self) -> MpscItem | MpscEvent:
        """The next item or producer event; StopAsyncIteration once the stream ended."""
        inbox = self._inbox
        if inbox.reading:
            raise UsageError(ONE_READER)
        inbox.reading = True
        try:
            entry = self._entry
            while True:
                taken = self._take()
                if taken is not None:
                    sender_id, kind, value = taken
                    if kind is _ITEM:
                        return MpscItem(sender_id, value)
                    if kind is _HEARTBEAT:
                        continue
                    if kind is _SENDER_ERROR:
                        return MpscEvent("sender_error", sender_id, str(value))
                    self._owner.sender_detached(entry.local_id, sender_id)
                    if kind is _FINALIZED or kind is _DETACHED:
                        return MpscEvent("detached", sender_id)
                    return MpscEvent("dropped", sender_id, "" if value is None else str(value))
                if self._owner.feed_exhausted(entry, None):
                    continue
                if entry.finished:
                    self._ended_finished()
                await inbox.wait()
        finally:
            inbox.reading = False

    async def next(self, *, timeout: float | None = None) -> MpscItem | MpscEvent:
        """The next item or event; ``timeout`` bounds the wait (:class:`ReadTimeout`)."""
        if timeout is None:
            return await self.__anext__()
        try:
            async with asyncio.timeout(timeout):
                return await self.__anext__()
        except TimeoutError:
            raise ReadTimeout(
                f"nothing from {self._entry.handle} within {timeout} s; the stream goes on"
            ) from None
