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
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..ids import InstanceId, StreamAnchorHandle
from .errors import (
    DeserializationError,
    SenderDropped,
    SenderError,
    StreamCancelled,
    StreamTransportError,
)
from .frames import FrameDecodeError, FrameKind, decode_frame
from .inbox import Inbox

if TYPE_CHECKING:
    from .manager import AnchorManager

__all__ = ["AnchorEntry", "MpscAnchor", "MpscEvent", "MpscItem", "RemoteSender", "StreamAnchor"]


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
    misses: int = 0
    watchdog: asyncio.TimerHandle | None = None
    receiver: Any = None
    """The transport's receiving end (per-stream receiver, mux ingress slot)."""
    probe: Callable[[], tuple[float, bool]] | None = None
    """Transport-specific liveness: (last arrival, window exempt). None: ``last_arrival``."""
    lane_key: int | None = None
    """The placement key the attach (or pre-bind) named; None lets the receiver choose."""
    lane: int = 0
    """The lane the receiver chose for this stream when it bound it."""
    prebound: bool = False
    """A pre-bind no sender has adopted or claimed yet: ``node`` is not known, and the
    watchdog counts no window as dead (the accept window is the backstop)."""


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
        return len(self.senders) + len(self.local_senders)


class _AnchorBase:
    def __init__(self, manager: AnchorManager, entry: AnchorEntry) -> None:
        self._manager = manager
        self._entry = entry
        self._finalizer = weakref.finalize(self, manager.anchor_dropped, entry.local_id)

    @property
    def handle(self) -> StreamAnchorHandle:
        return self._entry.handle

    @property
    def finished(self) -> bool:
        return self._entry.finished

    def cancel(self) -> None:
        """Remove the anchor and tell its producers; idempotent. Buffered records are lost."""
        self._finalizer.detach()
        self._manager.cancel_anchor(self._entry.local_id)

    def request_stop(self) -> None:
        """Ask the producers to finish gracefully (their ``stop_requested`` fires)."""
        self._manager.request_stop(self._entry.local_id)

    def _take(self) -> tuple[int, FrameKind, Any] | None:
        item = self._entry.inbox.take()
        if item is None:
            return None
        sender_id, body = item
        try:
            kind, value = decode_frame(body)
        except FrameDecodeError as exc:
            self._end()
            raise DeserializationError(str(exc)) from exc
        return sender_id, kind, value

    def _end(self) -> None:
        self._finalizer.detach()
        self._manager.finish_anchor(self._entry.local_id)


class StreamAnchor(_AnchorBase):
    """A single-sender stream's consumer. ``async for item in anchor`` reads it."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        entry = self._entry
        while True:
            taken = self._take()
            if taken is not None:
                sender_id, kind, value = taken
                if kind is FrameKind.ITEM:
                    return value
                if kind is FrameKind.HEARTBEAT:
                    continue
                if kind is FrameKind.SENDER_ERROR:
                    raise SenderError(str(value))
                if kind is FrameKind.DETACHED:
                    self._manager.sender_detached(entry.local_id, sender_id)
                    continue
                self._end()
                if kind is FrameKind.FINALIZED:
                    raise StopAsyncIteration
                if kind is FrameKind.DROPPED:
                    raise SenderDropped("the producer went away without finishing the stream")
                raise StreamTransportError(str(value))
            if self._manager.feed_exhausted(entry, 0):
                continue  # it injected Dropped into the channel: read it next
            if entry.finished:
                if entry.cancelled:
                    raise StreamCancelled("the anchor was cancelled")
                raise StopAsyncIteration
            await entry.inbox.wait()

    async def next(self) -> Any:
        """The next item (``anext(anchor)``), raising StopAsyncIteration at the end."""
        return await self.__anext__()

    async def batches(self, limit: int = 1 << 16) -> AsyncIterator[list[Any]]:
        """``async for items in anchor.batches()``: every item already buffered per step.

        The same stream as ``async for item in anchor``, in the same order, ending the same
        way (StopAsyncIteration, or the StreamError raised after the items before it were
        yielded), but one wake-up per burst instead of one per item: a frontend task per
        request that relays tokens keeps up with a decode engine's forward passes for less
        CPU. ``limit`` caps a list's length.
        """
        while True:
            try:
                items = await self.take_ready(limit)
            except StopAsyncIteration:
                return
            yield items

    async def take_ready(self, limit: int = 1 << 16) -> list[Any]:
        """Every item already buffered (at least one: waits for the first), in one await.

        A frontend task per request pays one wake-up per call instead of one per item.
        Sentinels behave as in ``__anext__``; if one ends the stream after some items were
        taken, those items are returned first and the ending is raised on the next call.
        """
        items: list[Any] = []
        self._take_items(items, limit)
        if not items:
            # Nothing ready, or a sentinel or undecodable record comes first: __anext__
            # waits for the first item or raises the ending, exactly as iteration would.
            items.append(await self.__anext__())
            self._take_items(items, limit)
        return items

    def _take_items(self, items: list[Any], limit: int) -> None:
        """Append the items ready now, up to ``limit``, skipping heartbeats; stop before
        anything else (given back to be read next), so the items before it come first."""
        inbox = self._entry.inbox
        while len(items) < limit:
            peek = inbox.take()
            if peek is None:
                return
            sender_id, body = peek
            try:
                kind, value = decode_frame(body)
            except FrameDecodeError:
                inbox.push_front(sender_id, body)  # the next __anext__ raises it, in order
                return
            if kind is FrameKind.ITEM:
                items.append(value)
            elif kind is not FrameKind.HEARTBEAT:
                inbox.push_front(sender_id, body)
                return


@dataclass(frozen=True, slots=True)
class MpscItem:
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

    def __aiter__(self) -> AsyncIterator[MpscItem | MpscEvent]:
        return self

    async def __anext__(self) -> MpscItem | MpscEvent:
        entry = self._entry
        while True:
            taken = self._take()
            if taken is not None:
                sender_id, kind, value = taken
                if kind is FrameKind.ITEM:
                    return MpscItem(sender_id, value)
                if kind is FrameKind.HEARTBEAT:
                    continue
                if kind is FrameKind.SENDER_ERROR:
                    return MpscEvent("sender_error", sender_id, str(value))
                self._manager.sender_detached(entry.local_id, sender_id)
                if kind in (FrameKind.FINALIZED, FrameKind.DETACHED):
                    return MpscEvent("detached", sender_id)
                return MpscEvent("dropped", sender_id, "" if value is None else str(value))
            if self._manager.feed_exhausted(entry, None):
                continue
            if entry.finished:
                if entry.cancelled:
                    raise StreamCancelled("the anchor was cancelled")
                raise StopAsyncIteration
            await entry.inbox.wait()
