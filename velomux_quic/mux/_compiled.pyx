# cython: language_level=3
"""The compiled twin of the mux's per-record paths (selected by velomux_quic.recordpath).

Each name here twins a definition of the pure-Python modules, which stay the reference:
``EgressBatcher.offer`` and ``EgressBatcher._pack_ready`` (``egress.py``), and
:class:`MuxChannel` (``driver.py``). A method twin is a module-level function named
``<Class>_<method>`` that takes the instance first.

The rules are the pure code's, line for line, with the same errors, bounds and counters; only
the representation differs: the per-record state (the batcher's fields) lives in C fields,
and the per-record loops read and write them without the interpreter. Everything a
twin does not do per record it does by calling the pure code (the general rules of a record
that is not the common one, every refusal, every snapshot), so a rare path exists once.

The state the twins work on is written once, in compiled modules: the batch codec
(``batch_codec.py``) and the egress slot (``slots.py``). Their C declarations are
cimported from their ``.pxd`` files, and those modules are imported with this one. The package's other modules are imported
when first needed, not at import: this module is loaded while the pure modules that
select it are still being defined.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetDefault

from velomux_quic.mux.batch_codec cimport BatchBuilder, _append_data
from velomux_quic.mux.slots cimport EgressSlot
from velomux_quic.streaming.channels cimport StagingChannel

from collections import deque

from velomux_quic.errors import UsageError

cdef Py_ssize_t RECORD_HEADER_SIZE = 13
cdef Py_ssize_t MAX_RECORDS = 0xFFFF

# Bound on first use (see the module docstring); the slot states at import (_bind_slots).
cdef object _OPENING = None
cdef object _OPEN = None
cdef object _CLOSED = None
cdef object _TERMINAL = None  # slots.QueuedTerminal: the type of a queued terminal
cdef object _frames = None
cdef object _driver = None


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


cdef object driver_module():
    global _driver
    if _driver is None:
        from velomux_quic.mux import driver as module
        _driver = module
    return _driver




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


# -- driver.py --------------------------------------------------------------------------


cdef class MuxChannel(StagingChannel):
    """Twin of :class:`velomux_quic.mux.driver.MuxChannel`: ``try_send`` stages a record
    without leaving C (the batcher's offer twin is called directly), and the streaming
    layer's loops call it as a :class:`StagingChannel`, without a method lookup."""

    cdef object _driver
    cdef EgressSlot _slot
    cdef object _batcher
    cdef BatcherFields _fields
    cdef object _clock
    cdef bint _fast

    def __init__(self, driver, slot):
        self._driver = driver
        self._slot = slot
        self._batcher = driver.batcher
        self._clock = driver._loop.time
        # The offer twin is called in C only when it is the batcher's offer.
        self._fast = getattr(type(self._batcher), "offer", None) is EgressBatcher_offer and (
            "offer" not in getattr(self._batcher, "__dict__", {})
        )
        if self._fast:
            self._fields = <BatcherFields?>self._batcher

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
        if self._fast:
            if not _offer(self._fields, slot, body, None, self._clock):
                return 0
        elif not self._batcher.offer(slot, body, self._clock()):
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
