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
   once as a gap and an inverted pair is not counted twice.
4. **Records.** ``frame_seq`` is per slot and is the authority on order: OpenSlot takes
   the slot's first number, everything the owner sends afterwards (data, heartbeats, its
   close) takes the next; below the expected number is a duplicate, above it waits in the
   hold until the gap closes. Replies about this side's own slots (CreditUpdate,
   LifecycleSlot, CloseSlot UnknownSlot/MalformedBatch) carry ``frame_seq`` 0, are not
   sequenced, and go to :class:`EgressControl`.
5. **Replies.** The slots the batch delivered into and the slots the consumers drained
   (the dirty set) are reconciled, and their credit goes to the :class:`ReplySink`.

Steps 1 to 4 are :mod:`.arrival`, mixed into :class:`IngressTable` so that the split costs
the per-record path nothing (see there). This module owns the rest: the table's state, the
life of a slot (the OpenSlot that claims a bind or is rejected on the reject lane, the
refusal of a staged singleton, the ways a slot ends, the retirement of an old epoch's
slots), and step 5, the credit that goes back, on the three paths :class:`IngressTable`
names.

A slot's failure never touches another slot or the lane: a sender over its credit, a
hold past its byte budget, or a reader stall closes that slot alone (CloseSlot
MalformedBatch to the sender; ``Dropped`` or a ``TransportError`` to the consumer).

A staged singleton (a record too large for the eager budget, pulled by rendezvous) arrives
outside the lane's order, through :meth:`IngressTable.handle_staged_batch`, and takes its
place by ``frame_seq`` like any record. When this node refuses one for its size, the
refusal ends exactly the stream it names (:meth:`IngressTable.refuse_staged`), or waits on
the stream's bind until the OpenSlot claims it (see :mod:`.singleton`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Final

from ..streaming.frames import DROPPED, encode_transport_error
from .arrival import IngressArrival, _Route
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
from .protocol import CloseReason, LifecycleAction, MalformedBatch, decode_open_slot

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

_UNKNOWN_SLOT: Final = CloseReason.UNKNOWN_SLOT
_PROTOCOL_ERROR: Final = CloseReason.PROTOCOL_ERROR


# -- the table ----------------------------------------------------------------------------


class IngressTable(IngressArrival):
    """The slots one peer sends on one lane: one table per (peer, lane).

    Each table takes the whole index range of its lane (``max_slots_per_table``), keeps
    its own epoch and ``batch_seq`` high-water mark, and shares the peer's
    :class:`PeerBudget` with the peer's other lanes. Slot ids are unique only within one
    batcher, which is why nothing here is shared between lanes.

    Three entry points produce replies: :meth:`handle_batch` (the arrival path, in
    :mod:`.arrival`), :meth:`visit_dirty` (the doorbell, at most once per
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
    ) -> None:
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

    # -- OpenSlot ----------------------------------------------------------------------------

    def _open(self, sid: int, seq: int, body: memoryview, now: float) -> None:
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
        self._refused.pop(index, None)
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
        self._refused[sid >> 8] = sid
        if not self._replies.reject(sid, reason):
            self.stats.control_refused += 1

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
        inject = DROPPED if message is None else encode_transport_error(message)
        self._retire(route, inject)

    def _consumer_gone(self, route: _Route) -> None:
        """The anchor withdrew the feed: tell the sender (CloseSlot UnknownSlot) so an idle
        producer learns of the cancel, unless the sender is already done with the slot (its
        terminal was delivered, or its close is here), and retire the slot."""
        if not route.slot.terminal and route.close_seq < 0:
            self._replies.close(route.slot_id, _UNKNOWN_SLOT)
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
        self._refused.clear()
        self.dirty.drain()
        return retired

    # -- credit return -----------------------------------------------------------------------

    def _visit(self, route: _Route) -> None:
        slot = route.slot
        if slot.withdrawn:
            if not slot.terminal:
                self._consumer_gone(route)
            return
        grant = slot.reconcile()
        if grant:
            self._replies.credit(route.slot_id, grant)

    def _reconcile(self, touched: list[_Route]) -> None:
        routes = self._routes
        for route in touched:
            slot = route.slot
            if not (slot.drained or slot.withdrawn or slot.withheld_credit):
                continue  # nothing taken since the last visit: nothing to grant or tell
            index = route.index
            if index < len(routes) and routes[index] is route:
                self._visit(route)

    def _reconcile_dirty(self) -> int:
        listed = self.dirty.drain()
        routes = self._routes
        size = len(routes)
        for index in listed:
            route = routes[index] if index < size else None
            if route is not None:
                self._visit(route)
        return len(listed)

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
