# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.inbox` where it is compiled (see
velomux_quic.recordpath): the inbox's fields, and the reader's calls made once per record
as C calls. The reader (``reader.pxd``) cimports the class from here."""

cimport cython


cdef class Inbox:
    cdef Py_ssize_t _capacity
    cdef bint _ordered
    cdef object _channel
    cdef dict _feeds
    cdef list _feed_order
    cdef object _head
    cdef object _head_id
    cdef object _head_take
    cdef Py_ssize_t _next_feed
    cdef Py_ssize_t _barrier
    cdef object _waiter
    cdef object _create_future
    cdef object _space
    cdef bint _closed
    cdef public bint reading

    cdef void _find_head(self) except *

    @cython.locals(count=Py_ssize_t, step=Py_ssize_t, index=Py_ssize_t)
    cpdef object take(self)

    cpdef bint any_feed_exhausted(self) except -1
    cdef object _taken(self, item)
    cpdef void wake(self) except *
    cpdef object wait(self)
