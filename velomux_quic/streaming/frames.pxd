# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.frames` where it is compiled (see
velomux_quic.recordpath): the per-record encode, callable from C by the modules that
cimport it."""

cimport cython

cdef Py_ssize_t _packer_buffer
cdef Py_ssize_t _pool_max


@cython.locals(pool=list, packed=bytes)
cpdef bytes encode_item(object item)
