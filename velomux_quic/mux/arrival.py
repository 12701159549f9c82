"""The per-record kernel of mux ingress: a slot's sequencing state and the loops that run
once per record or once per touched slot, on the tables of :mod:`.ingress`.

:class:`_Route` is the sequencing state of one live slot; :func:`handle_batch` is the
arrival loop of :meth:`IngressTable.handle_batch <.ingress.IngressTable.handle_batch>`,
which applies the common record itself; :func:`reconcile`, :func:`reconcile_dirty` and
:func:`visit` return the credit of the slots a batch touched and of those the consumers
drained. The table binds them as its methods, so they read and write its fields as its own
code does. Every rule that is not the common record (an OpenSlot, a gap, a miss, a close,
a failure) stays a method of the table: the loop calls it, so a rare path exists once, in
:mod:`.ingress`, which says what the rules are.

These run once per record on every stream, so this module is one of the record path's
compiled modules (velomux_quic.recordpath): where built, this same file is compiled, with
the C types of ``arrival.pxd`` (the route's fields, the loops' locals, and the slot's
fields and calls cimported from ``credit.pxd``); otherwise it runs as it is. It is apart
from the table because a compiled module's classes and loops are declared in its ``.pxd``
and the table is not a C class; and it imports nothing of :mod:`.ingress` at run time,
which imports it, so loading either needs no import of the other half way through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from ..streaming.frames import ITEM_PREFIX
from .contracts import MuxIngressStats, ReplySink
from .credit import DirtySet, IngressSlot
from .protocol import BatchHeader, BytesLike, OwnedRecord, Record
from .records import _CONTROL_BODY_SIZES, CloseReason, RecordType

__all__ = ["Table", "handle_batch", "reconcile", "reconcile_dirty", "visit"]

_DATA: Final = int(RecordType.DATA)
_OPEN_SLOT: Final = int(RecordType.OPEN_SLOT)
_CLOSE_SLOT: Final = int(RecordType.CLOSE_SLOT)
_SLOT_HEARTBEAT: Final = int(RecordType.SLOT_HEARTBEAT)
_CREDIT_UPDATE: Final = int(RecordType.CREDIT_UPDATE)
_CREDIT_BODY_SIZE: Final = _CONTROL_BODY_SIZES[_CREDIT_UPDATE]
_TERMINAL_SENT: Final = CloseReason.TERMINAL_SENT
_OWNER_CLOSE_BYTES: Final = frozenset({int(_TERMINAL_SENT), int(CloseReason.PEER_GONE)})
_ITEM_PREFIX: Final = ITEM_PREFIX


class _Route:
    """The sequencing state of one live slot: what ``frame_seq`` comes next, the records
    that arrived ahead of it, and a close that arrived ahead of it.

    One per stream, not per record. The hold is created on the first gap only. Compiled,
    the fields are C fields, which the arrival loop reads per record.
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


class Table(Protocol):
    """What the kernel reads and calls of the table it runs for (an
    :class:`~.ingress.IngressTable`, which binds the kernel's functions as its methods):
    its fields, and the general rules the loop hands a record to. Named here rather than
    imported, since the table's module imports this one."""

    stats: MuxIngressStats
    lane: int
    dirty: DirtySet
    _epoch: int | None
    _high_water: int | None
    _staged: bool
    _batches: int
    _routes: list[_Route | None]
    _replies: ReplySink

    def retire_all(self) -> int: ...
    def _meter(self, batch_seq: int) -> None: ...
    def _peer_close(self, sid: int, body: BytesLike) -> None: ...
    def _open(self, sid: int, seq: int, body: BytesLike, now: float) -> None: ...
    def _egress_control(self, record_type: int, sid: int, body: BytesLike) -> None: ...
    def _egress_credits(self, grants: list[tuple[int, int]]) -> None: ...
    def _miss(self, sid: int, occupant: _Route | None) -> _Route | None: ...
    def _apply(self, route: _Route, record_type: int, body: BytesLike, now: float) -> bool: ...
    def _release_hold(self, route: _Route, now: float) -> None: ...
    def _hold(self, route: _Route, record_type: int, seq: int, body: BytesLike) -> None: ...
    def _fail(self, route: _Route, message: str | None) -> None: ...
    def _consumer_gone(self, route: _Route) -> None: ...


def handle_batch(
    table: Table, header: BatchHeader, records: Sequence[Record | OwnedRecord], now: float
) -> None:
    """Apply one batch, in order, then reconcile what it touched and what was drained.

    The common record (the next item of an open slot, in order, within its credit) is
    applied here, with locals bound once per batch; every other sequenced record takes the
    table's general rules (``_apply``, ``_hold``, ``_release_hold``, ``_miss``), and every
    record about this side's own slots its handlers."""
    stats = table.stats
    count = len(records)
    stats.batches_received += 1
    stats.records_received += count
    if header.lane != table.lane:
        stats.drops["lane_mismatch"] += count
        return
    epoch = header.peer_epoch
    if table._epoch is None or epoch > table._epoch:
        if table._epoch is not None:
            table.retire_all()
        table._epoch = epoch
        table._high_water = None
    elif epoch < table._epoch:
        stats.drops["stale_epoch"] += count
        return
    if not table._staged:  # a staged singleton takes no place in the lane's numbering
        table._meter(header.batch_seq)
    table._batches += 1
    stamp = table._batches
    touched: list[_Route] = []
    grants: list[tuple[int, int]] | None = None
    routes = table._routes
    data_type = _DATA
    item_prefix = _ITEM_PREFIX
    for record_type, sid, seq, body in records:
        if record_type != data_type:
            if record_type == _CREDIT_UPDATE and len(body) == _CREDIT_BODY_SIZE:
                # The peer's grants for our slots, one a slot in a return of credit: handed
                # over together (the batch's other records about our slots flush them first).
                if grants is None:
                    grants = []
                grants.append((sid, int.from_bytes(body, "big")))
                continue
            if record_type == _CLOSE_SLOT:
                if len(body) != 1 or body[0] not in _OWNER_CLOSE_BYTES:
                    if grants:
                        table._egress_credits(grants)
                        grants = None
                    table._peer_close(sid, body)
                    continue
            elif record_type == _OPEN_SLOT:
                table._open(sid, seq, body, now)
                continue
            elif record_type != _SLOT_HEARTBEAT:
                if grants:
                    table._egress_credits(grants)
                    grants = None
                table._egress_control(record_type, sid, body)
                continue
        try:
            route = routes[sid >> 8]
        except IndexError:  # an index past every slot opened so far
            route = None
        if route is None or route.slot_id != sid:
            route = table._miss(sid, route)
            if route is None:
                continue
        if seq == route.expected:
            if route.touched != stamp:
                route.touched = stamp
                touched.append(route)
            if record_type == data_type and route.close_seq < 0 and not route.hold:
                # The common record, inlined: the next item of an open slot, in order,
                # within its credit. Everything else takes the general rules below.
                slot = route.slot
                data = body if type(body) is bytes else bytes(body)
                if (
                    slot.data_delivered < slot.granted
                    and not slot.withdrawn
                    and not slot.terminal
                    and data.startswith(item_prefix)
                ):
                    route.expected = seq + 1
                    slot.last_arrival = now
                    if not slot.deliver(data):
                        stats.reader_stall += 1
                        table._fail(route, "mux reader stall: the slot buffer had no room")
                    continue
            if table._apply(route, record_type, body, now) and (route.hold or route.close_seq >= 0):
                table._release_hold(route, now)
        elif seq < route.expected:
            stats.drops["duplicate"] += 1
        else:
            table._hold(route, record_type, seq, body)
    if grants:
        table._egress_credits(grants)
    reconcile(table, touched)
    reconcile_dirty(table)


def visit(table: Table, route: _Route) -> None:
    """Return one slot's drained credit to its sender, or tell the sender its consumer
    withdrew."""
    slot = route.slot
    if slot.withdrawn:
        if not slot.terminal:
            table._consumer_gone(route)
        return
    grant = slot.reconcile()
    if grant:
        table._replies.credit(route.slot_id, grant)


def reconcile(table: Table, touched: list[_Route]) -> None:
    """Visit the slots a batch delivered into that may owe the sender something now.

    Once per touched slot per batch, so the common answer (nothing to do) is decided here
    without a call: a live slot whose sender still holds ``return_below`` credits or more
    would only have its drained count moved into the withheld count by
    :meth:`IngressSlot.reconcile` (a later visit grants the same sum), and a slot nothing
    was taken from since its last visit has nothing to grant (its withheld credit is then
    the whole of what it owes).
    """
    routes = table._routes
    for route in touched:
        slot = route.slot
        if slot.granted - slot.data_delivered - slot.held_data >= slot.return_below and not (
            slot.withdrawn or slot.terminal or slot.closed
        ):
            continue  # the sender holds enough credit: any grant waits (see above)
        if not (slot.drained or slot.withdrawn or slot._withheld):
            continue  # nothing taken since the last visit: nothing to grant or tell
        index = route.index
        if index < len(routes) and routes[index] is route:
            visit(table, route)


def reconcile_dirty(table: Table) -> int:
    """Visit the slots the consumers drained (the dirty set); how many were listed."""
    dirty = table.dirty
    listed = dirty.drain()
    routes = table._routes
    size = len(routes)
    for index in listed:
        route = routes[index] if index < size else None
        if route is not None:
            visit(table, route)
    return len(listed)
