# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.frames` where it is compiled (see
velomux_quic.recordpath): the per-record encode, callable from C by the modules that
cimport it."""

cimport cython


@cython.locals(pool=list, packed=bytes)
cpdef bytes encode_item(object item)
