# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.channels` where it is compiled (see
velomux_quic.recordpath): the channel a sender's loops stage a record into with one C call.

The mux's compiled ``MuxChannel`` derives from :class:`StagingChannel` (the mux is above
the streaming layer, so it cimports this, never the other way round)."""


cdef class StagingChannel:
    cpdef bint try_send(self, object body) except -1
