"""The producer's end of a stream: StreamSender.

``await send(item)`` stages a record, waiting only while the stream's channel is full (that
wait is the backpressure). ``finalize()`` and ``detach()`` hand the terminal over without
blocking and return a future of the stream's retirement; dropping a sender without a
terminal still ends the stream: the consumer sees ``SenderDropped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import weakref
from typing import TYPE_CHECKING, Any

from ..ids import InstanceId, StreamAnchorHandle
from .channels import ProducerChannel
from .errors import ChannelClosed
from .frames import DETACHED, DROPPED, FINALIZED, encode_item, encode_sender_error

if TYPE_CHECKING:
    from .manager import AnchorManager

__all__ = ["Retired", "SenderState", "StreamSender"]

logger = logging.getLogger(__name__)


class Retired(enum.Enum):
    """How a stream's output ended on the producer's node (first outcome wins)."""

    SENT = "sent"
    """The terminal was handed on (admitted by the transport)."""
    DISCARDED = "discarded"
    """The terminal never left: channel closed, consumer cancelled, teardown."""


class SenderState:
    """Everything a sender's lifetime needs, apart from the sender object itself, so that
    ``weakref.finalize`` can end a dropped sender's stream without keeping it alive."""

    __slots__ = (
        "__weakref__",
        "cancelled",
        "channel",
        "handle",
        "heartbeat_interval",
        "loop",
        "manager",
        "next_heartbeat",
        "retired",
        "sender_id",
        "sender_stream_id",
        "stop_requested",
        "target",
        "terminal_sent",
        "transport_key",
    )

    def __init__(
        self,
        manager: AnchorManager,
        handle: StreamAnchorHandle,
        channel: ProducerChannel,
        *,
        sender_stream_id: int,
        transport_key: str | None,
        target: InstanceId | None,
        heartbeat_interval: float | None,
        sender_id: int = 0,
    ) -> None:
        self.manager = manager
        self.handle = handle
        self.channel = channel
        self.sender_stream_id = sender_stream_id
        self.transport_key = transport_key
        self.target = target
        self.sender_id = sender_id
        self.heartbeat_interval = heartbeat_interval
        self.loop = asyncio.get_running_loop()
        self.next_heartbeat = self.loop.time() + (heartbeat_interval or 0.0)
        self.retired: asyncio.Future[Retired] = self.loop.create_future()
        self.cancelled = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.terminal_sent = False

    def terminal(self, body: bytes) -> asyncio.Future[Retired]:
        """Hand over the stream's last record once; later calls return the same future."""
        if self.terminal_sent:
            return self.retired
        self.terminal_sent = True
        self.manager.sender_finished(self)
        if self.cancelled.is_set() or self.channel.closed:
            self._retire(Retired.DISCARDED)
            return self.retired
        done: asyncio.Future[bool] = self.loop.create_future()
        done.add_done_callback(
            lambda f: self._retire(Retired.SENT if f.result() else Retired.DISCARDED)
        )
        self.channel.send_terminal(body, done)
        return self.retired

    def cancel(self) -> None:
        """The consumer cancelled: fire both tokens, stop writing."""
        self.cancelled.set()
        self.stop_requested.set()
        if not self.terminal_sent:
            self.terminal_sent = True
            self.channel.abort()
            self.manager.sender_finished(self)
            self._retire(Retired.DISCARDED)

    # The mux's slot owner: what the consumer or the peer's health did to this stream.
    def slot_stopped(self) -> None:
        """The consumer asked for a graceful stop (LifecycleSlot stop)."""
        self.stop_requested.set()

    def slot_closed(self, reason: object) -> None:
        """The slot closed under the sender (consumer cancel, peer gone, protocol error):
        both tokens fire and later sends fail, as a ``_stream_cancel`` would do."""
        self.cancel()

    def _retire(self, outcome: Retired) -> None:
        if not self.retired.done():
            self.retired.set_result(outcome)

    def dropped(self) -> None:
        """The sender object was garbage-collected: end its stream with Dropped."""
        if self.terminal_sent or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self.loop.call_soon_threadsafe(self.terminal, DROPPED)


class StreamSender:
    """A producer attached to one anchor. Create with ``AnchorManager.attach_anchor``."""

    def __init__(self, state: SenderState) -> None:
        self._state = state
        self._finalizer = weakref.finalize(self, SenderState.dropped, state)

    @property
    def handle(self) -> StreamAnchorHandle:
        return self._state.handle

    @property
    def sender_id(self) -> int:
        """This producer's id inside an MPSC anchor (0 for a single-sender anchor)."""
        return self._state.sender_id

    def negotiated_transport(self) -> str | None:
        """The transport key the attach settled on; None for a same-worker attach."""
        return self._state.transport_key

    @property
    def cancelled(self) -> asyncio.Event:
        """Set when the consumer cancelled or dropped the stream; later sends fail."""
        return self._state.cancelled

    @property
    def stop_requested(self) -> asyncio.Event:
        """Set on a graceful stop request (or a cancel): send what remains, then finalize."""
        return self._state.stop_requested

    async def send(self, item: Any) -> None:
        state = self._state
        if state.terminal_sent:  # a cancel sets it too, so one flag guards the hot path
            raise ChannelClosed(
                "the stream was cancelled" if state.cancelled.is_set() else "the stream has ended"
            )
        body = encode_item(item)  # SerializationError for what MessagePack cannot hold
        channel = state.channel
        if not channel.try_send(body):
            if channel.closed:
                raise ChannelClosed("the stream's channel is closed")
            await channel.send(body)

    async def send_err(self, message: str) -> None:
        """A soft error: the consumer's iteration raises SenderError, the stream goes on."""
        state = self._state
        if state.terminal_sent or state.cancelled.is_set():
            raise ChannelClosed("the stream has ended")
        await state.channel.send(encode_sender_error(message))

    def finalize(self) -> asyncio.Future[Retired]:
        """End the stream normally. Never blocks; await the result to learn its retirement."""
        self._finalizer.detach()
        return self._state.terminal(FINALIZED)

    def detach(self) -> StreamAnchorHandle:
        """Leave without finishing: another sender may attach and continue the stream."""
        self._finalizer.detach()
        self._state.terminal(DETACHED)
        return self._state.handle

    async def aclose(self) -> None:
        """End the stream as dropped if it was not finalized or detached."""
        self._finalizer.detach()
        self._state.terminal(DROPPED)

    async def __aenter__(self) -> StreamSender:
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        """Leaving the block finalizes the stream, or drops it if the block raised."""
        self._finalizer.detach()
        self._state.terminal(DROPPED if exc_type is not None else FINALIZED)

    async def retired(self) -> Retired:
        """Resolves once this node handed on all of the stream's output (or never will)."""
        return await asyncio.shield(self._state.retired)
