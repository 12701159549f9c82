# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.mux.channel` where it is compiled (see
velomux_quic.recordpath): the channel derives from the streaming layer's
:class:`StagingChannel`, so the sender's loops call its ``try_send`` as a C method, and
reads its slot's state and stages into the batcher in C (the slot and the batcher are
cimported)."""

from velomux_quic.mux.egress cimport EgressBatcher
from velomux_quic.mux.slots cimport EgressSlot
from velomux_quic.streaming.channels cimport StagingChannel

cdef object _OPEN
cdef object _OPENING


cdef class MuxChannel(StagingChannel):
    cdef EgressBatcher _batcher
    cdef object _clock
    cdef object _driver
    cdef EgressSlot _slot

    cpdef bint try_send(self, object body) except -1
