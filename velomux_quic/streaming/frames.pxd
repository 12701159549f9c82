# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.streaming.frames` where it is compiled (see
velomux_quic.recordpath): the per-record encode, callable from C by the modules that
cimport it."""

cimport cython

# A frame being made, written in place; a payload's bytes, read in place.
ctypedef unsigned char* frame_buffer
ctypedef const unsigned char* payload_bytes

cdef Py_ssize_t _packer_buffer
cdef Py_ssize_t _pool_max
cdef Py_ssize_t _PREFIX_SIZE
cdef bytearray _frame_scratch
cdef Py_ssize_t _frame_scratch_payload


@cython.locals(
    size=Py_ssize_t, at=frame_buffer, source=payload_bytes, offset=Py_ssize_t, index=Py_ssize_t
)
cpdef bytes item_frame(bytes packed)


@cython.locals(pool=list, packed=bytes)
cpdef bytes encode_item(object item)
