# cython: language_level=3
"""The compiled twin of the mux's per-record paths (selected by velomux_quic.recordpath).

Each name here twins a definition of the pure-Python modules, which stay the reference:
``EgressBatcher.offer`` and ``EgressBatcher._pack_ready`` (``egress.py``), :class:`Route`
and ``IngressTable.handle_batch`` / ``_reconcile`` / ``_reconcile_dirty`` (``ingress.py``).
A method twin is a module-level function named ``<Class>_<method>`` that takes the
instance first.

The rules are the pure code's, line for line, with the same errors, bounds and counters; only
the representation differs: the per-record state (routes, the batcher's fields) lives in C
fields, and the per-record loops read and write them without the interpreter. Everything a
twin does not do per record it does by calling the pure code (the general rules of a record
that is not the common one, every refusal, every snapshot), so a rare path exists once.

The state the twins work on is written once, in compiled modules: the batch codec
(``batch_codec.py``), the egress slot (``slots.py``), and the ingress slot, dirty set and
peer budget (``credit.py``). Their C declarations are cimported from their ``.pxd`` files,
and those modules are imported with this one. The package's other modules are imported
when first needed, not at import: this module is loaded while the pure modules that
select it are still being defined.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetDefault
from libc.string cimport memcmp

from velomux_quic.mux.credit cimport DirtySet, IngressSlot
from velomux_quic.mux.batch_codec cimport BatchBuilder, _append_data
from velomux_quic.mux.slots cimport EgressSlot

from collections import deque

from velomux_quic.errors import UsageError

cdef Py_ssize_t RECORD_HEADER_SIZE = 13
cdef Py_ssize_t MAX_RECORDS = 0xFFFF
cdef int DATA = 0
cdef int OPEN_SLOT = 1
cdef int CLOSE_SLOT = 2
cdef int CREDIT_UPDATE = 3
cdef int SLOT_HEARTBEAT = 4
cdef bytes ITEM_PREFIX = b"\x81\xa4Item"

# Bound on first use (see the module docstring); the slot states at import (_bind_slots).
cdef object _OPENING = None
cdef object _OPEN = None
cdef object _CLOSED = None
cdef object _TERMINAL = None  # slots.QueuedTerminal: the type of a queued terminal
cdef object _frames = None
cdef object _ingress = None


cdef int _bind_slots() except -1:
    global _OPENING, _OPEN, _CLOSED, _TERMINAL
    from velomux_quic.mux import slots

    state = slots.SlotState
    _OPENING = state.OPENING
    _OPEN = state.OPEN
    _CLOSED = state.CLOSED
    _TERMINAL = slots.QueuedTerminal
    return 0


# The slots module is imported already: its EgressSlot is cimported above.
_bind_slots()


cdef object frames():
    global _frames
    if _frames is None:
        from velomux_quic.streaming import frames as module
        _frames = module
    return _frames


cdef object ingress_module():
    global _ingress
    if _ingress is None:
        from velomux_quic.mux import ingress as module
        _ingress = module
    return _ingress




# -- egress.py --------------------------------------------------------------------------


cdef class BatcherFields:
    """Twin of :class:`velomux_quic.mux.egress.BatcherFields`: the fields ``offer`` writes
    per record, in C."""

    cdef public Py_ssize_t _room
    cdef public dict _ready
    cdef public object _staged_since


def EgressBatcher_offer(self, slot, body, now):
    """Twin of ``EgressBatcher.offer``."""
    return _offer(<BatcherFields?>self, <EgressSlot?>slot, body, now, None)


cdef bint _offer(
    BatcherFields self, EgressSlot slot, object body, object now, object clock
) except -1:
    """``offer``; with ``now`` None, the time is ``clock()``, read only when it is used
    (a record that starts the linger window), not once per record."""
    state = slot.state
    if state is not _OPEN and state is not _OPENING:
        raise egress_closed_slot(slot)
    cdef Py_ssize_t queued = slot.queued_bytes
    if queued >= slot.budget:
        return False
    cdef Py_ssize_t room = self._room
    if room <= 0 and queued:
        (<object>self).stats.queue_full += 1
        return False
    cdef Py_ssize_t size = PyBytes_GET_SIZE(body) if type(body) is bytes else len(body)
    slot._append(body)
    slot.queued_bytes = queued + size
    self._room = room - size
    if slot.credit > 0:
        if state is _OPEN:
            if not slot.fenced:
                PyDict_SetDefault(self._ready, slot._key, slot)
                if self._staged_since is None:
                    self._staged_since = clock() if now is None else now
        elif self._staged_since is None:
            self._staged_since = clock() if now is None else now
    elif state is _OPEN and not slot.exhausted_once:
        slot.exhausted_once = True
        (<object>self).stats.credit_exhausted += 1
    return True


cdef object egress_closed_slot(EgressSlot slot):
    return UsageError(
        f"slot {slot.slot_id:#010x} is {slot.state.name}: it takes no more records; "
        "a sender checks its channel's closed flag before it offers"
    )


def EgressBatcher__pack_ready(self, out, guards, carries_data):
    """Twin of ``EgressBatcher._pack_ready``: the common record (data with credit that fits
    the open batch) packed in C; every other case through the pure ``_pack_slot``."""
    cdef BatchBuilder builder = self._builder
    ready = self._ready
    cdef list slots = list(ready.values())
    ready.clear()
    stats = self.stats
    cdef Py_ssize_t quantum = self.quantum
    cdef Py_ssize_t budget = self.poll_budget
    cdef bytearray buf = builder._buf
    cdef Py_ssize_t cap = builder._cap - RECORD_HEADER_SIZE
    cdef Py_ssize_t room = MAX_RECORDS - builder._count
    cdef Py_ssize_t pending = 0
    cdef Py_ssize_t packed = 0
    cdef Py_ssize_t freed = 0  # bytes taken out of queues, given back to self._room at once
    cdef Py_ssize_t position, taken, length, more
    cdef long long credit
    cdef unsigned long long first, seq
    cdef EgressSlot slot
    cdef list carried
    cdef object body
    cdef object queue
    while slots:
        carried = []
        for position in range(len(slots)):
            slot = <EgressSlot?>slots[position]
            if budget <= 0:
                carried = slots[position:] + carried
                break
            if slot.state is _CLOSED:
                continue
            queue = slot.queue
            credit = slot.credit
            first = seq = slot.next_seq
            taken = 0
            if queue and credit > 0:
                while True:
                    body = queue[0]
                    if type(body) is bytes:
                        length = PyBytes_GET_SIZE(body)
                    elif type(body) is _TERMINAL:
                        break
                    else:
                        length = len(body)
                    if PyByteArray_GET_SIZE(buf) + length > cap or pending >= room:
                        break
                    _append_data(buf, slot.slot_id, seq, body)
                    pending += 1
                    slot._popleft()
                    taken += length
                    seq += 1
                    credit -= 1
                    if not queue or credit <= 0 or taken >= quantum:
                        break
            if seq != first:
                packed += seq - first
                slot.next_seq = seq
                slot.credit = credit
                slot.queued_bytes -= taken
                freed += taken
                carries_data = True
            if queue and (type(queue[0]) is _TERMINAL or (credit > 0 and taken < quantum)):
                builder._count += pending
                self._count_data += packed
                pending = packed = 0
                if freed:
                    self._room += freed
                    freed = 0
                guards, carries_data, more = self._pack_slot(
                    slot, out, guards, carries_data, quantum - taken
                )
                buf = builder._buf
                room = MAX_RECORDS - builder._count
                taken += more
            budget -= taken
            if not queue or slot.state is _CLOSED or slot.fenced:
                continue
            if slot.credit <= 0 and type(queue[0]) is not _TERMINAL:
                if not slot.exhausted_once:
                    slot.exhausted_once = True
                    stats.credit_exhausted += 1
                continue
            carried.append(slot)
        slots = carried
        if budget <= 0:
            break
    builder._count += pending
    if packed:
        self._count_data += packed
    if freed:
        self._room += freed
    if slots:
        for slot in slots:
            if slot.state is not _CLOSED:
                ready[slot.index] = slot
        self._kick = True
    return guards, carries_data


# -- ingress.py -------------------------------------------------------------------------


cdef class _Route:
    """Twin of ``velomux_quic.mux.ingress._Route``."""

    cdef public object close_reason
    cdef public long long close_seq
    cdef public long long expected
    cdef public bint held_terminal
    cdef public object hold
    cdef public long long hold_bytes
    cdef public Py_ssize_t index
    cdef public object session_id
    cdef public object slot
    cdef public Py_ssize_t slot_id
    cdef public long long touched

    def __init__(self, slot_id, slot, expected, session_id):
        self.slot_id = slot_id
        self.index = slot_id >> 8
        self.slot = slot
        self.expected = expected
        self.session_id = session_id
        self.hold = None
        self.hold_bytes = 0
        self.held_terminal = False
        self.close_seq = -1
        self.close_reason = ingress_module()._TERMINAL_SENT
        self.touched = -1


def IngressTable_handle_batch(self, header, records, now):
    """Twin of ``IngressTable.handle_batch``: the common record (the next item of an open
    slot, in order, within its credit) delivered in C; everything else by the pure rules."""
    module = ingress_module()
    stats = self.stats
    cdef Py_ssize_t count = len(records)
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
    if not self._staged:
        self._meter(header.batch_seq)
    self._batches += 1
    cdef long long stamp = self._batches
    cdef list touched = []
    cdef list routes = self._routes
    cdef Py_ssize_t nroutes
    cdef Py_ssize_t index
    cdef long long seq
    cdef int record_type
    cdef _Route route
    cdef IngressSlot slot
    cdef bytes data
    cdef double at = now
    cdef long long stalls = 0
    owner_close = module._OWNER_CLOSE_BYTES
    routes = self._routes
    for record in records:
        record_type, sid, seq_object, body = record
        if record_type != DATA:
            if record_type == CLOSE_SLOT:
                if len(body) != 1 or body[0] not in owner_close:
                    self._peer_close(sid, body)
                    continue
            elif record_type == OPEN_SLOT:
                self._open(sid, seq_object, body, now)
                continue
            elif record_type != SLOT_HEARTBEAT:
                self._egress_control(record_type, sid, body)
                continue
        index = sid >> 8
        nroutes = len(routes)
        found = routes[index] if 0 <= index < nroutes else None
        if found is None or (<_Route?>found).slot_id != sid:
            found = self._miss(sid, found)
            if found is None:
                continue
        route = <_Route?>found
        seq = seq_object
        if seq == route.expected:
            if route.touched != stamp:
                route.touched = stamp
                touched.append(route)
            if (
                record_type == DATA
                and route.close_seq < 0
                and not route.hold
                and type(route.slot) is IngressSlot
            ):
                slot = <IngressSlot>route.slot
                data = body if type(body) is bytes else bytes(body)
                if (
                    slot.data_delivered < slot.granted
                    and not slot.withdrawn
                    and not slot.terminal
                    and PyBytes_GET_SIZE(data) >= 6
                    and memcmp(PyBytes_AS_STRING(data), PyBytes_AS_STRING(ITEM_PREFIX), 6) == 0
                ):
                    route.expected = seq + 1
                    slot.last_arrival = at
                    if not slot.deliver(data):
                        stats.reader_stall += 1
                        self._fail(route, "mux reader stall: the slot buffer had no room")
                    continue
            if self._apply(route, record_type, body, now) and (
                route.hold or route.close_seq >= 0
            ):
                self._release_hold(route, now)
        elif seq < route.expected:
            stats.drops["duplicate"] += 1
        else:
            self._hold(route, record_type, seq_object, body)
    IngressTable__reconcile(self, touched)
    IngressTable__reconcile_dirty(self)


cdef void _visit(object table, _Route route) except *:
    cdef IngressSlot slot
    if type(route.slot) is not IngressSlot:
        table._visit(route)
        return
    slot = <IngressSlot>route.slot
    if slot.withdrawn:
        if not slot.terminal:
            table._consumer_gone(route)
        return
    cdef long long grant = slot.reconcile()
    if grant:
        table._replies.credit(route.slot_id, grant)


def IngressTable__reconcile(self, touched):
    """Twin of ``IngressTable._reconcile``."""
    cdef list routes = self._routes
    cdef Py_ssize_t size = len(routes)
    cdef _Route route
    cdef IngressSlot slot
    for found in touched:
        route = <_Route?>found
        if type(route.slot) is IngressSlot:
            slot = <IngressSlot>route.slot
            if slot.granted - slot.data_delivered - slot.held_data >= slot.return_below and not (
                slot.withdrawn or slot.terminal or slot.closed
            ):
                continue
            if not (slot.drained or slot.withdrawn or (slot._withheld + slot.drained)):
                continue
        else:
            other = route.slot
            if other.granted - other.data_delivered - other.held_data >= other.return_below and not (
                other.withdrawn or other.terminal or other.closed
            ):
                continue
            if not (other.drained or other.withdrawn or other.withheld_credit):
                continue
        if route.index < size and routes[route.index] is route:
            _visit(self, route)


def IngressTable__reconcile_dirty(self):
    """Twin of ``IngressTable._reconcile_dirty``."""
    dirty = self.dirty
    cdef list listed = (<DirtySet>dirty).drain() if type(dirty) is DirtySet else dirty.drain()
    cdef list routes = self._routes
    cdef Py_ssize_t size = len(routes)
    cdef Py_ssize_t index
    for index in listed:
        found = routes[index] if index < size else None
        if found is not None:
            _visit(self, <_Route?>found)
    return len(listed)
