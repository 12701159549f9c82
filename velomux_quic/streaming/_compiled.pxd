# cython: language_level=3
"""The C declarations of the streaming layer's compiled twin that other compiled modules
build on: the sender's hot fields, and the channel a record is staged into from C.

The mux's compiled ``MuxChannel`` derives from :class:`StagingChannel` (the mux is above
the streaming layer, so it imports these declarations, never the other way round), which
lets the pass loop and ``send()`` stage a record into it with one C call."""


cdef class SenderStateFields:
    cdef public object channel
    cdef public bint terminal_sent


cdef class StreamSenderFields:
    cdef public object _state


cdef class StagingChannel:
    cdef int stage(self, object body) except -1
