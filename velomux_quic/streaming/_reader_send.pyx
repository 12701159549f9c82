# cython: language_level=3
"""The ``am_send`` slot of the compiled read's awaitable (:class:`AnchorRead`, written once
in ``reader.py``), which pure-mode Cython cannot declare; this module holds nothing else.

An awaiting coroutine resumes an awaitable that is not a coroutine through the
interpreter's ``PyIter_Send``, which calls the type's ``am_send`` slot where it has one,
and otherwise ``__next__``, which ends the await with a StopIteration: an exception object,
and a traceback entry for each compiled function it passes, for every item read. The slot
returns the item as a value instead. An interpreter that does not call the slot (a newer
one, or one tracing) still steps ``__next__``, with the same results.

``reader.py`` imports this module where the compiled path runs (velomux_quic.recordpath's
``companion``), so the type has its slot before any read is made.
"""

from cpython.object cimport PyObject

from velomux_quic.streaming.reader cimport AnchorRead


cdef extern from "Python.h":
    ctypedef enum PySendResult:
        PYGEN_RETURN
        PYGEN_ERROR
        PYGEN_NEXT
    ctypedef PySendResult (*sendfunc)(PyObject*, PyObject*, PyObject**)
    ctypedef struct PyAsyncMethods:
        sendfunc am_send
    ctypedef struct _TypeWithAsync "PyTypeObject":
        PyAsyncMethods* tp_as_async


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


cdef _TypeWithAsync* _read_type = <_TypeWithAsync*>AnchorRead
if _read_type.tp_as_async is not NULL:
    _read_type.tp_as_async.am_send = _read_send
