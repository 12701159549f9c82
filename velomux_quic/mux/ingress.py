"""Ingress: one slot table per (peer, lane), applying the peer's batches (sans-IO).

The messenger dispatches one peer's batches on one lane in arrival order, one at a time,
so :meth:`IngressTable.handle_batch` needs no reorder window: it applies a batch record by
record, never blocks, and never awaits. A handler that waited would hold the lane, and
every stream from that peer on it would stall behind one slow consumer; so every record
either goes into space its credit already reserved, waits in a bounded per-slot hold, or
is dropped and counted.

What a batch goes through, in order:

1. **Lane.** A batch whose header names another lane belongs to another batcher: its slot
   ids, epoch and sequence are another table's, so applying any of it could feed or
   retire the wrong streams. It is dropped whole (``lane_mismatch``) before the epoch is
   even looked at.
2. **Epoch.** An older epoch than the table's is discarded by its header
   (``stale_epoch``). The first batch of a newer epoch first retires every slot of the
   old one (each that has not delivered a terminal gets ``Dropped``), then applies.
3. **batch_seq.** Compared modulo 2**32 against a high-water mark, so a lost batch counts
   once as a gap and an inverted pair is not counted twice. A staged singleton (it
   arrives through rendezvous, out of the lane's order) takes no number and is not
   metered.
4. **Records.** ``frame_seq`` is per slot and is the authority on order: OpenSlot takes
   the slot's first number, everything the owner sends afterwards (data, heartbeats, its
   close) takes the next; below the expected number is a duplicate, above it waits in the
   hold until the gap closes. Replies about this side's own slots (CreditUpdate,
   LifecycleSlot, CloseSlot UnknownSlot/MalformedBatch) carry ``frame_seq`` 0, are not
   sequenced, and go to :class:`EgressControl`. A record of a slot this table does not
   have is dropped, counted by why, and its sender told the slot is gone, again while it
   keeps sending, a bounded number of times (:meth:`IngressTable._answer`): the notice
   it had may have died with the connection that carried it.
5. **Replies.** The slots the batch delivered into and the slots the consumers drained
   (the dirty set) are reconciled, and their credit goes to the :class:`ReplySink`.

One concern, one class, one file: :class:`IngressTable` applies what arrives (steps 1 to
4), keeps the life of a slot (the OpenSlot that claims a bind or is rejected on the reject
lane, the refusal of a staged singleton, the ways a slot ends, the retirement of an old
epoch's slots) and returns the credit (step 5, on the three paths it names). The arrival
rules end slots and the life of a slot reads the arrival's sequencing state, so they share
``_Route`` (the sequencing state of one live slot) and the table's fields; a split would
pass all of it across an interface. Only the per-record kernel lives in a module of its
own, :mod:`.arrival` (the route, the arrival loop and the credit walks), because it is
compiled: the table binds its functions as its methods, so they work on its fields as the
table's own code does, and the rules they do not apply inline stay here.

The hot path, in its inline form on purpose: the common record (the next item of an open
slot, in order, within its credit) is applied in the loop of
:meth:`IngressTable.handle_batch` itself, with locals bound once per batch, instead of
through :meth:`IngressTable._apply`; every other sequenced record takes the general rules
there. That record is one token per stream per engine pass, the shape ``perf/tokens.py``
measures. Its body arrives as ``bytes`` already (the transport decodes with
:func:`~velomux_quic.mux.protocol.decode_batch_owned`), so it goes into the slot's buffer
as it is; a ``memoryview`` body (``decode_batch``) is copied once. After the batch, only
the touched slots that may owe the sender a grant are visited (see :meth:`_reconcile`).
A memoryview slice and a ``bytes`` copy per record, and a credit visit of every touched
slot, were what this loop cost before (``perf/ingress_bench.py``; the figures are in
docs/performance.md): keep it free of extra calls and attribute lookups. The loop and the
two reconcile walks are written once, in :mod:`.arrival`, which the record path compiles
(velomux_quic.recordpath).

A slot's failure never touches another slot or the lane: a sender over its credit, a
hold past its byte budget, or a reader stall closes that slot alone (CloseSlot
MalformedBatch to the sender; ``Dropped`` or a ``TransportError`` to the consumer).

A staged singleton (a record too large for the eager budget, pulled by rendezvous) arrives
outside the lane's order, through :meth:`IngressTable.handle_staged_batch`, and takes its
place by ``frame_seq`` like any record. When this node refuses one for its size, the
refusal ends exactly the stream it names (:meth:`IngressTable.refuse_staged`), or waits on
the stream's bind until the OpenSlot claims it (see :mod:`.singleton`).
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Final

from ..streaming.frames import DROPPED, ITEM_PREFIX, encode_transport_error, is_terminal_sentinel
from . import arrival as _arrival
from .arrival import _Route
from .config import MuxConfig
from .contracts import (
    DROP_REASONS,
    BindRegistry,
    EgressControl,
    InMemoryBindRegistry,
    MuxIngressStats,
    RejectLane,
    ReplySink,
)
from .credit import DirtySet, IngressSlot, PeerBudget
from .protocol import (
    RECORD_HEADER_SIZE,
    BatchHeader,
    BytesLike,
    CloseReason,
    LifecycleAction,
    MalformedBatch,
    OwnedRecord,
    Record,
    RecordType,
    decode_close_slot,
    decode_credit,
    decode_lifecycle,
    decode_open_slot,
    seq_distance,
)
from .snapshot import IngressLaneSnapshot

__all__ = [
    "DROP_REASONS",
    "BindRegistry",
    "EgressControl",
    "InMemoryBindRegistry",
    "IngressTable",
    "MuxIngressStats",
    "RejectLane",
    "ReplySink",
]

_DATA: Final = int(RecordType.DATA)
_CLOSE_SLOT: Final = int(RecordType.CLOSE_SLOT)
_CREDIT_UPDATE: Final = int(RecordType.CREDIT_UPDATE)
_SLOT_HEARTBEAT: Final = int(RecordType.SLOT_HEARTBEAT)
_LIFECYCLE_SLOT: Final = int(RecordType.LIFECYCLE_SLOT)
_TERMINAL_SENT: Final = CloseReason.TERMINAL_SENT

# -- per-slot ingress state ---------------------------------------------------------------


_UNKNOWN_SLOT: Final = CloseReason.UNKNOWN_SLOT
_PROTOCOL_ERROR: Final = CloseReason.PROTOCOL_ERROR


class _Notice:
    """What one slot id this table ended (or never had) was told: how many drop notices,
    the earliest time another may go, and the reason they carry.

    ``withdrawn``: the slot was live here and its consumer withdrew, so a record of it is a
    record the sender should not send any more (``unknown_slot``), not a late one.
    """

    __slots__ = ("count", "next_at", "reason", "withdrawn")

    def __init__(self, reason: CloseReason, withdrawn: bool) -> None:
        self.count = 0
        self.next_at = 0.0
        self.reason = reason
        self.withdrawn = withdrawn


# -- the table ----------------------------------------------------------------------------


class IngressTable:
    """The slots one peer sends on one lane: one table per (peer, lane).

    Each table takes the whole index range of its lane (``max_slots_per_table``), keeps
    its own epoch and ``batch_seq`` high-water mark, and shares the peer's
    :class:`PeerBudget` with the peer's other lanes. Slot ids are unique only within one
    batcher, which is why nothing here is shared between lanes.

    Three entry points produce replies: :meth:`handle_batch` (the arrival path),
    :meth:`visit_dirty` (the doorbell, at most once per
    ``drain_visit_floor``) and :meth:`sweep` (the periodic walk of every live slot).
    """

    def __init__(
        self,
        peer: Hashable,
        lane: int,
        config: MuxConfig,
        *,
        registry: BindRegistry,
        replies: ReplySink,
        control: EgressControl,
        peer_budget: PeerBudget,
        stats: MuxIngressStats | None = None,
        doorbell: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` times the drop notices only (a rare path): the arrival loop passes
        ``now`` to the paths that need it per record, and the miss of a dropped slot is not
        one of them, so it reads the clock itself rather than have the loop carry one more
        argument. The node passes its event loop's clock."""
        self.peer = peer
        self.lane = lane
        self.config = config
        self.stats = stats if stats is not None else MuxIngressStats()
        self.dirty = DirtySet(config.max_slots_per_table, doorbell)
        self._registry = registry
        self._replies = replies
        self._control = control
        self._peer_budget = peer_budget
        self._max_slots = config.max_slots_per_table
        self._visit_floor = config.drain_visit_floor
        self._routes: list[_Route | None] = []
        self._aside: dict[int, _Route] = {}
        self._refused: dict[int, int] = {}
        """Refused slot index -> slot id, oldest first, at most ``max_refused_slots``."""
        self._max_refused = config.max_refused_slots
        self._clock = clock
        self._notices: dict[int, _Notice] = {}
        """Slot id -> the drop notices it was sent (the close or rejection that ended it,
        then answers to its records), least recently told first, at most
        ``max_refused_slots``: a notice can be lost with the connection it left on, so a
        record of such a slot is answered again, within ``drop_notice_limit`` and its
        backoff (:meth:`_answer`)."""
        self._notice_limit = config.drop_notice_limit
        self._notice_interval = config.drop_notice_interval
        self._live = 0
        self._epoch: int | None = None
        self._high_water: int | None = None
        self._batches = 0
        self._last_visit: float | None = None
        self._staged = False
        """True while applying a staged singleton (counts its misses as stale_singleton)."""

    # -- introspection -----------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """The peer epoch this table follows (None before the first batch)."""
        return self._epoch

    @property
    def live_slots(self) -> int:
        return self._live

    @property
    def next_visit_at(self) -> float | None:
        """The earliest time :meth:`visit_dirty` will run again (None: right away)."""
        if self._last_visit is None or not self._visit_floor:
            return None
        return self._last_visit + self._visit_floor

    def snapshot(self) -> IngressLaneSnapshot:
        """A frozen picture of this table. O(live slots): never on the hot path."""
        held = held_bytes = buffered = buffered_bytes = 0
        for route in self._live_routes():
            if route.hold:
                held += len(route.hold)
            held_bytes += route.hold_bytes
            slot = route.slot
            buffered += len(slot)
            buffered_bytes += slot.bytes_buffered
        return IngressLaneSnapshot(
            epoch=self._epoch,
            live_slots=self._live,
            held_records=held,
            held_bytes=held_bytes,
            buffered_records=buffered,
            buffered_bytes=buffered_bytes,
        )

    def _live_routes(self) -> list[_Route]:
        """Every live slot's route, at its index or aside."""
        routes = [route for route in self._routes if route is not None]
        routes.extend(self._aside.values())
        return routes

    def slot(self, slot_id: int) -> IngressSlot | None:
        """The live slot with exactly this id, wherever it is kept."""
        route = self._route(slot_id)
        return None if route is None else route.slot

    def _route(self, slot_id: int) -> _Route | None:
        index = slot_id >> 8
        routes = self._routes
        route = routes[index] if index < len(routes) else None
        if route is not None and route.slot_id == slot_id:
            return route
        return self._aside.get(slot_id)

    # -- arrival: one batch, record by record ------------------------------------------------

    handle_batch = _arrival.handle_batch
    """Apply one batch, in order, then reconcile what it touched and what was drained (the
    arrival loop of :mod:`.arrival`, bound as this method)."""

    def handle_staged_batch(
        self, header: BatchHeader, records: Sequence[Record | OwnedRecord], now: float
    ) -> None:
        """Apply a batch that came through rendezvous (it carried ``_mux_slot``).

        It is applied like any batch: its record takes its place by ``frame_seq``, ahead of
        later records that wait in the hold, or behind a close that waits deferred on the
        route (aside, if the sender already reused the index). Only a miss differs: the
        slot ended while the record was being pulled, which is ``stale_singleton``.
        """
        self._staged = True
        try:
            self.handle_batch(header, records, now)
        finally:
            self._staged = False

    def _meter(self, batch_seq: int) -> None:
        """Count lost batches against a high-water mark (u32 serial arithmetic).

        The first batch a table sees of an epoch sets the mark without counting: a table
        can meet a sender mid-epoch (this node restarted while the sender kept its
        batcher), and counting from 0 then would report thousands of phantom gaps.
        """
        high = self._high_water
        if high is None:
            self._high_water = batch_seq
            return
        distance = seq_distance(batch_seq, high)
        if distance > 0:
            self.stats.batch_seq_gaps += distance - 1
            self._high_water = batch_seq

    def _miss(self, sid: int, occupant: _Route | None) -> _Route | None:
        """A sequenced record whose id is not the occupant of its index: an aside slot, or
        a drop counted by why it missed."""
        aside = self._aside.get(sid) if self._aside else None
        if aside is not None:
            return aside
        drops = self.stats.drops
        if self._staged:
            # A rendezvous record resolves outside the ordered lane: its slot may have
            # ended meanwhile (refused, retired by a new epoch, its consumer gone).
            drops["stale_singleton"] += 1
        elif self._refused.get(sid >> 8) == sid:
            drops["unknown_slot"] += 1
            self._answer(sid)
        elif occupant is not None:
            drops["generation"] += 1
            self.stats.generation_mismatch += 1
        else:
            notice = self._notices.get(sid) if self._notices else None
            if notice is not None and notice.withdrawn:
                # Its consumer withdrew and the sender was told, yet it still sends.
                drops["unknown_slot"] += 1
            else:
                # Never opened in this epoch, or already closed. The chapter counts a
                # record that overtook its OpenSlot here too: "finds no slot ... dropped
                # as closed_slot". An ordered lane has no such overtaking: an OpenSlot
                # that is not here was lost with the connection that carried it.
                drops["closed_slot"] += 1
            self._answer(sid)
        return None

    def _answer(self, sid: int) -> None:
        """A record of a slot this table does not have: tell its sender the slot is gone,
        on the capped reject lane, unless this slot's notices are spent or too recent.

        Whatever told the sender before (the close when its consumer withdrew, the
        rejection of its OpenSlot, nothing at all when the OpenSlot was lost) may have
        been lost with the connection it left on: a sender stopped past the idle timeout
        acknowledges nothing, and its connections die with what they held. A sender that
        never hears streams on into a slot nobody has and waits for credit that never
        comes, so its records are answered again; at most ``drop_notice_limit`` notices
        per slot id, each later one at least twice as long after the last (from
        ``drop_notice_interval``), so a peer that hammers a dropped slot gets a few
        answers, never one per record. A sender that closed the slot itself drops the
        answer (a retired generation), so it costs it nothing.
        """
        notice = self._notices.get(sid) if self._notices else None
        outcomes = self.stats.drop_notices
        if notice is not None and (
            notice.count >= self._notice_limit or self._clock() < notice.next_at
        ):
            outcomes["limited"] += 1
            return
        reason = _UNKNOWN_SLOT if notice is None else notice.reason
        if self._replies.reject(sid, reason):
            outcomes["answered"] += 1
            self._noticed(sid, reason, withdrawn=notice is not None and notice.withdrawn)
        else:
            self.stats.control_refused += 1

    def _noticed(self, sid: int, reason: CloseReason, *, withdrawn: bool = False) -> None:
        """The sender of ``sid`` was just told the slot is gone (``reason``): count the
        notice and set when another may follow. Kept newest last, the least recently told
        forgotten past ``max_refused_slots`` (a forgotten slot's record is answered as one
        never told: the ids are the peer's choice and must not grow this table)."""
        notices = self._notices
        notice = notices.pop(sid, None)
        if notice is None:
            if len(notices) >= self._max_refused:
                del notices[next(iter(notices))]
            notice = _Notice(reason, withdrawn)
        else:  # told again: the count goes on, so the bound holds whatever told it
            notice.reason = reason
            notice.withdrawn = withdrawn
        notice.count += 1
        notice.next_at = self._clock() + self._notice_interval * (1 << (notice.count - 1))
        notices[sid] = notice

    def _apply(self, route: _Route, record_type: int, body: BytesLike, now: float) -> bool:
        """Apply the record at ``route.expected``; False when it ended the slot."""
        slot = route.slot
        route.expected += 1
        if record_type == _DATA:
            if slot.withdrawn:
                self._consumer_gone(route)
                return False
            data = body if type(body) is bytes else bytes(body)
            if slot.terminal:
                # At most one terminal per slot, and nothing but its close after it.
                self.stats.drops["closed_slot"] += 1
                return True
            slot.last_arrival = now
            # An item frame is never a terminal; its prefix answers without a decode.
            if not data.startswith(ITEM_PREFIX) and is_terminal_sentinel(data):
                slot.deliver_terminal(data)
                return True
            if slot.data_delivered >= slot.granted:
                self._fail(route, "the sender sent a data record beyond its credit")
                return False
            if not slot.deliver(data):
                self.stats.reader_stall += 1
                self._fail(route, "mux reader stall: the slot buffer had no reserved space")
                return False
            return True
        if record_type == _SLOT_HEARTBEAT:
            slot.last_arrival = now
            return True
        # An owner's close, in its turn: TerminalSent or PeerGone.
        reason = body[0] if body else route.close_reason
        slot.last_arrival = now
        self._retire(route, None if reason == _TERMINAL_SENT and slot.terminal else DROPPED)
        return False

    def _hold(self, route: _Route, record_type: int, seq: int, body: BytesLike) -> None:
        """Keep a record that arrived ahead of its ``frame_seq`` until the gap closes.

        A close ahead of its turn is deferred (kept on the route, not in the hold). Held
        records are bounded three ways: by credit (a held data record spent credit like a
        delivered one), by the slot byte budget, and by the peer's budget. Exceeding
        credit is a protocol violation; exceeding bytes is a hold overflow. Either closes
        this slot alone.
        """
        slot = route.slot
        stats = self.stats
        if record_type == _CLOSE_SLOT:
            if route.close_seq >= 0:
                stats.drops["duplicate"] += 1
                return
            route.close_seq = seq
            route.close_reason = CloseReason(body[0])
            slot.gap_waiting = True
            return
        hold = route.hold
        if hold is None:
            hold = route.hold = {}
        elif seq in hold:
            stats.drops["duplicate"] += 1
            return
        data = bytes(body)
        terminal = record_type == _DATA and is_terminal_sentinel(data)
        if terminal:
            if route.held_terminal or slot.terminal:
                self._fail(route, "the sender sent a second terminal")
                return
        elif record_type == _DATA and slot.data_delivered + slot.held_data >= slot.granted:
            self._fail(route, "the sender sent a data record beyond its credit")
            return
        # A body-less record (a heartbeat) is charged its header so a run of them is bounded.
        cost = len(data) or RECORD_HEADER_SIZE
        peer = self._peer_budget
        if route.hold_bytes + cost > slot.slot_byte_budget or peer.used + cost > peer.limit:
            stats.hold_overflow += 1
            self._fail(route, None)
            return
        hold[seq] = (record_type, data)
        route.hold_bytes += cost
        peer.used += cost
        if terminal:
            route.held_terminal = True
        elif record_type == _DATA:
            slot.held_data += 1
        slot.held_records += 1
        slot.held_bytes = route.hold_bytes
        slot.gap_waiting = True
        stats.held_records += 1

    def _release_hold(self, route: _Route, now: float) -> None:
        """After an in-order record: apply whatever the hold has from here on, then a close
        that was waiting for exactly this point."""
        hold = route.hold
        if hold:
            slot = route.slot
            peer = self._peer_budget
            stats = self.stats
            while hold:
                entry = hold.pop(route.expected, None)
                if entry is None:
                    break
                record_type, data = entry
                cost = len(data) or RECORD_HEADER_SIZE
                route.hold_bytes -= cost
                peer.used -= cost
                slot.held_records -= 1
                slot.held_bytes = route.hold_bytes
                stats.held_records -= 1
                if record_type == _DATA:
                    if is_terminal_sentinel(data):
                        route.held_terminal = False
                    else:
                        slot.held_data -= 1
                if not self._apply(route, record_type, data, now):
                    return
        if route.close_seq == route.expected:
            self._apply(route, _CLOSE_SLOT, bytes((route.close_reason,)), now)
            return
        route.slot.gap_waiting = bool(route.hold) or route.close_seq >= 0

    # -- records about this side's egress slots ----------------------------------------------

    def _peer_close(self, sid: int, body: BytesLike) -> None:
        try:
            reason = decode_close_slot(body)
        except MalformedBatch:
            self.stats.malformed_records += 1
            return
        self._control.closed_by_peer(sid, reason)

    def _egress_credits(self, grants: list[tuple[int, int]]) -> None:
        self._control.credits(grants)

    def _egress_control(self, record_type: int, sid: int, body: BytesLike) -> None:
        try:
            if record_type == _CREDIT_UPDATE:  # one the walk did not take: its body is bad
                self._control.credits([(sid, decode_credit(body))])
            elif record_type == _LIFECYCLE_SLOT:
                session, action = decode_lifecycle(body)
                self.stats.lifecycle_received += 1
                self._control.lifecycle(session, action)
            else:
                self.stats.malformed_records += 1
        except MalformedBatch:
            self.stats.malformed_records += 1

    # -- OpenSlot ----------------------------------------------------------------------------

    def _open(self, sid: int, seq: int, body: BytesLike, now: float) -> None:
        """Claim the bind an OpenSlot names, or reject the slot on the reject lane."""
        stats = self.stats
        try:
            anchor_id, session_id = decode_open_slot(body)
        except MalformedBatch:
            stats.malformed_records += 1
            self._reject(sid, _PROTOCOL_ERROR)
            return
        index = sid >> 8
        if index >= self._max_slots:
            stats.slot_limit += 1
            self._reject(sid, _PROTOCOL_ERROR)
            return
        aside = self._aside.get(sid) if self._aside else None
        if aside is not None:
            # The generation wrapped onto a closed slot that still waits aside for its
            # tail: the two streams' records are indistinguishable, so fail the old one
            # and refuse the new one, and neither gets the other's records.
            stats.drops["slot_collision"] += 1
            self._reject(sid, _PROTOCOL_ERROR)
            self._retire(aside, DROPPED)
            return
        routes = self._routes
        occupant = routes[index] if index < len(routes) else None
        if occupant is not None and occupant.close_seq < 0 and occupant.slot.withdrawn:
            # Its consumer let go and the sender heard (a cancel frees the sender's index at
            # once, with no close of its own), before this table's rate-limited visit
            # retired the slot: the new OpenSlot, behind every record of the old slot on
            # this ordered lane, shows the sender is done with it. Without this the next
            # stream to reuse the index would be refused for the cancel of another.
            self._retire(occupant, None)
            occupant = None
        if occupant is not None:
            if occupant.close_seq < 0:
                # The old slot's close has not arrived: the sender cannot have freed it.
                stats.drops["slot_collision"] += 1
                self._reject(sid, _PROTOCOL_ERROR)
                return
            if occupant.slot_id == sid:
                # As above, with the old slot still at its index.
                stats.drops["slot_collision"] += 1
                self._reject(sid, _PROTOCOL_ERROR)
                self._retire(occupant, DROPPED)
                return
            # The sender is done with the old slot (its close is here, deferred behind a
            # gap): keep it aside by its full id and give the index to the new stream.
            routes[index] = None
            self._aside[occupant.slot_id] = occupant
        slot = self._registry.claim(self.peer, self.lane, anchor_id, session_id)
        if slot is None:
            self._reject(sid, _UNKNOWN_SLOT)
            return
        if self._refused.pop(index, None) is not None:
            stats.refused_slots -= 1
        if self._notices:
            self._notices.pop(sid, None)
        slot.open(sid, self.dirty, self._peer_budget, now)
        route = _Route(sid, slot, seq + 1, session_id)
        if index >= len(routes):
            routes.extend([None] * (index + 1 - len(routes)))
        routes[index] = route
        self._live += 1
        stats.live_slots += 1
        if slot.refusals is not None:
            self._claim_refusal(route)

    def _reject(self, sid: int, reason: CloseReason) -> None:
        """An OpenSlot that was never admitted: its records will be dropped as
        ``unknown_slot``, and the sender hears why on the capped reject lane."""
        self._remember_refusal(sid)
        if self._replies.reject(sid, reason):
            self._noticed(sid, reason)
        else:
            self.stats.control_refused += 1

    def _remember_refusal(self, sid: int) -> None:
        """Keep ``sid`` among the refused (newest last), forgetting the oldest past the
        bound: the indices are the peer's to choose, and must not grow this table."""
        refused = self._refused
        index = sid >> 8
        if refused.pop(index, None) is None:
            self.stats.refused_slots += 1
            if len(refused) >= self._max_refused:
                del refused[next(iter(refused))]
                self.stats.refused_slots -= 1
                self.stats.refusals_forgotten += 1
        refused[index] = sid

    # -- refused staged singletons -----------------------------------------------------------

    def refuse_staged(self, epoch: int, sid: int, session: int, message: str) -> bool:
        """A staged singleton of this (peer, lane) was refused for its size: end its stream.

        Only a live slot (in the table or aside) of this epoch with exactly this slot id
        and this session matches; anything else is a stale refusal and returns False. The
        stream ends at once, without waiting for records ahead of the refused one (the
        stream has failed already): see :meth:`_end_refused`.
        """
        if epoch != self._epoch:
            return False
        route = self._route(sid)
        if route is None or route.session_id != session:
            return False
        self._end_refused(route, message)
        return True

    def _claim_refusal(self, route: _Route) -> None:
        """The OpenSlot claiming a bind on which a staged refusal waited: end the stream now
        if the refusal came from this (peer, lane) and names this epoch and slot id."""
        slot = route.slot
        pending = slot.refusals
        slot.refusals = None  # claimed: no other (peer, lane) can open this bind now
        refusal = pending.get((self.peer, self.lane)) if pending else None
        if refusal is None:
            return
        epoch, sid, message = refusal
        if epoch == self._epoch and sid == route.slot_id:
            self._end_refused(route, message)

    def _end_refused(self, route: _Route, message: str) -> None:
        """The consumer's terminal is the TransportError (a held terminal, which may have
        spent the reserve already, is dropped with the hold, so the stream ends with the
        error and never with nothing); the slot retires; the sender is told to cancel by
        session (LifecycleSlot, not CloseSlot: a late CloseSlot names only a slot id, and
        could end a later stream that reuses it)."""
        self.stats.refusals["applied"] += 1
        session = route.session_id
        self._retire(route, encode_transport_error(message))
        self._replies.lifecycle(session, LifecycleAction.CANCEL)

    # -- ending slots ------------------------------------------------------------------------

    def _drop_hold(self, route: _Route) -> None:
        hold = route.hold
        if hold:
            held = len(hold)
            self._peer_budget.used -= route.hold_bytes
            self.stats.held_records -= held
            hold.clear()
        slot = route.slot
        route.hold_bytes = 0
        route.held_terminal = False
        slot.held_records = 0
        slot.held_bytes = 0
        slot.held_data = 0

    def _retire(self, route: _Route, inject: bytes | None) -> None:
        """Take a slot out of the table; the consumer reads what it has, then ``inject``
        (when no terminal was delivered) and then the end of the buffer."""
        self._drop_hold(route)
        route.slot.end(inject)
        index = route.index
        routes = self._routes
        if index < len(routes) and routes[index] is route:
            routes[index] = None
        else:
            self._aside.pop(route.slot_id, None)
        self._live -= 1
        self.stats.live_slots -= 1

    def _fail(self, route: _Route, message: str | None) -> None:
        """Close one slot for a protocol violation: the sender hears MalformedBatch; the
        consumer reads ``Dropped`` (hold overflow, ``message`` None) or a TransportError
        naming the violation. Other slots and the lane continue."""
        self.stats.protocol_errors += 1
        self._replies.close(route.slot_id, _PROTOCOL_ERROR)
        self._noticed(route.slot_id, _PROTOCOL_ERROR)
        inject = DROPPED if message is None else encode_transport_error(message)
        self._retire(route, inject)

    def _consumer_gone(self, route: _Route) -> None:
        """The anchor withdrew the feed: tell the sender (CloseSlot UnknownSlot) so an idle
        producer learns of the cancel, unless the sender is already done with the slot (its
        terminal was delivered, or its close is here), and retire the slot."""
        if not route.slot.terminal and route.close_seq < 0:
            self._replies.close(route.slot_id, _UNKNOWN_SLOT)
            self._noticed(route.slot_id, _UNKNOWN_SLOT, withdrawn=True)
        self._retire(route, None)

    def retire_all(self) -> int:
        """Retire every slot (a new epoch, or the table's teardown): each that has not
        delivered a terminal reads ``Dropped``. Returns how many were retired."""
        retired = 0
        for route in self._routes:
            if route is not None:
                self._retire(route, DROPPED)
                retired += 1
        for route in list(self._aside.values()):
            self._retire(route, DROPPED)
            retired += 1
        self._routes = []
        self.stats.refused_slots -= len(self._refused)
        self._refused.clear()
        self._notices.clear()
        self.dirty.drain()
        return retired

    # -- credit return -----------------------------------------------------------------------

    # The visit of one slot, and the two walks that choose which slots to visit: once per
    # touched slot per batch, and once per slot a consumer drained (see :mod:`.arrival`).
    _visit = _arrival.visit
    _reconcile = _arrival.reconcile
    _reconcile_dirty = _arrival.reconcile_dirty

    def visit_dirty(self, now: float) -> bool:
        """The doorbell path: reconcile the slots the consumers drained.

        At most one visit per ``drain_visit_floor`` (0 turns the limit off). Returns
        whether it ran; when it did not, the listed slots stay listed and no new doorbell
        comes for them, so the caller must come back at :attr:`next_visit_at`.
        """
        if not len(self.dirty):
            return False
        last = self._last_visit
        floor = self._visit_floor
        if floor and last is not None and now < last + floor:
            return False
        self._last_visit = now
        self.stats.drain_visits += 1
        self._reconcile_dirty()
        return True

    def sweep(self, now: float) -> int:
        """The periodic walk: reconcile every live slot, for a slot that nothing names
        (parked, nothing arriving, nothing taken, or credit withheld for bytes).

        Skipped at once while no slot is live, so an idle table allocates nothing.
        Returns the number of slots visited.
        """
        if not self._live:
            return 0
        self.dirty.drain()
        visited = 0
        routes = self._routes
        for index in range(len(routes)):
            route = routes[index]
            if route is not None:
                self._visit(route)
                visited += 1
        return visited
