"""The asyncio glue around one EgressBatcher: wake-ups, timers, admission, retirement.

A batcher is woken, never fed: producers and replies change its state synchronously and
schedule one wake per loop iteration (``call_soon``); the wake polls the batcher and hands
every batch to the messenger in order. A sender's terminal handed over in a turn whose
records still wait for that poll is staged only after they were handed to the transport,
one loop turn later (after the transport's transmit): a decode loop that ends many streams
right after their last records sends those records first, and the ends follow in their
own batch. A batch the transport does not admit at once parks
the batcher until the admission resolves; a refused admission is epoch death. A terminal's
retirement guard (a :class:`DeliveryGuard`) resolves ``Sent`` once the peer's transport
acknowledged the batch carrying it (with no delivery watch, as in the sans-IO tests: at its
admission), and ``Discarded`` if that batch is refused, if the connection ends before the
acknowledgement, or if its slot closes before the terminal left.

A singleton the messenger will stage goes with its ``_mux_slot`` header. Its fence, and the
guard of a terminal it carries, wait for the payload's release, not for the descriptor's
admission: pulled, the fence lifts and the guard reports Sent; released for any other
reason (the receiver refused it as over its ``staged_payload_max``, nobody pulled it in
time, the node closed), the consumer never got the record: the stream ends (its producer's
next send fails) and the guard reports Discarded. A refused one is only closed here (the
consumer's table retired it already); otherwise its end goes on the wire, a ``Dropped``
terminal in turn after the lost record, so the consumer's table learns of it before a later
stream reuses the slot's index (:meth:`EgressBatcher.end_lost`).

A sender's channel into its slot, :class:`MuxChannel`, and the guard class are in
:mod:`.channel` (a compiled module of the record path); they are imported here as well.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

from ..ids import InstanceId
from ..messenger import Messenger
from ..streaming.frames import DROPPED
from ..transport import SendAdmission
from ..transport.deadlines import LoopTimer
from .channel import DeliveryGuard, MuxChannel
from .egress import EgressBatcher, EgressSlot, OutgoingBatch
from .handlers import BATCH_HANDLER_NAMES
from .protocol import CloseReason

__all__ = ["BatcherDriver", "DeliveryGuard", "DeliveryWatch", "MuxChannel"]

logger = logging.getLogger(__name__)

DeliveryWatch = Callable[[InstanceId, int, Callable[[bool], None]], None]
"""``watch(peer, lane, told)``: ``told(True)`` once the peer acknowledged every byte sent
so far on that lane, ``told(False)`` if it never will (``QuicEndpoint.on_delivered``)."""


class BatcherDriver:
    """Drives one (peer, lane) batcher on the event loop."""

    __slots__ = (
        "_after",
        "_after_handle",
        "_delivered",
        "_loop",
        "_pending",
        "_space",
        "_timer",
        "_wake",
        "batcher",
        "closed",
        "handler",
        "last_activity",
        "messenger",
        "peer",
        "wakes",
    )

    def __init__(
        self,
        messenger: Messenger,
        peer: InstanceId,
        batcher: EgressBatcher,
        delivered: DeliveryWatch | None = None,
    ) -> None:
        """``delivered`` is how a terminal's guard learns its batch was acknowledged; None
        resolves it at admission (a test double of the messenger has no transport)."""
        self.messenger = messenger
        self._delivered = delivered
        self.peer = peer
        self.batcher = batcher
        self.handler = BATCH_HANDLER_NAMES[batcher.lane]
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Handle | None = None
        self._timer = LoopTimer(self._loop, self._timer_fired)
        """The linger and reply deadlines' one timer (it fires with the time it was armed
        for, not earlier: see LoopTimer)."""
        self._space: dict[int, tuple[EgressSlot, asyncio.Future[None]]] = {}
        """Producers waiting for room, by slot index: the slot they wait on, and its future."""
        self._pending = 0
        self._after: list[Callable[[], None]] = []
        """Terminals handed over while this turn's records waited for the poll (in order)."""
        self._after_handle: asyncio.Handle | None = None
        self.wakes = [0, 0]
        """Real wakes by source: [wake (records, control, kick), linger/reply timer]."""
        self.closed = False
        self.last_activity = self._loop.time()
        batcher.on_guard_dropped = _discard_guard

    def now(self) -> float:
        return self._loop.time()

    def wake(self) -> None:
        if self._wake is None and not self.closed:
            self._wake = self._loop.call_soon(self._run)
            self.batcher.wake_pending = True  # a channel's try_send reads it, not _wake

    def after_records(self, stage: Callable[[], None]) -> None:
        """Call ``stage`` once the records waiting for the pending wake's poll were handed
        to the transport; at once when no wake is pending (nothing of this turn waits)."""
        if self._after or (self._wake is not None and not self.closed):
            self._after.append(stage)
        else:
            stage()

    def _run(self, source: int = 0, now: float | None = None) -> None:
        """Poll and write; ``now`` is the timer's time where the timer runs it."""
        self._wake = None
        self.wakes[source] += 1
        batcher = self.batcher
        batcher.wake_pending = False
        wrote = False
        for batch in batcher.poll(self._loop.time() if now is None else now):
            self._write(batch)
            wrote = True
        self._release_space()
        if self._after and self._after_handle is None:
            if wrote:
                # Queued after the transmit the writes just asked for.
                self._after_handle = self._loop.call_soon(self._stage_after_transmit)
            else:
                self._stage_after()
        if batcher.has_ready and not batcher.parked:
            self.wake()  # the poll stopped at its budget: the rest after other work runs
        self._arm_timer()

    def _stage_after_transmit(self) -> None:
        """The turn after the records' transmit: let whoever they woke on this core run
        first (``yield_before_ends``), then stage the ends."""
        if _CAN_YIELD and self.batcher.config.yield_before_ends:
            os.sched_yield()
        self._stage_after()

    def _stage_after(self) -> None:
        """Stage the terminals :meth:`after_records` held (each wakes this driver)."""
        self._after_handle = None
        stages, self._after = self._after, []
        for stage in stages:
            stage()

    def _write(self, batch: OutgoingBatch) -> None:
        self.last_activity = self._loop.time()
        try:
            if batch.headers is None:
                outcome = self.messenger.send_message_on_lane(
                    self.peer, self.batcher.lane, self.handler, batch.payload
                )
            else:  # a singleton the messenger stages: its release decides its fate
                outcome = self.messenger.send_message_on_lane(
                    self.peer,
                    self.batcher.lane,
                    self.handler,
                    batch.payload,
                    headers=batch.headers,
                    # The guards and the fence, not the batch: its payload is staged already.
                    on_staged_release=partial(self._staged_released, batch.guards, batch.fence),
                )
        except Exception as exc:  # a refusal (TransportError) or a bug: the batch is refused
            logger.warning(
                "mux batch to %s lane %d not sent: %r", self.peer, self.batcher.lane, exc
            )
            self._refused(batch)
            return
        if isinstance(outcome, SendAdmission):
            # Parked until every batch handed over has been admitted: a parked batcher
            # stops draining its slots, so the producers wait on their byte budgets.
            self._pending += 1
            self.batcher.parked = True
            outcome.on_resolved(lambda admission: self._resolved(admission, batch))
        else:
            self._admitted(batch)

    def _resolved(self, admission: SendAdmission, batch: OutgoingBatch) -> None:
        self._pending -= 1
        if admission.error is not None:
            self._refused(batch)
        else:
            self._admitted(batch)
        self.batcher.parked = self._pending > 0
        self.wake()

    def _admitted(self, batch: OutgoingBatch) -> None:
        if batch.headers is not None:
            return  # a staged singleton: its release decides (see _staged_released)
        delivering: list[DeliveryGuard] = []
        for guard in batch.guards:
            if isinstance(guard, DeliveryGuard):
                delivering.append(guard)
            elif isinstance(guard, asyncio.Future) and not guard.done():
                guard.set_result(True)
        if delivering:
            watch = self._delivered
            if watch is None:
                for guard in delivering:
                    guard.resolve(True)
            else:
                # Asked right after the batch was written (an admission's hooks run as the
                # gate writes it), so "every byte sent so far" ends with this batch.
                watch(self.peer, self.batcher.lane, _resolve_all(delivering))
        if batch.fence is not None:
            self.batcher.lift_fence(batch.fence, self._loop.time())
            self.wake()

    def _staged_released(self, guards: list[Any], slot: EgressSlot | None, reason: str) -> None:
        """The staged singleton's payload was released: ``pulled`` is the only release in
        which the consumer's node got the record. ``slot`` is the slot it fenced."""
        pulled = reason == "pulled"
        for guard in guards:
            if isinstance(guard, DeliveryGuard):
                guard.resolve(pulled)
            elif isinstance(guard, asyncio.Future) and not guard.done():
                guard.set_result(pulled)
        if slot is None or self.closed:
            return
        if pulled:
            self.batcher.lift_fence(slot, self._loop.time())
        elif slot.live:
            logger.info(
                "staged record of slot %#010x to %s was %s, not pulled: the stream ends",
                slot.slot_id,
                self.peer,
                reason,
            )
            if reason == "refused":
                # The consumer refused it: its table retired the slot already, and its
                # LifecycleSlot cancel is on the way; nothing needs to go on the wire.
                self.batcher.close_slot(slot, CloseReason.PEER_GONE)
            else:
                # Expired (or the node is closing): the consumer's table still holds the
                # slot, so the stream's end goes on the wire before its index is reused.
                self.batcher.end_lost(slot, DROPPED, self._loop.time())
            self._release_space()
        self.wake()

    def _refused(self, batch: OutgoingBatch) -> None:
        """Any failed admission is epoch death: the batch never reached the wire and left a
        frame_seq gap in every slot it carried, and the mux does not retransmit."""
        for guard in batch.guards:
            _discard_guard(guard)
        self.batcher.epoch_death()
        self._release_space()

    def peer_lost(self) -> None:
        """The peer failed its health check: epoch death, and wake every waiting producer
        (their slots are closed now, so their sends fail instead of waiting forever)."""
        self.batcher.epoch_death()
        self._release_space()
        self.wake()

    def _arm_timer(self) -> None:
        self._timer.wake_at(self.batcher.next_deadline())

    def _timer_fired(self, now: float) -> None:
        self._run(1, now)

    # -- producers waiting on a full slot ------------------------------------------------

    def wait_space(self, slot: EgressSlot) -> asyncio.Future[None]:
        """A future that resolves once ``slot`` has room again, or is closed."""
        waiting = self._space.get(slot.index)
        if waiting is not None and waiting[0] is slot and not waiting[1].done():
            return waiting[1]
        future = self._loop.create_future()
        self._space[slot.index] = (slot, future)
        return future

    def _release_space(self) -> None:
        """Wake the producers whose slot has room or closed. The waiter keeps its own slot,
        so a slot index the batcher reused for a later stream wakes nobody by mistake."""
        if not self._space:
            return
        has_room = self.batcher.has_room
        for index, (slot, future) in list(self._space.items()):
            if not slot.live or has_room(slot):
                del self._space[index]
                if not future.done():
                    future.set_result(None)

    def close(self) -> None:
        self.closed = True
        self._timer.wake_at(None)
        for handle in (self._wake, self._after_handle):
            if handle is not None:
                handle.cancel()
        self.batcher.wake_pending = False
        self._stage_after()  # each finds its slot closed and retires Discarded
        for _, future in self._space.values():
            if not future.done():
                future.set_result(None)
        self._space.clear()


_CAN_YIELD = hasattr(os, "sched_yield")
"""Where the platform can give up the CPU (MuxConfig's ``yield_before_ends``)."""


def _discard_guard(guard: object) -> None:
    """A guard whose slot closed before it was written: that output never left."""
    if isinstance(guard, DeliveryGuard):
        guard.resolve(False)
    elif isinstance(guard, asyncio.Future) and not guard.done():
        guard.set_result(False)


def _resolve_all(guards: list[DeliveryGuard]) -> Callable[[bool], None]:
    def told(delivered: bool) -> None:
        for guard in guards:
            guard.resolve(delivered)

    return told
