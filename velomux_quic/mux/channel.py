"""A sender's channel into its mux slot (:class:`MuxChannel`, the ProducerChannel the mux
provides), and the guard its terminal is handed over with (:class:`DeliveryGuard`).

A producer stages every record through :meth:`MuxChannel.try_send`, so this module is one
of the record path's compiled modules (velomux_quic.recordpath): where built, this same
file is compiled, with the C declarations of ``channel.pxd``, in which the channel derives
from the streaming layer's :class:`~velomux_quic.streaming.channels.StagingChannel`; the
sender's loops then call ``try_send`` as a C method. Otherwise it runs as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol

from ..errors import ChannelClosed
from ..streaming.channels import StagingChannel
from .slots import EgressSlot, SlotOwner, SlotState

if TYPE_CHECKING:
    from .egress import EgressBatcher

__all__ = ["DeliveryGuard", "MuxChannel", "SlotDriver"]

_OPEN: Final = SlotState.OPEN
_OPENING: Final = SlotState.OPENING


class SlotDriver(Protocol):
    """What a channel asks of the driver of its slot's batcher
    (:class:`~.driver.BatcherDriver`, which imports this module, so it is named here by
    what it does)."""

    batcher: EgressBatcher
    _loop: asyncio.AbstractEventLoop

    def now(self) -> float: ...

    def wake(self) -> None: ...

    def wait_space(self, slot: EgressSlot) -> asyncio.Future[None]: ...

    def after_records(self, stage: Callable[[], None]) -> None: ...


class DeliveryGuard:
    """A terminal's retirement guard: its future resolves True only once the batch that
    carried the terminal reached the peer's transport (acknowledged), False if it never
    left or was lost with its connection. Opening guards (``connect``) stay plain futures:
    an OpenSlot only has to be admitted before the stream's first records follow it."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[bool]) -> None:
        self.future = future

    def resolve(self, delivered: bool) -> None:
        if not self.future.done():
            self.future.set_result(delivered)


class MuxChannel(StagingChannel):
    """A sender's channel into its mux slot (the ProducerChannel the mux provides)."""

    __slots__ = ("_batcher", "_clock", "_driver", "_slot")

    def __init__(self, driver: SlotDriver, slot: EgressSlot) -> None:
        self._driver = driver
        self._slot = slot
        # Kept once: try_send runs for every record a producer sends (compiled, the
        # batcher is a C field and its offer a C call).
        self._batcher = driver.batcher
        self._clock = driver._loop.time

    @property
    def slot(self) -> EgressSlot:
        return self._slot

    @property
    def session_id(self) -> int:
        """The routing session that names this stream to the consumer (in LifecycleSlot)."""
        return self._slot.session_id

    @property
    def credit(self) -> int:
        """Data records the consumer will still take before it grants more (its window);
        0 once the slot closed."""
        slot = self._slot
        return slot.credit if slot.live else 0

    @property
    def queued_bytes(self) -> int:
        """Bytes of this stream's records waiting in the batcher, not yet written."""
        return self._slot.queued_bytes

    @property
    def lane(self) -> int:
        """The lane this stream rides (the receiver's choice modulo this node's lanes)."""
        return self._driver.batcher.lane

    def watch(self, owner: SlotOwner) -> None:
        """Tell ``owner`` (the sender's state) when the consumer stops or cancels the stream
        through the mux, or the slot closes under it (peer close, epoch death)."""
        self._slot.owner = owner

    @property
    def closed(self) -> bool:
        """The stream takes no more records: its terminal is queued, or its slot closed."""
        return self._slot.state > _OPEN

    def try_send(self, body: bytes) -> bool:
        slot = self._slot
        state = slot.state
        if state is not _OPEN and state is not _OPENING:  # self.closed, inlined
            return False
        # The clock, not the time: offer reads it only when the record opens a linger window.
        if not self._batcher.offer(slot, body, self._clock):
            return False
        if not self._batcher.wake_pending:  # most sends find the wake already scheduled
            self._driver.wake()
        return True

    async def send(self, body: bytes) -> None:
        driver = self._driver
        while True:
            if self.closed:
                raise ChannelClosed("the mux slot is closed")
            if driver.batcher.offer(self._slot, body, driver.now()):
                driver.wake()
                return
            # The slot's byte budget, or the lane's queue bound, is full.
            await driver.wait_space(self._slot)

    def after_records(self, stage: Callable[[], None]) -> None:
        self._driver.after_records(stage)

    def send_terminal(self, body: bytes, done: asyncio.Future[bool]) -> None:
        if self.closed:
            done.set_result(False)
            return
        driver = self._driver
        driver.batcher.offer_terminal(self._slot, body, driver.now(), guard=DeliveryGuard(done))
        driver.wake()

    def end_now(self, body: bytes, done: asyncio.Future[bool]) -> None:
        """The node is closing: discard what waits unwritten and stage ``body`` as the
        terminal at once (it spends the reserved credit, so it is never refused)."""
        if self.closed:
            done.set_result(False)
            return
        driver = self._driver
        driver.batcher.end_now(self._slot, body, driver.now(), guard=DeliveryGuard(done))
        driver.wake()

    def abort(self) -> None:
        if self._slot.state <= _OPEN:
            self._driver.batcher.cancel_slot(self._slot)
            self._driver.wake()
