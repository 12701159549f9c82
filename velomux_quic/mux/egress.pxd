# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.mux.egress` where it is compiled (see
velomux_quic.recordpath): the batcher's fields, which staging a record and packing it read
and write once per record, and those two calls as C calls.

The batcher is final: nothing derives from it, so a caller that cimports it (the mux's
compiled ``MuxChannel``) stages a record with a direct call to ``offer``."""

cimport cython

# The classes under names of their own: the module's imports of their Python names stay
# plain imports, which it re-exports (``EgressSlot``) where compiled as where not.
from velomux_quic.mux.batch_codec cimport BatchBuilder as CBatchBuilder
from velomux_quic.mux.batch_codec cimport _append_data
from velomux_quic.mux.slots cimport EgressSlot as CEgressSlot

cdef object _OPEN
cdef object _OPENING
cdef object _CLOSED
cdef object QueuedTerminal


@cython.final
cdef class EgressBatcher:
    cdef public object lane
    cdef public object config
    cdef public object policy
    cdef public Py_ssize_t byte_cap
    cdef public Py_ssize_t quantum
    cdef public Py_ssize_t poll_budget
    cdef public Py_ssize_t eager_budget
    cdef public object counters
    cdef public object on_guard_dropped
    cdef public object epoch
    cdef public object batch_seq
    cdef public object stats
    cdef public bint parked
    cdef public bint wake_pending
    cdef public Py_ssize_t queue_limit
    cdef object _epochs
    cdef Py_ssize_t _room
    cdef list _slots
    cdef list _generations
    cdef list _free
    cdef dict _by_session
    cdef object _opens
    cdef list _ready
    cdef Py_ssize_t _ready_count
    cdef Py_ssize_t _live
    cdef dict _reply_credit
    cdef dict _reply_close
    cdef dict _reply_lifecycle
    cdef object _reply_since
    cdef object _staged_since
    cdef object _last_data_write
    cdef bint _kick
    cdef bint _urgent
    cdef CBatchBuilder _builder
    cdef Py_ssize_t _count_data
    cdef Py_ssize_t _count_open
    cdef Py_ssize_t _count_close
    cdef Py_ssize_t _count_credit
    cdef Py_ssize_t _count_lifecycle

    @cython.locals(queued=Py_ssize_t, room=Py_ssize_t, size=Py_ssize_t)
    cpdef bint offer(self, CEgressSlot slot, object body, object now) except -1

    @cython.locals(slot=CEgressSlot)
    cpdef bint on_credit(self, object slot_id_, object delta, object now) except -1

    @cython.locals(index=Py_ssize_t, slot=CEgressSlot)
    cpdef object slot(self, object slot_id_)

    cdef object _control_target(self, object slot_id_)

    # The slot-ending helpers, shared by close, end_now, offer_terminal and end_lost:
    # C calls between the batcher's own methods.
    cdef _discard_queued(self, CEgressSlot slot)
    cdef _drop_guard(self, CEgressSlot slot)
    cdef _queue_terminal(self, CEgressSlot slot, object body, object now, object guard)

    cpdef on_credits(self, list grants, object now)

    # The ready list: a slot joining it (from staging, credit, a lifted fence and the
    # packing), the list taken whole (a poll, epoch death), and what its slots hold.
    cdef bint _mark_ready(self, CEgressSlot slot) except -1
    @cython.locals(slots=list, slot=CEgressSlot)
    cdef list _take_ready(self)

    @cython.locals(slot=CEgressSlot, total=Py_ssize_t)
    cdef Py_ssize_t _staged_bytes(self) except -1

    # A slot's record off the common path (a terminal, a full batch, a record no batch
    # holds) and a slot's end: C calls from the packing loop, once per stream at least.
    cdef _free_slot(self, CEgressSlot slot, object event)
    @cython.locals(builder=CBatchBuilder, taken=Py_ssize_t, terminal=bint, needed=Py_ssize_t)
    cdef tuple _pack_slot(
        self, CEgressSlot slot, list out, list guards, bint carries_data, Py_ssize_t limit
    )
    @cython.locals(builder=CBatchBuilder, guards=list, staged=bint)
    cdef object _singleton(self, CEgressSlot slot, object body, bint terminal)

    @cython.locals(
        builder=CBatchBuilder, slots=list, carried=list, quantum=Py_ssize_t,
        budget=Py_ssize_t, buf=bytearray, cap=Py_ssize_t, room=Py_ssize_t, pending=Py_ssize_t,
        packed=Py_ssize_t, position=Py_ssize_t, slot=CEgressSlot, credit=cython.longlong,
        first=cython.ulonglong, seq=cython.ulonglong, taken=Py_ssize_t, length=Py_ssize_t,
        more=Py_ssize_t, sid=Py_ssize_t, queued=Py_ssize_t,
    )
    cpdef tuple _pack_ready(self, list out, list guards, bint carries_data)
