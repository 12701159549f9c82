"""The egress batcher: every stream to one (peer, lane) packed into ``_stream_batch`` messages.

Sans-IO: producers :meth:`~EgressBatcher.offer` records, the peer's replies arrive through
:meth:`~EgressBatcher.on_credit` and friends, and the asyncio driver calls
:meth:`~EgressBatcher.poll` with the current time to get the batches to write now, plus
:meth:`~EgressBatcher.next_deadline` to know when to poll again. Nothing here sleeps,
allocates a task, or touches a socket.

One concern, one class, one file: the batcher owns the slot table, the producers' offers
and byte budgets, the peer's credit and control about this side's slots, the replies this
node owes the peer's slots (coalesced until written), the flush policy that decides *when*
a poll writes, the packing that decides *how* (records into batches, singletons and their
fences, the finished batch), parking, and epoch death. The packing reads and writes
nearly every field the rest keeps (the ready set, the reply tables, the linger clocks, the
urgency flags), so a separate packer would need all of it through its interface; it stays
in the class. A slot's lifecycle is :class:`~velomux_quic.mux.slots.SlotState`, moved only
through the one transition table in :mod:`.slots`; the per-record paths read the state
and never move it.

The hot paths, in their inline form on purpose: :meth:`EgressBatcher.offer` (once per
record a producer sends) stages a data record and updates the ready set itself, with
one C call to join the ready list (what :meth:`EgressBatcher._enqueued` does for a
terminal), and
:meth:`EgressBatcher._pack_ready` packs the common record (data with credit that fits the
open batch) in its own loop, appending it to the builder's buffer itself, with locals bound
once per poll, instead of going through :meth:`EgressBatcher._pack_slot` or a builder call
per record: the profiles of ``perf/tokens.py`` put these two among the largest costs of
the engine's thread, and every call or attribute lookup removed from them showed there
(the figures are in docs/performance.md). For the same reason slot states are compared
by identity on these paths (``state is _OPEN``), not by ordering.

Since both run once per record, this module is one of the record path's compiled modules
(velomux_quic.recordpath): where built, this same file is compiled, and the batcher's
fields are the C fields of ``egress.pxd``, so those two loops read and write them, and the
slots' and the builder's, without the interpreter; otherwise it runs as it is. The one
place the two runs differ is how the packing loop appends a record to the batch and takes
it off its queue (a branch on ``cython.compiled``): in C the header is written in place by
the batch codec's own append and the queue's ``popleft`` is the one bound on the slot,
where the interpreter is faster with a packed header and the queue's method looked up.

The rules, from the Batched streaming chapter:

* **Slots.** A stream is a slot: a dense index (LIFO free list, so a reused index is hot in
  cache) and an 8-bit generation bumped on every reuse, packed as a u32 SlotId.
* **Credit.** A slot opens holding C data credits and one reserved credit that only its
  terminal may spend. A record without credit waits in the slot's queue (the withheld
  queue); a producer whose queued bytes reach ``slot_byte_budget`` waits (``offer`` returns
  False) until the queue drains.
* **Lane queue bound.** What all of a batcher's slots hold together, staged and not yet
  handed to the transport, is bounded by ``peer_queue_bytes``: past it ``offer`` refuses
  the records of every slot that already holds some, so producers wait for the network
  instead of queueing megabytes that the path takes seconds to carry (and that every
  record, heartbeat and credit reply written later waits behind). A slot holding nothing
  may always stage one record, so streams whose consumers stopped reading (their withheld
  records count against the bound) slow the others down but never shut them out: memory
  per batcher is ``peer_queue_bytes`` plus one record per live slot. On ``offer`` the
  bound is one attribute load, one compare and one store (the room left, kept wherever a
  slot's ``queued_bytes`` moves), so the bound costs ``offer`` next to nothing.
* **Sequence.** ``frame_seq`` is per slot: OpenSlot takes 0, data starts at 1, and the
  ``CloseSlot{TerminalSent}`` written right after a terminal takes the next one, in the
  same batch (terminal and close are atomic).
* **Opening.** A new slot's OpenSlot goes out in a flush of its own, before any data.
* **Flush policy.** ``AutoFlush(on_admission=True)`` writes everything queued at the end of
  every wake; a linger window, ``on_complete`` and ``at_bytes`` compose as documented in
  ``mux/config.py``; ``Manual`` writes on :meth:`kick`. Under every policy a batch at a clamp
  goes, closes and terminals are urgent, and a credit reply waits at most ``reply_linger``.
* **Parking.** While a written batch waits for transport admission the batcher is parked and
  stops draining its slots: the producers then wait on their byte budgets.
* **Epochs.** A failed admission is epoch death: every live slot closes (its producer's next
  send fails), a new epoch starts, and ``batch_seq`` starts again at 0. Epochs come from an
  injected source (:data:`EpochSource`); :func:`wall_clock_epochs` is the real one.
* **Singletons.** A record no batch can hold goes alone, with the slot's next ``frame_seq``.
  Within the eager budget it is just a batch; over it, the messenger stages it, so it names
  its stream (``_mux_slot``) and fences its slot until its admission (see
  :mod:`.singleton`). The check sits on the branch where a record does not fit, so records
  that fit pay nothing for it.
* **Lifecycle.** The consumer's stop or cancel arrives by session (:meth:`on_lifecycle`)
  and reaches the slot's :class:`SlotOwner`; this node's own stops and cancels for the
  peer's streams are coalesced replies (:meth:`reply_lifecycle`).
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

try:
    import cython  # type: ignore[import-not-found, unused-ignore]
except ModuleNotFoundError:  # Cython is a build requirement, not a dependency
    from ..recordpath import shadow as cython  # type: ignore[no-redef, unused-ignore]

import itertools
import time
from collections import deque
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Final

from ..errors import UsageError
from .batch_codec import _append_data
from .config import AutoFlush, Manual, MuxConfig
from .protocol import (
    COALESCE_THRESHOLD,
    MAX_RECORDS,
    MIN_BATCH_CAP,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    BatchBuilder,
    CloseReason,
    LifecycleAction,
    RecordType,
    close_slot_body,
    lifecycle_body,
    open_slot_body,
)
from .records import _U32
from .singleton import SingletonCounters, singleton_headers
from .slots import (
    RECORDS_PER_BATCH_BUCKETS,
    EgressSlot,
    EgressStats,
    OutgoingBatch,
    QueuedTerminal,
    SlotEvent,
    SlotOwner,
    SlotsExhausted,
    SlotState,
)
from .snapshot import EgressLaneSnapshot

__all__ = [
    "RECORDS_PER_BATCH_BUCKETS",
    "EgressBatcher",
    "EgressSlot",
    "EgressStats",
    "EpochSource",
    "OutgoingBatch",
    "SlotOwner",
    "SlotsExhausted",
    "wall_clock_epochs",
]

EpochSource = Callable[[], int]
"""Where a batcher takes its epochs: each call returns the next one, above every earlier one.

A batcher takes one at construction and one at every epoch death. Share one source among
every batcher a node makes, so a re-created batcher (after idle eviction) never reuses an
epoch its predecessor used on the same (peer, lane)."""

_TERMINAL_CLOSE: Final = close_slot_body(CloseReason.TERMINAL_SENT)
"""The ``CloseSlot{TerminalSent}`` body written right after every terminal (one constant)."""
_TERMINAL_CLOSE_SIZE: Final = 14
"""Room a terminal's CloseSlot takes in a batch: its 13-byte record header and the reason."""

# Bound once, compared by identity on the per-record paths (C globals where compiled, as
# QueuedTerminal is). _CLOSED is typed as the enum, not as its member, so the packing
# loop's check at the top of a visit does not hide from the type checker that _pack_slot
# may close the slot before the check at its end.
_OPEN: Final = SlotState.OPEN
_OPENING: Final = SlotState.OPENING
_CLOSED: Final[SlotState] = SlotState.CLOSED
_DATA: Final = int(RecordType.DATA)
# Read per batch, per terminal and per OpenSlot: an enum member read off its class runs
# the enum type's attribute hook each time (see slots.py), a module global does not.
_CLOSE_SLOT: Final = int(RecordType.CLOSE_SLOT)
_OPEN_SLOT: Final = int(RecordType.OPEN_SLOT)
_CREDIT_UPDATE: Final = int(RecordType.CREDIT_UPDATE)
_LIFECYCLE_SLOT: Final = int(RecordType.LIFECYCLE_SLOT)
_OPEN_WRITTEN: Final = SlotEvent.OPEN_WRITTEN
_TERMINAL_QUEUED: Final = SlotEvent.TERMINAL_QUEUED
_TERMINAL_WRITTEN: Final = SlotEvent.TERMINAL_WRITTEN
_pack_record: Final = RECORD_HEADER.pack

_CREDIT_BODY_SIZE: Final = 4
"""A CreditUpdate's body: the u32 delta."""


def wall_clock_epochs() -> EpochSource:
    """The real epoch source: a counter seeded from the wall clock in microseconds.

    A producer that restarts keeps its InstanceId (it is in its certificate), so its new
    epochs must be above every epoch its previous process used, or the receiver would
    discard its batches as stale; a microsecond clock moves faster than epochs die."""
    return itertools.count(time.time_ns() // 1000).__next__


def _closed_slot(slot: EgressSlot) -> UsageError:
    return UsageError(
        f"slot {slot.slot_id:#010x} is {slot.state.name}: it takes no more records; "
        "a sender checks its channel's closed flag before it offers"
    )


class EgressBatcher:
    """One per (peer, lane). See the module docstring."""

    # Slots, not a dict: ``offer`` and the poll read and write the batcher's fields once per
    # record or per slot, and a slot is one descriptor read where a dict is a hash lookup
    # (compiled, they are the C fields of egress.pxd).
    __slots__ = (
        "_builder",
        "_by_session",
        "_count_close",
        "_count_credit",
        "_count_data",
        "_count_lifecycle",
        "_count_open",
        "_epochs",
        "_free",
        "_generations",
        "_kick",
        "_last_data_write",
        "_live",
        "_opens",
        "_ready",
        "_ready_count",
        "_reply_close",
        "_reply_credit",
        "_reply_lifecycle",
        "_reply_since",
        "_room",
        "_slots",
        "_staged_since",
        "_urgent",
        "batch_seq",
        "byte_cap",
        "config",
        "counters",
        "eager_budget",
        "epoch",
        "lane",
        "on_guard_dropped",
        "parked",
        "policy",
        "poll_budget",
        "quantum",
        "queue_limit",
        "stats",
        "wake_pending",
    )

    def __init__(
        self,
        lane: int,
        config: MuxConfig,
        *,
        byte_cap: int | None = None,
        eager_budget: int | None = None,
        counters: SingletonCounters | None = None,
        epochs: EpochSource | None = None,
    ) -> None:
        """``epochs`` is where this batcher takes its epochs (None: a fresh
        :func:`wall_clock_epochs`); a node passes one source to every batcher it makes."""
        self.lane = lane
        self.config = config
        self.policy = config.flush_policy
        cap = min(config.max_batch_bytes, COALESCE_THRESHOLD, byte_cap or COALESCE_THRESHOLD)
        self.byte_cap = max(MIN_BATCH_CAP, cap)
        self.quantum = max(1, self.byte_cap // 4)
        """Bytes of one slot's records per visit before the next slot's turn (fairness)."""
        self.poll_budget = 4 * self.byte_cap
        """Bytes of records one poll packs at most (the rest waits for the next poll)."""
        self.eager_budget = self.byte_cap if eager_budget is None else eager_budget
        """The largest batch the messenger sends inline to the peer. A singleton above it
        is staged, so it must name its stream and fence its slot; this has to be the
        messenger's own number, or a staged batch would go out unfenced and unnamed."""
        self.counters = counters if counters is not None else SingletonCounters()
        self.on_guard_dropped: Callable[[Any], None] | None = None
        """Told each retirement guard that a closing slot still held (never admitted)."""
        self._epochs = epochs if epochs is not None else wall_clock_epochs()
        self.epoch = self._epochs()
        self.batch_seq = 0
        self.stats = EgressStats()
        self.parked = False
        self.wake_pending = False
        """The driver's wake is scheduled: set and cleared by the driver (``mux/driver.py``),
        read by each channel's ``try_send``, which wakes the driver only when it is not.
        Here rather than on the driver because the compiled channel reads a batcher field
        in C, and the driver's own field by a lookup on a Python object, once per record."""
        self.queue_limit = config.peer_queue_bytes
        """Bytes all slots may hold together before ``offer`` refuses a non-empty slot."""
        self._room = self.queue_limit
        """``queue_limit`` less the bytes of every record queued in this batcher's slots
        (the sum of the slots' ``queued_bytes``, kept as they move): one field, so ``offer``
        pays one load, one compare and one store for the bound."""
        self._slots: list[EgressSlot | None] = []
        self._generations: list[int] = []
        self._free: list[int] = []
        self._by_session: dict[int, EgressSlot] = {}
        self._opens: deque[EgressSlot] = deque()
        self._ready: list[EgressSlot] = []
        """The sendable slots, in the order they became sendable: a list and a mark on each
        slot (``_in_ready``) rather than a dict, which a poll emptied and the next pass's
        offers grew again, table by table, once per record (see :meth:`_mark_ready`). A
        freed slot's entry stays until the next poll, which skips it as closed."""
        self._ready_count = 0
        """The marked slots in :attr:`_ready` (its freed slots' entries not counted)."""
        self._live = 0
        self._reply_credit: dict[int, int] = {}
        self._reply_close: dict[int, int] = {}
        self._reply_lifecycle: dict[int, int] = {}  # session -> action (cancel beats stop)
        self._reply_since: float | None = None
        self._staged_since: float | None = None
        """When the first record not yet written was staged (the linger window's start)."""
        self._last_data_write = float("-inf")
        self._kick = False
        self._urgent = False
        self._builder = BatchBuilder(self.byte_cap)
        # Record types of the batch being built, added to the stats once per batch.
        self._count_data = self._count_open = self._count_close = self._count_credit = 0
        self._count_lifecycle = 0

    # -- slots ---------------------------------------------------------------------------

    @property
    def live_slots(self) -> int:
        return self._live

    def open_slot(
        self,
        anchor_id: int,
        session_id: int,
        *,
        credit: int | None = None,
        budget: int | None = None,
    ) -> EgressSlot:
        """A new stream on this lane; its OpenSlot goes out in a flush of its own."""
        if self._free:
            index = self._free.pop()
        else:
            index = len(self._slots)
            if index >= self.config.max_slots_per_table:
                raise SlotsExhausted(f"all {index} slot indices of lane {self.lane} are live")
            self._slots.append(None)
            self._generations.append(0)
        slot = EgressSlot(
            index,
            self._generations[index],
            anchor_id,
            session_id,
            credit if credit is not None else self.config.initial_credit,
            budget if budget is not None else self.config.slot_byte_budget,
        )
        self._slots[index] = slot
        self._by_session[session_id] = slot
        self._opens.append(slot)
        self._live += 1
        return slot

    def slot(self, slot_id_: int) -> EgressSlot | None:
        """The live slot with exactly this SlotId (index and generation), if any."""
        if not 0 <= slot_id_ <= _U32:
            raise ValueError(f"slot id must be a u32, got {slot_id_}")
        index = slot_id_ >> 8  # the index and generation, as slot_index and slot_generation
        if index >= len(self._slots):
            return None
        slot = self._slots[index]
        if slot is None or slot.generation != slot_id_ & 0xFF:
            return None
        return slot

    def _free_slot(self, slot: EgressSlot, event: SlotEvent) -> None:
        """Give the slot's index back: it ends by ``event`` (its terminal written, or
        closed without one). A slot is freed once; a second time is a UsageError."""
        slot.advance(event)
        slot.owner = None  # the sender's state refers to the slot: no cycle outlives it
        if self._slots[slot.index] is slot:
            self._slots[slot.index] = None
            self._generations[slot.index] = (slot.generation + 1) & 0xFF
            self._free.append(slot.index)
        self._by_session.pop(slot.session_id, None)
        if slot._in_ready:
            slot._in_ready = False
            self._ready_count -= 1
            if not self._ready_count:
                self._ready.clear()  # every entry left is a freed slot's
        self._live -= 1

    def _close_slot(
        self, slot: EgressSlot, told: CloseReason | LifecycleAction | None = None
    ) -> None:
        """The slot ends without its own terminal (peer closed it, epoch death, cancel).

        Queued records are discarded. A retirement guard the slot still holds (a terminal
        queued behind a fence or missing credit, or a connect waiting on its OpenSlot)
        goes to :attr:`EgressBatcher.on_guard_dropped`: that output never left. The owner
        is told ``told`` when it is not None (None: the producer's own abort).
        """
        self._discard_queued(slot)
        owner = slot.owner
        self._free_slot(slot, SlotEvent.CLOSED)
        self._drop_guard(slot)
        if owner is not None and told is not None:
            owner.slot_closed(told)

    def _discard_queued(self, slot: EgressSlot) -> None:
        """Drop every record ``slot`` holds unwritten; their bytes leave the lane bound."""
        slot.queue.clear()
        self._room += slot.queued_bytes
        slot.queued_bytes = 0

    def _drop_guard(self, slot: EgressSlot) -> None:
        """Hand the retirement guard ``slot`` holds, if any, to ``on_guard_dropped``: the
        output it guards never left."""
        guard, slot.guard = slot.guard, None
        if guard is not None and self.on_guard_dropped is not None:
            self.on_guard_dropped(guard)

    # -- producers -----------------------------------------------------------------------

    def offer(self, slot: EgressSlot, body: bytes, now: float | Callable[[], float]) -> bool:
        """Stage one record; False when the slot's byte budget is full (the producer waits).

        The budget is checked against what is already queued, not with the new record
        added, so a record larger than the whole budget is still taken when the queue is
        below it (otherwise a 4 MiB item could never be sent on a 1 MiB slot). The lane
        queue bound (``peer_queue_bytes``) is checked the same way, and only for a slot
        that already holds records: a slot holding nothing always takes one.

        ``now`` is the time, or the clock that tells it: a producer's channel passes its
        loop's clock, which is read only when the record starts a linger window (once per
        flush), not once per record.
        """
        state = slot.state
        if state is not _OPEN and state is not _OPENING:
            raise _closed_slot(slot)
        queued = slot.queued_bytes
        if queued >= slot.budget:
            return False
        room = self._room
        if room <= 0 and queued:
            self.stats.queue_full += 1
            return False
        size = len(body)
        slot._append(body)
        slot.queued_bytes = queued + size
        self._room = room - size
        # What _enqueued does for a data record, inlined (this runs once per record). The
        # slot is OPEN or OPENING, so no terminal is queued: its head is a data record.
        if slot.credit > 0:
            if state is _OPEN:
                if not slot.fenced:  # sendable: the common case, an open slot with credit
                    self._mark_ready(slot)
                    if self._staged_since is None:
                        self._staged_since = now() if callable(now) else now
            elif self._staged_since is None:
                # OpenSlot not written yet: ready once it is, its linger window starts now.
                self._staged_since = now() if callable(now) else now
        elif state is _OPEN and not slot.exhausted_once:
            slot.exhausted_once = True
            self.stats.credit_exhausted += 1
        return True

    def offer_terminal(self, slot: EgressSlot, body: bytes, now: float, guard: Any = None) -> None:
        """Stage the stream's terminal; never refused (it spends the reserved credit)."""
        if slot.state > _OPEN:
            raise _closed_slot(slot)
        slot.advance(_TERMINAL_QUEUED)
        self._queue_terminal(slot, body, now, guard)

    def _queue_terminal(self, slot: EgressSlot, body: bytes, now: float, guard: Any) -> None:
        """Queue ``body`` as ``slot``'s terminal, urgent (its state already says so)."""
        slot.guard = guard
        self._urgent = True
        slot.queue.append(QueuedTerminal(body))
        slot.queued_bytes += len(body)
        self._room -= len(body)
        self._enqueued(slot, True, now)

    def _enqueued(self, slot: EgressSlot, terminal: bool, now: float) -> None:
        """A record joined ``slot``'s queue: update the ready set, the linger clock and the
        exhaustion count."""
        if slot.sendable or (slot.open_pending and (terminal or slot.credit > 0)):
            # A slot whose OpenSlot is not written yet becomes ready when it is; its record
            # still starts the linger window now, or no deadline would ever cover it.
            if slot.sendable:
                self._mark_ready(slot)
            if self._staged_since is None:
                self._staged_since = now
        elif (
            not terminal and slot.credit <= 0 and not slot.exhausted_once and not slot.open_pending
        ):
            slot.exhausted_once = True
            self.stats.credit_exhausted += 1

    def _mark_ready(self, slot: EgressSlot) -> bool:
        """Put ``slot`` in the ready list unless it is there already (see ``_ready``);
        whether it joined now."""
        if slot._in_ready:
            return False
        slot._in_ready = True
        self._ready.append(slot)
        self._ready_count += 1
        return True

    def _take_ready(self) -> list[EgressSlot]:
        """Empty the ready list, every slot in it unmarked, and return what it held (freed
        slots' entries too: they are closed)."""
        slots = self._ready
        self._ready = []
        self._ready_count = 0
        for slot in slots:
            slot._in_ready = False
        return slots

    def end_now(self, slot: EgressSlot, body: bytes, now: float, guard: Any = None) -> None:
        """The producer's node is closing: drop the records not written yet and stage the
        terminal ``body`` in their place, so the stream ends on the wire at once."""
        if slot.state > _OPEN:
            raise _closed_slot(slot)
        self._discard_queued(slot)
        self.offer_terminal(slot, body, now, guard)

    @property
    def queued_bytes(self) -> int:
        """Bytes of every record queued in this batcher's slots, with or without credit
        (what the lane queue bound ``peer_queue_bytes`` counts)."""
        return self.queue_limit - self._room

    def has_room(self, slot: EgressSlot) -> bool:
        """Whether :meth:`offer` would take a data record for ``slot`` now (its byte
        budget and the lane queue bound both allow it)."""
        queued = slot.queued_bytes
        return queued < slot.budget and (not queued or self._room > 0)

    def close_slot(self, slot: EgressSlot, told: CloseReason) -> None:
        """End ``slot`` without its terminal, telling its owner ``told`` (a staged record
        of it was released unpulled: the consumer never got it, the stream cannot go on)."""
        if slot.live:
            self._close_slot(slot, told)

    def end_lost(self, slot: EgressSlot, body: bytes, now: float) -> None:
        """A staged record of ``slot`` expired unpulled: the consumer never got it and the
        stream cannot go on. End the stream on the wire, not only here.

        Freeing the index at once, as :meth:`close_slot` does, let the next stream on this
        lane take it while the consumer's table still held the slot, waiting for the lost
        record: that stream was refused as a collision. Instead, whatever waits unwritten
        (a terminal and its guard too) is discarded, the fence lifts, and ``body`` is
        staged as the terminal, in turn after the lost record. The consumer's table then
        holds the slot's close before any stream that reuses the index, which is what lets
        it move the old slot aside; the index is freed once the terminal is written. The
        owner is told ``PEER_GONE`` (its next send fails)."""
        if not slot.live:
            return
        self._discard_queued(slot)
        self._drop_guard(slot)
        slot.fenced = False
        if slot.state <= _OPEN:
            slot.advance(_TERMINAL_QUEUED)
        self._queue_terminal(slot, body, now, None)
        owner = slot.owner
        if owner is not None:
            owner.slot_closed(CloseReason.PEER_GONE)

    def cancel_slot(self, slot: EgressSlot) -> None:
        """The local producer gave up without a terminal (its sender was cancelled)."""
        if slot.live:
            self._close_slot(slot)

    # -- the peer's control about our slots ----------------------------------------------

    def on_credit(self, slot_id_: int, delta: int, now: float) -> bool:
        """A CreditUpdate for one of our slots. Refused (and counted) for an index we never
        opened; silently dropped for a retired generation (an ordinary close/reopen race)."""
        slot = self._control_target(slot_id_)
        if slot is None:
            return False
        slot.credit += delta
        slot.exhausted_once = False
        if slot.terminal_queued and slot.queue:
            # A terminal that waited behind credit-starved records moves on its own under
            # every policy (the end of a stream must not wait for the next flush_batch).
            self._urgent = True
        if slot.sendable and self._mark_ready(slot) and self._staged_since is None:
            self._staged_since = now
        return True

    def on_credits(self, grants: list[tuple[int, int]], now: float) -> None:
        """A batch's CreditUpdates for our slots, in order (:meth:`on_credit` each): ingress
        collects them as it walks the batch and hands them over in one call, since a
        return of credit comes for many slots at once."""
        for slot_id_, delta in grants:
            self.on_credit(slot_id_, delta, now)

    def on_peer_close(self, slot_id_: int, reason: CloseReason) -> bool:
        """The receiver closed our slot (UnknownSlot: its anchor is gone; MalformedBatch)."""
        slot = self._control_target(slot_id_)
        if slot is None:
            return False
        self._close_slot(slot, reason)
        return True

    def on_lifecycle(self, session_id: int, action: LifecycleAction) -> EgressSlot | None:
        """The consumer's stop or cancel for the stream it knows as ``session_id``.

        LifecycleSlot names the session, and a live slot is looked up by it, so a late
        signal cannot hit a later stream that reuses the slot id. Stop tells the owner and
        leaves the slot open for the remaining output. Cancel closes the slot: its queued
        records are discarded, the producer's next send fails, a queued terminal's guard
        is dropped (the output never left), and the owner is told. Returns the slot the
        signal applied to (None: no live slot has that session, a late signal).
        """
        slot = self._by_session.get(session_id)
        if slot is None or not slot.live:
            return None
        if action == LifecycleAction.CANCEL:
            self._close_slot(slot, LifecycleAction.CANCEL)
        elif slot.owner is not None:
            slot.owner.slot_stopped()
        return slot

    def _control_target(self, slot_id_: int) -> EgressSlot | None:
        if slot_id_ >> 8 >= len(self._slots):  # the index (``slot`` checks the id's range)
            self.stats.control_refused += 1
            return None
        return self.slot(slot_id_)

    # -- replies for the peer's slots (from this node's ingress) -------------------------

    def reply_credit(self, peer_slot: int, delta: int, now: float) -> None:
        """Coalesced: credit for one peer slot accumulates into one u32 until written."""
        if peer_slot in self._reply_close:
            return  # a close supersedes credit
        self._reply_credit[peer_slot] = self._reply_credit.get(peer_slot, 0) + delta
        if self._reply_since is None:
            self._reply_since = now

    def queued_records(self) -> tuple[int, int]:
        """(staged, withheld): records waiting with credit, and records waiting for it.
        O(live slots): for metrics at scrape time, never on the hot path."""
        staged = withheld = 0
        for slot in self._slots:
            if slot is None or not slot.queue:
                continue
            if not slot.fenced and (slot.credit > 0 or type(slot.queue[0]) is QueuedTerminal):
                staged += min(len(slot.queue), max(slot.credit, 1))
                withheld += max(0, len(slot.queue) - max(slot.credit, 1))
            else:
                withheld += len(slot.queue)
        return staged, withheld

    def snapshot(self) -> EgressLaneSnapshot:
        """A frozen picture of this batcher. O(live slots): never on the hot path."""
        states: dict[SlotState, int] = {state: 0 for state in SlotState if state is not _CLOSED}
        fenced = queued_bytes = 0
        for slot in self._slots:
            if slot is None:
                continue
            states[slot.state] += 1
            fenced += slot.fenced
            queued_bytes += slot.queued_bytes
        staged, withheld = self.queued_records()
        return EgressLaneSnapshot(
            epoch=self.epoch,
            batch_seq=self.batch_seq,
            live_slots=self._live,
            slot_states=MappingProxyType(states),
            fenced_slots=fenced,
            queued_records=staged,
            withheld_records=withheld,
            queued_bytes=queued_bytes,
            queue_limit=self.queue_limit,
            parked=self.parked,
            epoch_deaths=self.stats.epoch_deaths,
        )

    def pending_closes(self) -> int:
        return len(self._reply_close)

    def reply_close(self, peer_slot: int, reason: CloseReason) -> None:
        self._reply_credit.pop(peer_slot, None)
        self._reply_close[peer_slot] = int(reason)
        self._urgent = True

    def reply_lifecycle(self, session: int, action: LifecycleAction) -> None:
        """Stop or cancel the peer's stream ``session``: one coalesced entry per session,
        cancel beating stop (a stop after a cancel changes nothing). Urgent, like a close:
        the producer is wasting work until it hears."""
        lifecycle = self._reply_lifecycle
        if lifecycle.get(session, -1) < action:
            lifecycle[session] = int(action)
        self._urgent = True

    def pending_lifecycle(self, session: int) -> LifecycleAction | None:
        """The stop or cancel waiting to be written for ``session``, if any."""
        action = self._reply_lifecycle.get(session)
        return None if action is None else LifecycleAction(action)

    # -- flushing ------------------------------------------------------------------------

    @property
    def has_ready(self) -> bool:
        """Some slot has records it may send now (a poll that hit its budget left them)."""
        return self._ready_count > 0

    def kick(self) -> None:
        """``flush_batch()``: write what is staged at the next poll (survives a clamp)."""
        self._kick = True

    def next_deadline(self) -> float | None:
        """When :meth:`poll` has timed work to do (linger or reply window).

        None while parked: admission wakes the driver, and a deadline already past would
        otherwise re-arm a timer whose poll writes nothing, over and over."""
        if self.parked:
            return None
        deadlines: list[float] = []
        if self._reply_since is not None:
            deadlines.append(self._reply_since + self.config.reply_linger)
        policy = self.policy
        if (
            isinstance(policy, AutoFlush)
            and policy.max_linger is not None
            and self._ready_count
            and self._staged_since is not None
        ):
            deadlines.append(self._staged_since + policy.max_linger)
        return min(deadlines) if deadlines else None

    def _should_write(self, now: float) -> bool:
        if self._opens or self._urgent or self._kick:
            return True
        replies_due = self._reply_since is not None and (
            now >= self._reply_since + self.config.reply_linger
        )
        if replies_due:
            return True
        if not self._ready_count:
            return False
        policy = self.policy
        if isinstance(policy, Manual):
            return False
        if policy.max_linger is None:
            return True  # on_admission: the end of every wake
        staged = self._staged_since if self._staged_since is not None else now
        if now >= staged + policy.max_linger:
            return True
        if policy.at_bytes is not None and self._staged_bytes() >= policy.at_bytes:
            return True
        if policy.on_complete and self._ready_count >= self._live:
            return now >= max(staged, self._last_data_write + policy.max_linger)
        return False

    def _staged_bytes(self) -> int:
        total = 0
        for slot in self._ready:
            if slot._in_ready:  # not a freed slot's entry
                total += slot.queued_bytes
        return total

    def poll(self, now: float) -> list[OutgoingBatch]:
        """The batches to write now, in order. Empty while parked."""
        if self.parked:
            return []
        out: list[OutgoingBatch] = []
        if self._opens:
            self._write_opens(out)
        if not self._should_write(now):
            return out
        self._kick = False
        self._urgent = False
        builder = self._builder
        guards: list[Any] = []
        carries_data = False
        if self._ready_count:
            guards, carries_data = self._pack_ready(out, guards, carries_data)
        self._add_replies(out, guards, carries_data)
        self._staged_since = None
        if builder.count:
            out.append(self._finish(guards, carries_data))
        if any(batch.carries_data for batch in out):
            self._last_data_write = now
        return out

    # -- packing: what one poll writes, record by record ---------------------------------

    def _pack_ready(
        self, out: list[OutgoingBatch], guards: list[Any], carries_data: bool
    ) -> tuple[list[Any], bool]:
        """Pack the ready slots, fairly and boundedly.

        Fair: slots are served in rounds, each visit taking at most ``quantum`` bytes of a
        slot's records (at least one record), so 64 streams of 16 KiB items interleave
        item by item instead of one stream's whole credit window going out before the
        next stream's first item (which, behind a slow lane, starved the last streams
        past their watchdogs). A token workload, one record per slot per pass, is one
        round. Bounded: one poll packs at most ``poll_budget`` bytes of records; the
        slots left over stay ready, in their order, and the next poll (the driver wakes
        again at once) writes them whatever the policy. So a poll never hands the
        transport more than a few batches beyond what it admits, and a parked batcher
        really stops draining its slots.

        A visited slot leaves the ready set unless it is carried to the next round:
        afterwards it is empty, out of credit, fenced or closed, and whatever makes it
        sendable again (an offer, a grant, a lifted fence) puts it back.
        """
        builder = self._builder
        slots = self._take_ready()
        stats = self.stats
        quantum = self.quantum
        budget = self.poll_budget
        # The common record is appended to the builder's buffer here, one call less per
        # record than add_data_if_fits: ``room`` is the batch's records still allowed,
        # ``pending`` those appended and not yet reported to the builder (added()).
        buf = builder.buffer
        cap = builder.cap - RECORD_HEADER_SIZE
        pack_header = _pack_record
        room = MAX_RECORDS - builder.count
        pending = 0
        packed = 0  # Data records packed inline by this poll, counted once at the end
        while slots:
            carried: list[EgressSlot] = []
            for position, slot in enumerate(slots):
                if budget <= 0:
                    carried = slots[position:] + carried
                    break
                if slot.state is _CLOSED:
                    continue
                queue = slot.queue
                # Its length, kept as records are taken: compiled, a deque's truth is a
                # call through its type, and the loop would ask it up to four times.
                queued = len(queue)
                # The common record, inlined: data with credit that fits the open batch.
                credit = slot.credit
                first = seq = slot.next_seq
                taken = 0
                if queued and credit > 0:
                    sid = slot.slot_id
                    while True:
                        body = queue[0]
                        if type(body) is QueuedTerminal:
                            break
                        length = len(body)
                        if len(buf) + length > cap or pending >= room:
                            break
                        if cython.compiled:
                            # The header written in place; the queue's popleft bound once.
                            _append_data(buf, sid, seq, body)
                            slot._popleft()
                        else:
                            buf += pack_header(_DATA, sid, seq, length)
                            buf += body
                            queue.popleft()
                        queued -= 1
                        pending += 1
                        taken += length
                        seq += 1
                        credit -= 1
                        if not queued or credit <= 0 or taken >= quantum:
                            break
                if seq != first:
                    packed += seq - first
                    slot.next_seq = seq
                    slot.credit = credit
                    slot.queued_bytes -= taken
                    self._room += taken
                    carries_data = True
                if queued and (
                    type(queue[0]) is QueuedTerminal or (credit > 0 and taken < quantum)
                ):
                    # A terminal, a full batch or a record no batch can hold.
                    builder.added(pending)
                    self._count_data += packed
                    pending = packed = 0
                    guards, carries_data, more = self._pack_slot(
                        slot, out, guards, carries_data, quantum - taken
                    )
                    buf = builder.buffer
                    room = MAX_RECORDS - builder.count
                    taken += more
                    queued = len(queue)
                budget -= taken
                if not queued or slot.state is _CLOSED or slot.fenced:
                    continue
                if slot.credit <= 0 and type(queue[0]) is not QueuedTerminal:
                    if not slot.exhausted_once:
                        slot.exhausted_once = True
                        stats.credit_exhausted += 1
                    continue
                carried.append(slot)  # its quantum is spent; it goes again next round
            slots = carried
            if budget <= 0:
                break
        builder.added(pending)
        self._count_data += packed
        if slots:
            for slot in slots:
                if slot.state is not _CLOSED:
                    self._mark_ready(slot)
            self._kick = True  # the rest goes at the next poll, whatever the policy
        return guards, carries_data

    def _pack_slot(
        self,
        slot: EgressSlot,
        out: list[OutgoingBatch],
        guards: list[Any],
        carries_data: bool,
        limit: int,
    ) -> tuple[list[Any], bool, int]:
        """Pack one slot's queue record by record, with every rule: a terminal and its
        close, a batch that fills up (finished into ``out``), a record no batch can hold
        (a singleton); data records stop once ``limit`` bytes were taken (a terminal is
        never held back by it). Returns the guards of the batch still open, whether that
        batch carries data, and the bytes taken."""
        builder = self._builder
        queue = slot.queue
        taken = 0
        while queue:
            head = queue[0]
            terminal = type(head) is QueuedTerminal
            body = head.body if isinstance(head, QueuedTerminal) else head
            if not terminal and (slot.credit <= 0 or taken >= limit):
                break
            # A terminal needs room for its CloseSlot too (13 B header + 1 B reason).
            needed = len(body) + (_TERMINAL_CLOSE_SIZE if terminal else 0)
            if not builder.fits(needed):
                if builder.count == 0:
                    # No batch can hold it: it goes alone, as a singleton. A staged one
                    # fences the slot; an inline one rides the ordered lane, so the slot's
                    # next records may follow it at once.
                    out.append(self._singleton(slot, body, terminal))
                    taken += len(body)
                    if terminal or slot.fenced:
                        break
                    continue
                out.append(self._finish(guards, carries_data))
                guards, carries_data = [], False
                continue
            queue.popleft()
            taken += len(body)
            slot.queued_bytes -= len(body)
            self._room += len(body)
            builder.add_data(slot.slot_id, slot.next_seq, body)
            slot.next_seq += 1
            carries_data = True
            self._count_data += 1
            if terminal:
                slot.reserve = 0
                self._count_close += 1
                builder.add(_CLOSE_SLOT, slot.slot_id, slot.next_seq, _TERMINAL_CLOSE)
                if slot.guard is not None:
                    guards.append(slot.guard)
                    slot.guard = None
                self._free_slot(slot, _TERMINAL_WRITTEN)
                break
            slot.credit -= 1
            if slot.credit <= 0 and queue and not slot.exhausted_once:
                slot.exhausted_once = True
                self.stats.credit_exhausted += 1
        return guards, carries_data, taken

    def _singleton(self, slot: EgressSlot, body: bytes, terminal: bool) -> OutgoingBatch:
        """The head record of ``slot``, too large for any batch, in a batch of its own.

        It takes the slot's next ``frame_seq`` and spends one data credit like any record
        (a terminal spends the reserve and takes its ``CloseSlot{TerminalSent}`` along).
        When the batch is over the eager budget the messenger will stage it: it then
        carries the ``_mux_slot`` header, and, unless it ended the slot, fences the slot
        until its admission (:meth:`lift_fence`). A staged terminal's retirement guard
        goes with the batch, so the staged send's admission reports it.

        Built in a builder of its own: the batcher's reusable builder would otherwise keep
        a multi-megabyte buffer after its reset.
        """
        slot.queue.popleft()
        slot.queued_bytes -= len(body)
        self._room += len(body)
        builder = BatchBuilder(MIN_BATCH_CAP)  # fits() is never asked: the cap is unused
        seq = slot.next_seq
        builder.add(_DATA, slot.slot_id, seq, body)
        slot.next_seq = seq + 1
        guards: list[Any] = []
        if terminal:
            slot.reserve = 0
            builder.add(_CLOSE_SLOT, slot.slot_id, seq + 1, _TERMINAL_CLOSE)
            self._count_close += 1
            if slot.guard is not None:
                guards.append(slot.guard)
                slot.guard = None
        else:
            slot.credit -= 1
            if slot.credit <= 0 and slot.queue and not slot.exhausted_once:
                slot.exhausted_once = True
                self.stats.credit_exhausted += 1
        self._count_data += 1
        staged = builder.size > self.eager_budget
        # A staged batch arrives through rendezvous, outside the lane's order, so it takes
        # no lane batch_seq: numbering it would make the lane's next batch look like it
        # skipped one, and the receiver count a gap for every staged singleton.
        batch = self._finish(guards, True, builder, sequenced=not staged)
        counters = self.counters
        if staged:
            counters.staged += 1
            batch.headers = singleton_headers(self.epoch, slot.slot_id, slot.session_id)
            if not terminal:
                slot.fenced = True
                batch.fence = slot
                counters.fences_raised += 1
        else:
            counters.inline += 1
        if terminal:
            self._free_slot(slot, _TERMINAL_WRITTEN)
        return batch

    def lift_fence(self, slot: EgressSlot, now: float) -> None:
        """The staged singleton that fenced ``slot`` was admitted: its later records (its
        close included) may go now. Only that admission lifts the fence; a refused one is
        epoch death, which closes the slot instead. Like a credit grant, it makes a queued
        terminal urgent, so the end of a stream never waits for the next flush_batch."""
        if not slot.fenced:
            return
        slot.fenced = False
        if not slot.live:
            return
        if slot.terminal_queued:
            self._urgent = True
        if slot.sendable and self._mark_ready(slot) and self._staged_since is None:
            self._staged_since = now

    def _write_opens(self, out: list[OutgoingBatch]) -> None:
        builder = self._builder
        guards: list[Any] = []
        while self._opens:
            slot = self._opens.popleft()
            if not slot.live:
                continue
            body = open_slot_body(slot.anchor_id, slot.session_id)
            if not builder.fits(len(body)):
                out.append(self._finish(guards, False))
                guards = []
            builder.add(_OPEN_SLOT, slot.slot_id, 0, body)
            self._count_open += 1
            slot.advance(_OPEN_WRITTEN)
            if slot.guard is not None:  # connect() waits for this OpenSlot's admission
                guards.append(slot.guard)
                slot.guard = None
            if slot.sendable:
                self._mark_ready(slot)
        if builder.count:
            out.append(self._finish(guards, False))

    def _add_replies(self, out: list[OutgoingBatch], guards: list[Any], carries_data: bool) -> None:
        builder = self._builder
        for peer_slot, reason in self._reply_close.items():
            body = close_slot_body(CloseReason(reason))
            if not builder.fits(len(body)):
                out.append(self._finish(guards, carries_data))
                guards.clear()
            builder.add(RecordType.CLOSE_SLOT, peer_slot, 0, body)
            self._count_close += 1
        if self._reply_lifecycle:
            self._add_lifecycle(out, guards, carries_data)
        for peer_slot, delta in self._reply_credit.items():
            if not builder.fits(_CREDIT_BODY_SIZE):
                out.append(self._finish(guards, carries_data))
                guards.clear()
            builder.add_credit(peer_slot, delta & 0xFFFF_FFFF)
            self._count_credit += 1
        self._reply_close.clear()
        self._reply_credit.clear()
        self._reply_since = None

    def _add_lifecycle(
        self, out: list[OutgoingBatch], guards: list[Any], carries_data: bool
    ) -> None:
        """Write the coalesced LifecycleSlot replies. The record's slot field is 0: the
        session in the body is what names the stream."""
        builder = self._builder
        lifecycle = self._reply_lifecycle
        for session, action in lifecycle.items():
            body = lifecycle_body(session, action)
            if not builder.fits(len(body)):
                out.append(self._finish(guards, carries_data))
                guards.clear()
            builder.add(RecordType.LIFECYCLE_SLOT, 0, 0, body)
        self._count_lifecycle += len(lifecycle)
        self.counters.lifecycle_sent += len(lifecycle)
        lifecycle.clear()

    def _finish(
        self,
        guards: list[Any],
        carries_data: bool,
        builder: BatchBuilder | None = None,
        *,
        sequenced: bool = True,
    ) -> OutgoingBatch:
        """The batch in ``builder``; ``sequenced`` False (a staged singleton) carries the
        lane's next ``batch_seq`` without taking it."""
        if builder is None:
            builder = self._builder
        count = builder.count
        payload = builder.finish(self.lane, self.epoch, self.batch_seq)
        if sequenced:
            self.batch_seq = (self.batch_seq + 1) & 0xFFFF_FFFF
        self.stats.batches_sent += 1
        stats = self.stats
        stats.records_sent += count
        bucket = max(0, (count - 1).bit_length())
        if bucket < len(stats.batch_size_buckets):
            stats.batch_size_buckets[bucket] += 1
        types = stats.record_types
        types[_DATA] += self._count_data
        types[_OPEN_SLOT] += self._count_open
        types[_CLOSE_SLOT] += self._count_close
        types[_CREDIT_UPDATE] += self._count_credit
        types[_LIFECYCLE_SLOT] += self._count_lifecycle
        self._count_data = self._count_open = self._count_close = self._count_credit = 0
        self._count_lifecycle = 0
        builder.reset()
        return OutgoingBatch(payload, count, carries_data, list(guards))

    # -- peer loss -----------------------------------------------------------------------

    def epoch_death(self) -> int:
        """A batch was refused: close every live slot and start a new epoch."""
        closed = 0
        for slot in list(self._slots):
            if slot is not None and slot.live:
                self._close_slot(slot, CloseReason.PEER_GONE)
                closed += 1
        self._opens.clear()
        self._take_ready()
        self._reply_credit.clear()
        self._reply_close.clear()
        # Pending LifecycleSlot replies stay: they name the peer's streams by session, which
        # this side's new epoch does not change.
        self._reply_since = None
        self._staged_since = None
        self.parked = False
        self.epoch = self._epochs()
        self.batch_seq = 0
        self.stats.epoch_deaths += 1
        return closed
