# cython: language_level=3
"""The compiled twin of the mux's per-record paths (selected by velomux_quic.recordpath).

Each name here twins a definition of the pure-Python modules, which stay the reference:
:class:`Route` and ``IngressTable.handle_batch`` / ``_reconcile`` / ``_reconcile_dirty``
(``ingress.py``), and :class:`MuxChannel` (``driver.py``). A method twin is a module-level
function named ``<Class>_<method>`` that takes the instance first.

The rules are the pure code's, line for line, with the same errors, bounds and counters; only
the representation differs: the per-record state (routes) lives in C fields, and the
per-record loops read and write them without the interpreter. Everything a twin does not
do per record it does by calling the pure code (the general rules of a record that is not
the common one, every refusal, every snapshot), so a rare path exists once.

The state the twins work on is written once, in compiled modules: the egress batcher
(``egress.py``, whose ``offer`` the channel calls in C), the egress slot (``slots.py``),
and the ingress slot, dirty set and peer budget (``credit.py``). Their C declarations are
cimported from their ``.pxd`` files, and those modules are imported with this one. The
package's other modules are imported when first needed, not at import: this module is
loaded while the pure modules that select it are still being defined.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memcmp

from velomux_quic.mux.credit cimport DirtySet, IngressSlot
from velomux_quic.mux.egress cimport EgressBatcher
from velomux_quic.mux.slots cimport EgressSlot
from velomux_quic.streaming.channels cimport StagingChannel

from collections import deque

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
cdef object _frames = None
cdef object _ingress = None
cdef object _driver = None


cdef int _bind_slots() except -1:
    global _OPENING, _OPEN, _CLOSED
    from velomux_quic.mux import slots

    state = slots.SlotState
    _OPENING = state.OPENING
    _OPEN = state.OPEN
    _CLOSED = state.CLOSED
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


cdef object driver_module():
    global _driver
    if _driver is None:
        from velomux_quic.mux import driver as module
        _driver = module
    return _driver




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


# -- driver.py --------------------------------------------------------------------------


cdef class MuxChannel(StagingChannel):
    """Twin of :class:`velomux_quic.mux.driver.MuxChannel`: ``try_send`` stages a record
    without leaving C (the compiled batcher's ``offer`` is called directly), and the
    streaming layer's loops call it as a :class:`StagingChannel`, without a method lookup."""

    cdef object _driver
    cdef EgressSlot _slot
    cdef object _batcher
    cdef EgressBatcher _egress
    cdef object _clock

    def __init__(self, driver, slot):
        self._driver = driver
        self._slot = slot
        self._batcher = driver.batcher
        self._clock = driver._loop.time
        # Called in C when it is the compiled batcher (final: no subclass overrides offer).
        if type(self._batcher) is EgressBatcher:
            self._egress = <EgressBatcher>self._batcher

    @property
    def slot(self):
        return self._slot

    @property
    def session_id(self):
        return self._slot.session_id

    @property
    def credit(self):
        slot = self._slot
        return slot.credit if slot.state is not _CLOSED else 0

    @property
    def queued_bytes(self):
        return self._slot.queued_bytes

    @property
    def lane(self):
        return self._driver.batcher.lane

    def watch(self, owner):
        self._slot.owner = owner

    @property
    def closed(self):
        return self._slot.state > _OPEN

    cpdef bint try_send(self, object body) except -1:
        return self.stage(body) == 1

    cdef int stage(self, object body) except -1:
        slot = self._slot
        state = slot.state
        if state is not _OPEN and state is not _OPENING:
            return 0
        if self._egress is not None:
            if not self._egress.offer(slot, body, self._clock):
                return 0
        elif not self._batcher.offer(slot, body, self._clock):
            return 0
        driver = self._driver
        if driver._wake is None:
            driver.wake()
        return 1

    async def send(self, body):
        driver = self._driver
        while True:
            if self.closed:
                raise driver_module().ChannelClosed("the mux slot is closed")
            if driver.batcher.offer(self._slot, body, driver.now()):
                driver.wake()
                return
            await driver.wait_space(self._slot)

    def send_terminal(self, body, done):
        if self.closed:
            done.set_result(False)
            return
        driver = self._driver
        driver.batcher.offer_terminal(
            self._slot, body, driver.now(), guard=driver_module().DeliveryGuard(done)
        )
        driver.wake()

    def end_now(self, body, done):
        if self.closed:
            done.set_result(False)
            return
        driver = self._driver
        driver.batcher.end_now(
            self._slot, body, driver.now(), guard=driver_module().DeliveryGuard(done)
        )
        driver.wake()

    def abort(self):
        if self._slot.state <= _OPEN:
            self._driver.batcher.cancel_slot(self._slot)
            self._driver.wake()
