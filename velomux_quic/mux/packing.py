"""Packing: what one poll of the egress batcher writes, record by record, into batches.

:class:`EgressPacking` is the half of :class:`~velomux_quic.mux.egress.EgressBatcher` that
turns queued state into encoded ``_stream_batch`` payloads: the OpenSlots of new slots,
the ready slots' records served fairly in rounds (the common record inlined), a terminal
with its ``CloseSlot{TerminalSent}``, a record no batch can hold sent alone as a singleton
(and, when staged, the fence it puts on its slot until :meth:`~EgressPacking.lift_fence`),
the coalesced replies for the peer's slots, and the finished batch with its ``batch_seq``
and per-batch statistics. It owns the reusable builder and the per-batch record counts;
nothing else in the batcher writes a record.

:mod:`.egress` keeps the rest: the slot table, the producers' offers, the peer's control
about this side's slots, the replies' bookkeeping, the flush policy that decides *when*
:meth:`~velomux_quic.mux.egress.EgressBatcher.poll` packs, and epoch death. The two are
separate because they change for different reasons (the wire layout of a batch against
the rules of the stream's lifecycle), and each stays small enough to read whole.

They are one class at runtime: ``EgressBatcher`` inherits this mixin, so ``poll`` reaching
``self._pack_ready`` and the packing reaching the batcher's state cost exactly what they
did in a single class, with no other object to load and no forwarding call. This class
declares, for the type checker, the state the batcher's constructor sets and the one
method of the batcher it calls. ``_pack_ready`` and its inlined loop run once per record:
keep them free of extra calls and attribute lookups.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from .protocol import (
    MIN_BATCH_CAP,
    BatchBuilder,
    CloseReason,
    RecordType,
    close_slot_body,
    credit_body,
    lifecycle_body,
    open_slot_body,
)
from .singleton import SingletonCounters, singleton_headers
from .slots import EgressSlot, EgressStats, OutgoingBatch

__all__ = ["EgressPacking"]

_TERMINAL_SENT = CloseReason.TERMINAL_SENT


class EgressPacking:
    """The batch-writing methods of :class:`~velomux_quic.mux.egress.EgressBatcher`."""

    # Set by EgressBatcher.__init__; declared here because the packing reads and writes them.
    lane: int
    epoch: int
    batch_seq: int
    quantum: int
    poll_budget: int
    eager_budget: int
    stats: EgressStats
    counters: SingletonCounters
    _opens: deque[EgressSlot]
    _ready: dict[int, EgressSlot]
    _reply_credit: dict[int, int]
    _reply_close: dict[int, int]
    _reply_lifecycle: dict[int, int]
    _reply_since: float | None
    _staged_since: float | None
    _kick: bool
    _urgent: bool
    _builder: BatchBuilder
    _count_data: int
    _count_open: int
    _count_close: int
    _count_credit: int
    _count_lifecycle: int

    if TYPE_CHECKING:

        def _free_slot(self, slot: EgressSlot) -> None: ...  # EgressBatcher: the slot table

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
        ready = self._ready
        slots = list(ready.values())
        ready.clear()
        add_if_fits = builder.add_data_if_fits
        stats = self.stats
        quantum = self.quantum
        budget = self.poll_budget
        while slots:
            carried: list[EgressSlot] = []
            for position, slot in enumerate(slots):
                if budget <= 0:
                    carried = slots[position:] + carried
                    break
                if not slot.live:
                    continue
                queue = slot.queue
                # The common record, inlined: data with credit that fits the open batch.
                credit = slot.credit
                seq = slot.next_seq
                sid = slot.slot_id
                taken = 0
                while queue and credit > 0 and taken < quantum:
                    body, terminal = queue[0]
                    if terminal or not add_if_fits(sid, seq, body):
                        break
                    queue.popleft()
                    taken += len(body)
                    seq += 1
                    credit -= 1
                if seq != slot.next_seq:
                    self._count_data += seq - slot.next_seq
                    slot.next_seq = seq
                    slot.credit = credit
                    slot.queued_bytes -= taken
                    carries_data = True
                if queue and (queue[0][1] or (credit > 0 and taken < quantum)):
                    # A terminal, a full batch or a record no batch can hold.
                    guards, carries_data, more = self._pack_slot(
                        slot, out, guards, carries_data, quantum - taken
                    )
                    taken += more
                budget -= taken
                if not queue or not slot.live or slot.fenced:
                    continue
                if slot.credit <= 0 and not queue[0][1]:
                    if not slot.exhausted_once:
                        slot.exhausted_once = True
                        stats.credit_exhausted += 1
                    continue
                carried.append(slot)  # its quantum is spent; it goes again next round
            slots = carried
            if budget <= 0:
                break
        if slots:
            for slot in slots:
                if slot.live:
                    ready[slot.index] = slot
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
            body, terminal = queue[0]
            if not terminal and (slot.credit <= 0 or taken >= limit):
                break
            # A terminal needs room for its CloseSlot too (13 B header + 1 B reason).
            needed = len(body) + (14 if terminal else 0)
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
            builder.add_data(slot.slot_id, slot.next_seq, body)
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
        builder = BatchBuilder(MIN_BATCH_CAP)  # fits() is never asked: the cap is unused
        seq = slot.next_seq
        builder.add(RecordType.DATA, slot.slot_id, seq, body)
        slot.next_seq = seq + 1
        guards: list[Any] = []
        if terminal:
            slot.reserve = 0
            builder.add(
                RecordType.CLOSE_SLOT, slot.slot_id, seq + 1, close_slot_body(_TERMINAL_SENT)
            )
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
        batch = self._finish(guards, True, builder)
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
            self._free_slot(slot)
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
        if slot.sendable and slot.index not in self._ready:
            self._ready[slot.index] = slot
            if self._staged_since is None:
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
        if self._reply_lifecycle:
            self._add_lifecycle(out, guards, carries_data)
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
        self, guards: list[Any], carries_data: bool, builder: BatchBuilder | None = None
    ) -> OutgoingBatch:
        if builder is None:
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
        types[RecordType.LIFECYCLE_SLOT] += self._count_lifecycle
        self._count_data = self._count_open = self._count_close = self._count_credit = 0
        self._count_lifecycle = 0
        builder.reset()
        return OutgoingBatch(payload, count, carries_data, list(guards))
