"""The egress batcher: every stream to one (peer, lane) packed into ``_stream_batch`` messages.

Sans-IO: producers :meth:`~EgressBatcher.offer` records, the peer's replies arrive through
:meth:`~EgressBatcher.on_credit` and friends, and the asyncio driver calls
:meth:`~EgressBatcher.poll` with the current time to get the batches to write now, plus
:meth:`~EgressBatcher.next_deadline` to know when to poll again. Nothing here sleeps,
allocates a task, or touches a socket.

The rules, from the design chapter:

* **Slots.** A stream is a slot: a dense index (LIFO free list, so a reused index is hot in
  cache) and an 8-bit generation bumped on every reuse, packed as a u32 SlotId.
* **Credit.** A slot opens holding C data credits and one reserved credit that only its
  terminal may spend. A record without credit waits in the slot's queue (the withheld
  queue); a producer whose queued bytes reach ``slot_byte_budget`` waits (``offer`` returns
  False) until the queue drains.
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
  send fails), a new epoch starts, and ``batch_seq`` starts again at 0.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import AutoFlush, Manual, MuxConfig
from .protocol import (
    COALESCE_THRESHOLD,
    MIN_BATCH_CAP,
    BatchBuilder,
    CloseReason,
    LifecycleAction,
    RecordType,
    close_slot_body,
    credit_body,
    open_slot_body,
    slot_generation,
    slot_id,
    slot_index,
)

__all__ = ["EgressBatcher", "EgressSlot", "EgressStats", "OutgoingBatch", "SlotsExhausted"]

_EPOCHS = itertools.count(time.time_ns() // 1000)
"""One process-wide epoch counter, so a re-created batcher never reuses an epoch.

Seeded from the wall clock in microseconds: a producer that restarts keeps its InstanceId
(it is in its certificate), so its new epochs must be above every epoch its previous
process used, or the receiver would discard its batches as stale."""


class SlotsExhausted(RuntimeError):
    """Every slot index of this (peer, lane) table is live."""


RECORDS_PER_BATCH_BUCKETS = tuple(2**i for i in range(12))
"""Upper bounds of the records-per-batch histogram: 1 doubling to 2048 (12 buckets)."""


class EgressStats:
    """Plain counters (exported at scrape time by the driver)."""

    __slots__ = (
        "batch_size_buckets",
        "batches_sent",
        "control_refused",
        "credit_exhausted",
        "epoch_deaths",
        "record_types",
        "records_sent",
    )

    def __init__(self) -> None:
        self.batches_sent = 0
        self.records_sent = 0
        self.control_refused = 0
        self.credit_exhausted = 0
        self.epoch_deaths = 0
        self.batch_size_buckets = [0] * len(RECORDS_PER_BATCH_BUCKETS)
        """Cumulative-ready counts per bucket of records per batch (1, 2, 4, ... 2048)."""
        self.record_types = [0] * 6
        """Records sent by RecordType, counted per batch, never per record."""


class EgressSlot:
    """One stream on this (peer, lane), as the producer's node sees it."""

    __slots__ = (
        "anchor_id",
        "budget",
        "credit",
        "exhausted_once",
        "generation",
        "guard",
        "index",
        "live",
        "next_seq",
        "on_closed",
        "open_pending",
        "queue",
        "queued_bytes",
        "reserve",
        "session_id",
        "slot_id",
        "terminal_queued",
    )

    def __init__(
        self, index: int, generation: int, anchor_id: int, session_id: int, credit: int, budget: int
    ) -> None:
        self.index = index
        self.generation = generation
        self.slot_id = slot_id(index, generation)
        self.anchor_id = anchor_id
        self.session_id = session_id
        self.credit = credit
        self.reserve = 1
        self.budget = budget
        self.next_seq = 1
        self.queue: deque[tuple[bytes, bool]] = deque()
        self.queued_bytes = 0
        self.open_pending = True
        self.terminal_queued = False
        self.live = True
        self.exhausted_once = False
        self.guard: Any = None
        """Opaque retirement guard handed back with the batch that carries the terminal."""
        self.on_closed: Callable[[CloseReason | None], None] | None = None
        """Called once when the slot closes for any reason other than its own terminal."""

    @property
    def sendable(self) -> bool:
        """The head of the queue can go now (data with credit, or the terminal)."""
        if not self.queue or self.open_pending:
            return False
        return self.queue[0][1] or self.credit > 0

    def has_room(self) -> bool:
        return self.queued_bytes < self.budget


@dataclass(slots=True)
class OutgoingBatch:
    """One encoded ``_stream_batch`` payload, and what depends on its admission."""

    payload: bytes
    records: int
    carries_data: bool
    guards: list[Any]


class EgressBatcher:
    """One per (peer, lane). See the module docstring."""

    def __init__(self, lane: int, config: MuxConfig, *, byte_cap: int | None = None) -> None:
        self.lane = lane
        self.config = config
        self.policy = config.flush_policy
        cap = min(config.max_batch_bytes, COALESCE_THRESHOLD, byte_cap or COALESCE_THRESHOLD)
        self.byte_cap = max(MIN_BATCH_CAP, cap)
        self.epoch = next(_EPOCHS)
        self.batch_seq = 0
        self.stats = EgressStats()
        self.parked = False
        self._slots: list[EgressSlot | None] = []
        self._generations: list[int] = []
        self._free: list[int] = []
        self._by_session: dict[int, EgressSlot] = {}
        self._opens: deque[EgressSlot] = deque()
        self._ready: dict[int, EgressSlot] = {}  # insertion-ordered set of sendable slots
        self._live = 0
        self._reply_credit: dict[int, int] = {}
        self._reply_close: dict[int, int] = {}
        self._reply_since: float | None = None
        self._staged_since: float | None = None
        self._last_data_write = float("-inf")
        self._kick = False
        self._urgent = False
        self._builder = BatchBuilder(self.byte_cap)
        # Record types of the batch being built, added to the stats once per batch.
        self._count_data = self._count_open = self._count_close = self._count_credit = 0

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
        index = slot_index(slot_id_)
        if index >= len(self._slots):
            return None
        slot = self._slots[index]
        if slot is None or slot.generation != slot_generation(slot_id_):
            return None
        return slot

    def _free_slot(self, slot: EgressSlot) -> None:
        if self._slots[slot.index] is slot:
            self._slots[slot.index] = None
            self._generations[slot.index] = (slot.generation + 1) & 0xFF
            self._free.append(slot.index)
        self._by_session.pop(slot.session_id, None)
        self._ready.pop(slot.index, None)
        if slot.live:
            slot.live = False
            self._live -= 1

    def _close_slot(self, slot: EgressSlot, reason: CloseReason | None) -> None:
        """The slot ends without its own terminal (peer closed it, epoch death, cancel)."""
        slot.queue.clear()
        slot.queued_bytes = 0
        self._free_slot(slot)
        callback, slot.on_closed = slot.on_closed, None
        if callback is not None:
            callback(reason)

    # -- producers -----------------------------------------------------------------------

    def offer(self, slot: EgressSlot, body: bytes, now: float) -> bool:
        """Stage one record; False when the slot's byte budget is full (the producer waits)."""
        if not slot.live or slot.terminal_queued:
            raise ValueError("the slot is closed")
        if slot.queued_bytes >= slot.budget:
            return False
        self._enqueue(slot, body, False, now)
        return True

    def offer_terminal(self, slot: EgressSlot, body: bytes, now: float, guard: Any = None) -> None:
        """Stage the stream's terminal; never refused (it spends the reserved credit)."""
        if not slot.live or slot.terminal_queued:
            raise ValueError("the slot is closed")
        slot.terminal_queued = True
        slot.guard = guard
        self._urgent = True
        self._enqueue(slot, body, True, now)

    def _enqueue(self, slot: EgressSlot, body: bytes, terminal: bool, now: float) -> None:
        slot.queue.append((body, terminal))
        slot.queued_bytes += len(body)
        if slot.sendable or (slot.open_pending and (terminal or slot.credit > 0)):
            # A slot whose OpenSlot is not written yet becomes ready when it is; its record
            # still starts the linger window now, or no deadline would ever cover it.
            if slot.sendable:
                self._ready.setdefault(slot.index, slot)
            if self._staged_since is None:
                self._staged_since = now
        elif (
            not terminal and slot.credit <= 0 and not slot.exhausted_once and not slot.open_pending
        ):
            slot.exhausted_once = True
            self.stats.credit_exhausted += 1

    def cancel_slot(self, slot: EgressSlot) -> None:
        """The local producer gave up without a terminal (its sender was cancelled)."""
        if slot.live:
            self._close_slot(slot, None)

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
        if slot.sendable and slot.index not in self._ready:
            self._ready[slot.index] = slot
            if self._staged_since is None:
                self._staged_since = now
        return True

    def on_peer_close(self, slot_id_: int, reason: CloseReason) -> bool:
        """The receiver closed our slot (UnknownSlot: its anchor is gone; ProtocolError)."""
        slot = self._control_target(slot_id_)
        if slot is None:
            return False
        self._close_slot(slot, reason)
        return True

    def on_lifecycle(self, session_id: int, action: LifecycleAction) -> EgressSlot | None:
        """LifecycleSlot names the session, so a late signal cannot hit a reused slot."""
        return self._by_session.get(session_id)

    def _control_target(self, slot_id_: int) -> EgressSlot | None:
        index = slot_index(slot_id_)
        if index >= len(self._slots):
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
            if slot.credit > 0 or slot.queue[0][1]:
                staged += min(len(slot.queue), max(slot.credit, 1))
                withheld += max(0, len(slot.queue) - max(slot.credit, 1))
            else:
                withheld += len(slot.queue)
        return staged, withheld

    def pending_closes(self) -> int:
        return len(self._reply_close)

    def reply_close(self, peer_slot: int, reason: CloseReason) -> None:
        self._reply_credit.pop(peer_slot, None)
        self._reply_close[peer_slot] = int(reason)
        self._urgent = True

    # -- flushing ------------------------------------------------------------------------

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
            and self._ready
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
        if not self._ready:
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
        if policy.on_complete and len(self._ready) >= self._live:
            return now >= max(staged, self._last_data_write + policy.max_linger)
        return False

    def _staged_bytes(self) -> int:
        return sum(slot.queued_bytes for slot in self._ready.values())

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
        ready = self._ready
        while ready:
            index, slot = next(iter(ready.items()))
            queue = slot.queue
            while queue:
                body, terminal = queue[0]
                if not terminal and slot.credit <= 0:
                    break
                # A terminal needs room for its CloseSlot too (13 B header + 1 B reason).
                needed = len(body) + (14 if terminal else 0)
                if not builder.fits(needed):
                    if builder.count == 0:  # a record larger than any batch: refuse loudly
                        raise ValueError(f"a {len(body)}-byte record exceeds the batch cap")
                    out.append(self._finish(guards, carries_data))
                    guards, carries_data = [], False
                    continue
                queue.popleft()
                slot.queued_bytes -= len(body)
                builder.add(RecordType.DATA, slot.slot_id, slot.next_seq, body)
                slot.next_seq += 1
                carries_data = True
                self._count_data += 1
                if terminal:
                    slot.reserve = 0
                    self._count_close += 1
                    builder.add(
                        RecordType.CLOSE_SLOT,
                        slot.slot_id,
                        slot.next_seq,
                        close_slot_body(CloseReason.TERMINAL_SENT),
                    )
                    if slot.guard is not None:
                        guards.append(slot.guard)
                        slot.guard = None
                    self._free_slot(slot)
                    break
                slot.credit -= 1
                if slot.credit <= 0 and queue and not slot.exhausted_once:
                    slot.exhausted_once = True
                    self.stats.credit_exhausted += 1
            ready.pop(index, None)
        self._add_replies(out, guards, carries_data)
        self._staged_since = None
        if builder.count:
            out.append(self._finish(guards, carries_data))
        if any(batch.carries_data for batch in out):
            self._last_data_write = now
        return out

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
            builder.add(RecordType.OPEN_SLOT, slot.slot_id, 0, body)
            self._count_open += 1
            slot.open_pending = False
            if slot.guard is not None:  # connect() waits for this OpenSlot's admission
                guards.append(slot.guard)
                slot.guard = None
            if slot.sendable:
                self._ready.setdefault(slot.index, slot)
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
        for peer_slot, delta in self._reply_credit.items():
            body = credit_body(delta & 0xFFFF_FFFF)
            if not builder.fits(len(body)):
                out.append(self._finish(guards, carries_data))
                guards.clear()
            builder.add(RecordType.CREDIT_UPDATE, peer_slot, 0, body)
            self._count_credit += 1
        self._reply_close.clear()
        self._reply_credit.clear()
        self._reply_since = None

    def _finish(self, guards: list[Any], carries_data: bool) -> OutgoingBatch:
        builder = self._builder
        count = builder.count
        payload = builder.finish(self.lane, self.epoch, self.batch_seq)
        self.batch_seq = (self.batch_seq + 1) & 0xFFFF_FFFF
        self.stats.batches_sent += 1
        stats = self.stats
        stats.records_sent += count
        bucket = max(0, (count - 1).bit_length())
        if bucket < len(stats.batch_size_buckets):
            stats.batch_size_buckets[bucket] += 1
        types = stats.record_types
        types[RecordType.DATA] += self._count_data
        types[RecordType.OPEN_SLOT] += self._count_open
        types[RecordType.CLOSE_SLOT] += self._count_close
        types[RecordType.CREDIT_UPDATE] += self._count_credit
        self._count_data = self._count_open = self._count_close = self._count_credit = 0
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
        self._ready.clear()
        self._reply_credit.clear()
        self._reply_close.clear()
        self._reply_since = None
        self._staged_since = None
        self.parked = False
        self.epoch = next(_EPOCHS)
        self.batch_seq = 0
        self.stats.epoch_deaths += 1
        return closed
