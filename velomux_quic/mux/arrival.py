"""Arrival: one batch from the peer applied to its ingress table, record by record.

:class:`IngressArrival` is the half of :class:`~velomux_quic.mux.ingress.IngressTable` that
applies what arrives: the batch header (its lane, its epoch, and its ``batch_seq`` metered
against a high-water mark), then every record by its slot's ``frame_seq``. The common
record (the next item of an open slot, in order, within its credit) is inlined in the loop
of :meth:`~IngressArrival.handle_batch`; every other sequenced record takes the general
rules of :meth:`~IngressArrival._apply` (data, a terminal, a heartbeat, the owner's close),
waits in the slot's bounded hold until its gap closes (released by
:meth:`~IngressArrival._release_hold`), or is dropped and counted by why it found no slot
(:meth:`~IngressArrival._miss`). The records about this side's own slots are not sequenced
and go to :class:`~velomux_quic.mux.contracts.EgressControl`. This module also owns
``_Route``, the sequencing state of one live slot that these rules read and write.

:mod:`.ingress` keeps the rest: the table's state and the life of a slot (the OpenSlot that
claims a bind or is rejected, the refusal of a staged singleton, the ways a slot ends, the
retirement of an epoch), and the credit that goes back (reconciling the slots a batch
touched and the slots the consumers drained, the doorbell visit, the periodic sweep). The
two are separate because they change for different reasons (the sequencing and hold rules
of the wire against a slot's lifecycle and credit), and each stays small enough to read
whole.

They are one class at runtime: ``IngressTable`` inherits this mixin, so ``handle_batch``
reaching ``self._apply`` or ``self._fail``, and the table's methods reaching the hold, cost
exactly what they did in a single class, with no other object to load and no forwarding
call. This class declares, for the type checker, the state the table's constructor sets and
the methods of the table it calls. ``handle_batch`` and its inlined loop run once per
record: keep them free of extra calls and attribute lookups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from ..streaming.frames import DROPPED, ITEM_PREFIX, is_terminal_sentinel
from .contracts import EgressControl, MuxIngressStats
from .credit import IngressSlot, PeerBudget
from .protocol import (
    RECORD_HEADER_SIZE,
    BatchHeader,
    CloseReason,
    MalformedBatch,
    Record,
    RecordType,
    decode_close_slot,
    decode_credit,
    decode_lifecycle,
    seq_distance,
)

__all__ = ["IngressArrival"]

_DATA: Final = int(RecordType.DATA)
_OPEN_SLOT: Final = int(RecordType.OPEN_SLOT)
_CLOSE_SLOT: Final = int(RecordType.CLOSE_SLOT)
_CREDIT_UPDATE: Final = int(RecordType.CREDIT_UPDATE)
_SLOT_HEARTBEAT: Final = int(RecordType.SLOT_HEARTBEAT)
_LIFECYCLE_SLOT: Final = int(RecordType.LIFECYCLE_SLOT)
_TERMINAL_SENT: Final = CloseReason.TERMINAL_SENT
_PEER_GONE: Final = CloseReason.PEER_GONE
_OWNER_CLOSE_BYTES: Final = frozenset({int(_TERMINAL_SENT), int(_PEER_GONE)})


# -- per-slot ingress state ---------------------------------------------------------------


class _Route:
    """The sequencing state of one live slot: what ``frame_seq`` comes next, the records
    that arrived ahead of it, and a close that arrived ahead of it.

    One per stream, not per record. The hold is created on the first gap only.
    """

    __slots__ = (
        "close_reason",
        "close_seq",
        "expected",
        "held_terminal",
        "hold",
        "hold_bytes",
        "index",
        "session_id",
        "slot",
        "slot_id",
        "touched",
    )

    def __init__(self, slot_id: int, slot: IngressSlot, expected: int, session_id: int) -> None:
        self.slot_id = slot_id
        self.index = slot_id >> 8
        self.slot = slot
        self.expected = expected
        self.session_id = session_id
        self.hold: dict[int, tuple[int, bytes]] | None = None
        self.hold_bytes = 0
        self.held_terminal = False
        self.close_seq = -1
        """The ``frame_seq`` of a close that arrived ahead of its turn (-1: none yet)."""
        self.close_reason = _TERMINAL_SENT
        self.touched = -1


# -- the arrival path ---------------------------------------------------------------------


class IngressArrival:
    """The record-applying methods of :class:`~velomux_quic.mux.ingress.IngressTable`."""

    # Set by IngressTable.__init__; declared here because the arrival path reads and writes them.
    lane: int
    stats: MuxIngressStats
    _control: EgressControl
    _peer_budget: PeerBudget
    _routes: list[_Route | None]
    _aside: dict[int, _Route]
    _refused: dict[int, int]
    _epoch: int | None
    _high_water: int | None
    _batches: int
    _staged: bool

    if TYPE_CHECKING:
        # IngressTable: a slot's life and the credit that goes back.

        def retire_all(self) -> int: ...
        def _open(self, sid: int, seq: int, body: memoryview, now: float) -> None: ...
        def _retire(self, route: _Route, inject: bytes | None) -> None: ...
        def _fail(self, route: _Route, message: str | None) -> None: ...
        def _consumer_gone(self, route: _Route) -> None: ...
        def _reconcile(self, touched: list[_Route]) -> None: ...
        def _reconcile_dirty(self) -> int: ...

    def handle_batch(self, header: BatchHeader, records: Sequence[Record], now: float) -> None:
        """Apply one batch, in order, then reconcile what it touched and what was drained."""
        stats = self.stats
        count = len(records)
        stats.batches_received += 1
        stats.records_received += count
        if header.lane != self.lane:
            stats.drops["lane_mismatch"] += count
            return
        epoch = header.peer_epoch
        if self._epoch is None or epoch > self._epoch:
            if self._epoch is not None:
                self.retire_all()
            self._epoch = epoch
            self._high_water = None
        elif epoch < self._epoch:
            stats.drops["stale_epoch"] += count
            return
        self._meter(header.batch_seq)
        self._batches += 1
        stamp = self._batches
        touched: list[_Route] = []
        routes = self._routes
        for record_type, sid, seq, body in records:
            if record_type != _DATA:
                if record_type == _CLOSE_SLOT:
                    if len(body) != 1 or body[0] not in _OWNER_CLOSE_BYTES:
                        self._peer_close(sid, body)
                        continue
                elif record_type == _OPEN_SLOT:
                    self._open(sid, seq, body, now)
                    continue
                elif record_type != _SLOT_HEARTBEAT:
                    self._egress_control(record_type, sid, body)
                    continue
            index = sid >> 8
            route = routes[index] if index < len(routes) else None
            if route is None or route.slot_id != sid:
                route = self._miss(sid, route)
                if route is None:
                    continue
            expected = route.expected
            if seq == expected:
                if route.touched != stamp:
                    route.touched = stamp
                    touched.append(route)
                if record_type == _DATA and not route.hold and route.close_seq < 0:
                    # The common record, inlined: the next item of an open slot, in order,
                    # within its credit. Everything else takes the general rules below.
                    slot = route.slot
                    data = bytes(body)
                    if (
                        slot.data_delivered < slot.granted
                        and not slot.withdrawn
                        and not slot.terminal
                        and data.startswith(ITEM_PREFIX)
                    ):
                        route.expected = seq + 1
                        slot.last_arrival = now
                        if not slot.deliver(data):
                            stats.reader_stall += 1
                            self._fail(route, "mux reader stall: the slot buffer had no room")
                        continue
                if self._apply(route, record_type, body, now) and (
                    route.hold or route.close_seq >= 0
                ):
                    self._release_hold(route, now)
            elif seq < expected:
                stats.drops["duplicate"] += 1
            else:
                self._hold(route, record_type, seq, body)
        self._reconcile(touched)
        self._reconcile_dirty()

    def handle_staged_batch(
        self, header: BatchHeader, records: Sequence[Record], now: float
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
        elif occupant is not None:
            drops["generation"] += 1
            self.stats.generation_mismatch += 1
        else:
            # Never opened in this epoch, or already closed. The chapter counts a record
            # that overtook its OpenSlot here too: "finds no slot ... dropped as closed_slot".
            drops["closed_slot"] += 1
        return None

    def _apply(self, route: _Route, record_type: int, body: memoryview | bytes, now: float) -> bool:
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

    def _hold(self, route: _Route, record_type: int, seq: int, body: memoryview) -> None:
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

    def _peer_close(self, sid: int, body: memoryview) -> None:
        try:
            reason = decode_close_slot(body)
        except MalformedBatch:
            self.stats.malformed_records += 1
            return
        self._control.closed_by_peer(sid, reason)

    def _egress_control(self, record_type: int, sid: int, body: memoryview) -> None:
        try:
            if record_type == _CREDIT_UPDATE:
                self._control.credit(sid, decode_credit(body))
            elif record_type == _LIFECYCLE_SLOT:
                session, action = decode_lifecycle(body)
                self.stats.lifecycle_received += 1
                self._control.lifecycle(session, action)
            else:
                self.stats.malformed_records += 1
        except MalformedBatch:
            self.stats.malformed_records += 1
