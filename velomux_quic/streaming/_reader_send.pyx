# cython: language_level=3
"""The ``am_send`` slot of the compiled read's awaitable (:class:`AnchorRead`, written once
in ``reader.py``), which pure-mode Cython cannot declare; this module holds nothing else.

Through the slot (see ``_am_send.pxd``) a read ends with its item as a value rather than
a StopIteration. ``reader.py`` imports this module where the compiled path runs
(velomux_quic.recordpath's ``companion``), so the type has its slot before any read is
made.
"""

from cpython.object cimport PyObject

from velomux_quic.streaming._am_send cimport (
    PYGEN_ERROR,
    PYGEN_NEXT,
    PYGEN_RETURN,
    PySendResult,
    install_am_send,
)
from velomux_quic.streaming.reader cimport AnchorRead


ctypedef PyObject* (*_raw_step_fn)(PyObject*) noexcept


cdef object _step_of(object read):
    return (<AnchorRead>read)._step()


cdef _raw_step_fn _raw_step = <_raw_step_fn>_step_of
"""``_step_of`` as the C function it is: a new reference, or NULL with the error set (a
call Cython makes would handle that error instead of giving it back to the slot)."""


cdef PySendResult _read_send(PyObject* read, PyObject* arg, PyObject** result) noexcept:
    cdef PyObject* value = _raw_step(read)
    result[0] = value
    if value is NULL:
        return PYGEN_ERROR
    if (<AnchorRead>read)._done:
        return PYGEN_RETURN
    return PYGEN_NEXT


install_am_send(AnchorRead, _read_send)
