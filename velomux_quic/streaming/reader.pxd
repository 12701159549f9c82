# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.reader` where it is compiled (see
velomux_quic.recordpath): the read's awaitable as a final C type, its steps as C calls, and
the inbox cimported, so that the read takes each record with a C call.

``_reader_send.pyx`` cimports :class:`AnchorRead` from here to give its type the
``am_send`` slot."""

cimport cython

from velomux_quic.streaming.inbox cimport Inbox

cdef object _ITEM
cdef object _HEARTBEAT
cdef object _SENDER_ERROR
cdef object _DETACHED
cdef object _FINALIZED
cdef object _DROPPED
cdef bytes _PREFIX
cdef Py_ssize_t _PREFIX_SIZE


@cython.locals(inbox=Inbox, room=Py_ssize_t)
cpdef take_items(object anchor, list items, Py_ssize_t limit)


@cython.locals(read=AnchorRead)
cpdef AnchorRead anchor_next(object anchor)


# Final, so its steps are direct C calls. A free list would have to be declared in the
# module itself (Cython takes a class's directives from its own source, not the .pxd),
# which would make Cython a requirement of the pure path.
@cython.final
cdef class AnchorRead:
    cdef object _anchor
    cdef Inbox _inbox
    cdef bint _reading
    cdef bint _done

    cdef void _hold(self) except *
    cdef void _finish(self) except *

    @cython.locals(inbox=Inbox, data=bytes)
    cdef object _step(self)
