"""What a StreamSender writes into: the producer's end of one stream's channel.

Two kinds exist today: :class:`InboxChannel` for a sender on the anchor's own node (records
go straight into the anchor's inbox: no transport, no heartbeats), and
:class:`~velomux_quic.streaming.perstream.PerStreamChannel` for the per-stream QUIC path.
The mux adds a third. A sender only needs the small interface below.

This module is one of the record path's compiled modules (velomux_quic.recordpath), for
:class:`StagingChannel`: where built, this same file is compiled, with ``channels.pxd``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from ..errors import ChannelClosed
from .inbox import Inbox

__all__ = ["InboxChannel", "ProducerChannel", "StagingChannel"]


class ProducerChannel(Protocol):
    def try_send(self, body: bytes) -> bool:
        """Send without waiting; False when the channel is full (heartbeats are dropped then)."""

    async def send(self, body: bytes) -> None:
        """Send, waiting while the channel is full; raises ChannelClosed when it closed."""

    def send_terminal(self, body: bytes, done: asyncio.Future[bool]) -> None:
        """Hand over the stream's last record without blocking; resolve ``done`` with True
        once it was handed on (admitted), False if it was discarded. Closes the channel."""

    def after_records(self, stage: Callable[[], None]) -> None:
        """Call ``stage`` (a sender's terminal, handed over) once the records this channel
        took in this loop turn are handed on; at once where none wait, or where records
        are handed on as they are taken."""

    @property
    def closed(self) -> bool: ...

    @property
    def credit(self) -> int | None:
        """Records the channel would take now without waiting, as far as it knows (the mux
        slot's credit window, the local inbox's free room); None when the channel cannot
        say in records (the per-stream path's window is in bytes). Read on demand only."""

    @property
    def queued_bytes(self) -> int:
        """Bytes handed to the channel that are not on the wire yet (staged in the mux
        slot, written to the QUIC stream but untransmitted); 0 when nothing waits."""

    @property
    def lane(self) -> int | None:
        """The lane the stream rides to its peer under the mux; None on other paths."""

    def abort(self) -> None:
        """Close at once without a terminal (the consumer cancelled)."""


class StagingChannel:
    """A base of the channels a sender's per-record loops stage into the most: compiled,
    its ``try_send`` is a C method, which those loops call without a lookup (the mux's
    compiled channel derives from it). Any other channel is called as a
    :class:`ProducerChannel`. Defines nothing else; a subclass is a whole channel."""

    __slots__ = ()

    def try_send(self, body: bytes) -> bool:
        raise NotImplementedError


class InboxChannel:
    """A same-worker sender: writes straight into the anchor's inbox."""

    __slots__ = ("_closed", "_inbox", "_sender_id", "_tasks")

    def __init__(self, inbox: Inbox, sender_id: int = 0) -> None:
        self._inbox = inbox
        self._sender_id = sender_id
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def sender_id(self) -> int:
        """The id this sender's records carry in the anchor's inbox."""
        return self._sender_id

    @property
    def closed(self) -> bool:
        return self._closed or self._inbox.closed

    @property
    def credit(self) -> int | None:
        """The anchor's free room: the records a send puts in without waiting."""
        return 0 if self.closed else self._inbox.space

    @property
    def queued_bytes(self) -> int:
        """Always 0: a record goes straight into the anchor's inbox, nothing is staged."""
        return 0

    @property
    def lane(self) -> None:
        """None: a same-worker stream crosses no lane."""
        return None

    def try_send(self, body: bytes) -> bool:
        return not self.closed and self._inbox.try_put(body, self._sender_id)

    async def send(self, body: bytes) -> None:
        if self.closed:
            raise ChannelClosed("the anchor is gone")
        await self._inbox.put(body, self._sender_id)

    def after_records(self, stage: Callable[[], None]) -> None:
        stage()  # the records are in the inbox already

    def send_terminal(self, body: bytes, done: asyncio.Future[bool]) -> None:
        self._closed = True
        if self._inbox.closed:
            done.set_result(False)
            return
        if self._inbox.try_put(body, self._sender_id):
            done.set_result(True)
            return
        # Full: a task (holding the inbox) waits for space, so the caller never blocks.
        task = asyncio.get_running_loop().create_task(self._put_later(body, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put_later(self, body: bytes, done: asyncio.Future[bool]) -> None:
        try:
            await self._inbox.put(body, self._sender_id)
        except Exception:
            if not done.done():
                done.set_result(False)
            return
        if not done.done():
            done.set_result(True)

    def abort(self) -> None:
        self._closed = True
