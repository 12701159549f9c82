# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.sender` where it is compiled (see
velomux_quic.recordpath): the sender's state as C fields, which every record's send and
the pass loop read, and the pass loop's counters as C variables."""

cimport cython

from velomux_quic.streaming.channels cimport StagingChannel
from velomux_quic.streaming.frames cimport encode_item, item_frame


cdef class SenderState:
    cdef public object channel
    cdef readonly StagingChannel staging
    cdef public bint terminal_sent
    cdef public bytes terminal_body
    cdef public object cancelled
    cdef public object handle
    cdef public object heartbeat_interval
    cdef public object loop
    cdef public object metrics
    cdef public object next_heartbeat
    cdef public object owner
    cdef public object retired
    cdef public object sender_id
    cdef public object sender_stream_id
    cdef public object state
    cdef public object stop_requested
    cdef public object target
    cdef public object transport_key
    cdef object __weakref__


cdef class StreamSender:
    cdef public SenderState _state
    cdef object __weakref__


@cython.locals(
    state=SenderState, taken=Py_ssize_t, grew=bint, index=Py_ssize_t, packed=bytes,
    compiled=bint, prefix=bytes, packer_buffer=Py_ssize_t, blocked=set,
)
cpdef Py_ssize_t _stage_pass(object pairs, dict failed, list left) except -1


# Final, so nothing can subclass the one object every send returns.
@cython.final
cdef class SendDone:
    pass
