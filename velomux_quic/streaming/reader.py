"""A single-sender anchor's read: the take of every item already buffered, and the
awaitable each ``async for`` step of a :class:`~.anchor.StreamAnchor` awaits.

:class:`~.anchor.StreamAnchor` binds :func:`take_items` as its ``_take_items`` and
:func:`anchor_next` as its ``__anext__``. A reader that keeps up runs them once per item, so
this module is one of the record path's compiled modules (velomux_quic.recordpath): where
built, this same file is compiled, with the C declarations of ``reader.pxd``; otherwise it
runs as it is. The compiled :class:`AnchorRead` also gets an ``am_send`` type slot from
``_reader_send.pyx``, which pure-mode Cython cannot declare (see that class).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Final, NoReturn

from ..errors import (
    DeserializationError,
    SenderDropped,
    SenderError,
    StreamTransportError,
    UsageError,
)
from ..recordpath import companion
from .frames import (
    ITEM_PREFIX,
    FrameDecodeError,
    FrameKind,
    _item_error,
    _unpackb,
    decode_frame,
    shutdown_message,
)

if TYPE_CHECKING:
    from .inbox import Inbox

__all__ = ["ONE_READER", "AnchorRead", "anchor_next", "take_items", "thrown_exception"]

ONE_READER: Final = (
    "another task is already reading this anchor; an anchor has one reader: read it from "
    "one task and hand the items on (an asyncio.Queue), or use an MPSC anchor per reader"
)

# The frame kinds as module constants (C variables where compiled): reading a member off an
# Enum class is an attribute lookup through its metaclass, and the read compares a kind
# once or twice per item.
_ITEM: Final = FrameKind.ITEM
_HEARTBEAT: Final = FrameKind.HEARTBEAT
_SENDER_ERROR: Final = FrameKind.SENDER_ERROR
_DETACHED: Final = FrameKind.DETACHED
_FINALIZED: Final = FrameKind.FINALIZED
_DROPPED: Final = FrameKind.DROPPED
_PREFIX: Final[bytes] = ITEM_PREFIX
_PREFIX_SIZE: Final = len(ITEM_PREFIX)


def take_items(anchor: Any, items: list[Any], limit: int) -> None:
    """``anchor._take_items`` of a :class:`~.anchor.StreamAnchor` (typed there: this module
    is below it, so it does not import it): append the items ready now, up to ``limit``,
    skipping heartbeats; stop before anything else (given back to be read next), so the
    items before it come first.

    The burst in the transport's buffer is read from the feed itself
    (:meth:`~.inbox.Inbox.first_feed`), then whatever the inbox has behind it."""
    inbox = anchor._inbox
    room = limit - len(items)
    first = inbox.first_feed()
    if first is not None:
        sender_id, feed = first
        take_body = feed.take
        while room > 0:
            body = take_body()
            if body is None:
                break
            try:
                kind, value = decode_frame(body)
            except FrameDecodeError:
                inbox.push_front(sender_id, body)  # the next read raises it, in order
                return
            if kind is _ITEM:
                items.append(value)
                room -= 1
            elif kind is not _HEARTBEAT:
                inbox.push_front(sender_id, body)
                return
        if not len(inbox):
            return  # the feed is dry and no channel record waits behind it
    while room > 0:
        peek = inbox.take()
        if peek is None:
            return
        body = peek[1]
        try:
            kind, value = decode_frame(body)
        except FrameDecodeError:
            inbox.push_front(peek[0], body)  # the next read raises it, in order
            return
        if kind is _ITEM:
            items.append(value)
            room -= 1
        elif kind is not _HEARTBEAT:
            inbox.push_front(peek[0], body)
            return


def thrown_exception(typ: Any, value: Any = None, traceback: Any = None) -> BaseException:
    """What an awaitable's ``throw(typ, value, traceback)`` raises, built as a coroutine's
    ``throw`` builds it: from an exception, an exception type, or the old three
    arguments."""
    if value is None:
        value = typ if isinstance(typ, BaseException) else typ()
    if traceback is not None:
        value = value.with_traceback(traceback)
    exception: BaseException = value
    return exception


def anchor_next(anchor: Any) -> AnchorRead:
    """``anchor.__anext__()`` of a :class:`~.anchor.StreamAnchor`: the next item,
    StopAsyncIteration at the end, a StreamError if the stream broke (see
    :class:`AnchorRead`)."""
    read = AnchorRead.__new__(AnchorRead)
    read._anchor = anchor
    read._inbox = anchor._inbox
    read._reading = False
    read._done = False
    return read


class AnchorRead:
    """The awaitable ``__anext__`` returns: the read's loop, run by the awaiting task through
    the iterator protocol, as an asyncio future's ``__await__`` is.

    A coroutine per item would cost a coroutine object, its frame and, where compiled, the
    wrapper its ``__await__`` returns, each made and freed for every item a task reads;
    this object is its own iterator. Its steps are a coroutine's: the first step refuses a
    second reader (:class:`UsageError`) and the read holds the anchor's reading flag from
    then on (see :meth:`_hold`), an item ends the await (as ``StopIteration(item)`` from
    ``__next__`` and ``send``), a sentinel raises what it means, and while nothing is
    readable a step yields the inbox's waiter future to the task. ``throw`` and ``close``
    (a cancelled or closed awaiting coroutine) release the flag, as a coroutine's
    ``finally`` would.

    Compiled, ending each read with a StopIteration costs an exception object and a
    traceback entry for each compiled function it passes; so ``_reader_send.pyx`` gives the
    type an ``am_send`` slot, through which the interpreter's send path (``PyIter_Send``)
    gets the item back as a value. An interpreter that does not call the slot (a newer one,
    or one tracing) steps ``__next__``, with the same results.
    """

    __slots__ = ("_anchor", "_done", "_inbox", "_reading")

    _anchor: Any
    """The :class:`~.anchor.StreamAnchor` read."""
    _inbox: Inbox
    """The anchor's inbox, which holds its reading flag (``Inbox.reading``)."""
    _reading: bool
    """This read holds the anchor's reading flag."""
    _done: bool
    """The await is over: an item was returned or an error raised."""

    def __await__(self) -> Generator[Any, None, Any]:
        return self  # its own iterator, with send, throw and close

    def __iter__(self) -> AnchorRead:
        return self

    def __next__(self) -> Any:
        value = self._step()
        if self._done:
            raise StopIteration(value)
        return value

    def send(self, value: object) -> Any:
        value = self._step()
        if self._done:
            raise StopIteration(value)
        return value

    def throw(self, typ: Any, value: Any = None, traceback: Any = None) -> NoReturn:
        self._finish()
        raise thrown_exception(typ, value, traceback)

    def close(self) -> None:
        self._finish()

    def _hold(self) -> None:
        """Take the anchor's reading flag for this read, unless it holds it already.

        A read takes it only once it does more than return the first record as an item:
        such a read ends before any other code runs, so no second reader could see the
        flag, and not taking it saves two writes of it per item. A read holds it before it
        calls the owner, and across every wait. The flag is the inbox's (``Inbox.reading``),
        so a read checks and sets it in C where compiled."""
        if not self._reading:
            self._reading = True
            self._inbox.reading = True

    def _finish(self) -> None:
        """The await is over: give the anchor's reading flag back if this read took it."""
        if self._reading:
            self._reading = False
            self._inbox.reading = False
        self._done = True

    def _step(self) -> Any:
        """One step of the read: the item (the await is over: ``_done`` is set) or the
        waiter future to yield (``_done`` is not); an error is raised as it is."""
        anchor = self._anchor
        inbox = self._inbox
        if self._done:
            raise RuntimeError("cannot reuse an already awaited __anext__()")
        if not self._reading and inbox.reading:
            self._done = True
            raise UsageError(ONE_READER)
        try:
            while True:
                taken = inbox.take()
                if taken is not None:
                    sender_id, body = taken
                    if type(body) is bytes:
                        # An item is decoded here (decode_frame would return it in a
                        # tuple); compiled, ``data`` is typed bytes, so its prefix is
                        # compared in C.
                        data = body
                        if data.startswith(_PREFIX):
                            try:
                                value = _unpackb(body[_PREFIX_SIZE:], strict_map_key=False)
                            except Exception as exc:
                                error = _item_error(exc)
                                error.__cause__ = exc
                                anchor._end("a record did not decode")
                                raise DeserializationError(str(error)) from error
                            self._finish()
                            return value
                    self._hold()
                    try:
                        kind, value = decode_frame(body)
                    except FrameDecodeError as exc:
                        anchor._end("a record did not decode")
                        raise DeserializationError(str(exc)) from exc
                    if kind is _ITEM:
                        self._finish()
                        return value
                    if kind is _HEARTBEAT:
                        continue
                    if kind is _SENDER_ERROR:
                        raise SenderError(str(value))
                    if kind is _DETACHED:
                        anchor._owner.sender_detached(anchor._entry.local_id, sender_id)
                        continue
                    if kind is _FINALIZED:
                        anchor._end("finished")
                        raise StopAsyncIteration
                    if kind is _DROPPED:
                        anchor._end("the producer went away")
                        raise SenderDropped("the producer went away without finishing the stream")
                    shutdown = shutdown_message(value)
                    if shutdown is not None:
                        anchor._end("the producer shut down")
                        raise SenderDropped(shutdown)
                    anchor._end("a transport error")
                    raise StreamTransportError(str(value))
                self._hold()
                # The inbox answers "no feed ran dry" (the common case: the reader keeps
                # up) without a call to the owner, which acts only on a dry feed.
                if inbox.any_feed_exhausted() and anchor._owner.feed_exhausted(anchor._entry, 0):
                    continue  # it injected Dropped into the channel: read it next
                if anchor._entry.finished:
                    anchor._ended_finished()
                waiter = inbox.wait()
                waiter._asyncio_future_blocking = True
                return waiter
        except BaseException:
            self._finish()
            raise


companion("velomux_quic.streaming._reader_send")
