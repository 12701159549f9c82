# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.mux.credit` where it is compiled (see
velomux_quic.recordpath): a slot's buffer and credit account, the peer's byte count and
the dirty bitmap as C fields, and the calls made once per record (deliver, take, the mark
a take makes, the reconcile of a visit) as C calls.

The mux's compiled ingress (``_compiled.pyx``) cimports the classes from here and reads
their fields in C. They are final: nothing derives from them, so those calls are direct.
"""

cimport cython


@cython.final
cdef class PeerBudget:
    cdef public long long limit
    cdef public long long used


@cython.final
cdef class DirtySet:
    cdef bytearray _bits
    cdef list _listed
    cdef object _doorbell

    @cython.locals(bits=bytearray, byte=Py_ssize_t, mask=int, current=int)
    cpdef bint mark(self, Py_ssize_t index) except -1

    @cython.locals(listed=list, bits=bytearray, index=Py_ssize_t)
    cpdef list drain(self)


@cython.final
cdef class IngressSlot:
    cdef object _append
    cdef object _buffer
    cdef object _popleft
    cdef DirtySet _dirty
    cdef PeerBudget _peer
    cdef object _wake
    cdef long long _withheld
    cdef public long long bytes_buffered
    cdef public Py_ssize_t capacity
    cdef public bint closed
    cdef public long long credit
    cdef public long long data_delivered
    cdef public long long drained
    cdef public bint gap_waiting
    cdef public long long granted
    cdef public long long held_bytes
    cdef public long long held_data
    cdef public long long held_records
    cdef public Py_ssize_t index
    cdef public double last_arrival
    cdef public object on_end
    cdef public object on_terminal
    cdef public bint opened
    cdef public object refusals
    cdef public long long return_below
    cdef public long long slot_byte_budget
    cdef public Py_ssize_t slot_id
    cdef public bint terminal
    cdef public bint withdrawn

    @cython.locals(peer=PeerBudget, size=Py_ssize_t)
    cpdef bint deliver(self, object body) except -1

    @cython.locals(owed=cython.longlong)
    cpdef Py_ssize_t reconcile(self) except? -1

    @cython.locals(peer=PeerBudget, dirty=DirtySet, size=Py_ssize_t)
    cpdef object take(self)
