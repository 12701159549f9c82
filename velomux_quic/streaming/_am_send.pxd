# cython: language_level=3
"""The interpreter's ``am_send`` type slot, which the record path's companion extensions
(``_reader_send.pyx``, ``_sender_send.pyx``) fill for the compiled awaitables of the read
and the send.

An awaiting coroutine resumes an awaitable that is not a coroutine through the
interpreter's ``PyIter_Send``, which calls the type's ``am_send`` slot where it has one,
and otherwise ``__next__``, which ends the await with a StopIteration: an exception object,
and a traceback entry for each compiled function it passes, for every await. The slot
returns the awaitable's result as a value instead. An interpreter that does not call the
slot (a newer one, or one tracing) still steps ``__next__``, with the same results.
"""

from cpython.object cimport PyObject


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


cdef inline void install_am_send(type awaitable, sendfunc slot) noexcept:
    """Give ``awaitable`` (a compiled type with ``__await__``, so with async methods)
    ``slot`` as its ``am_send``."""
    cdef _TypeWithAsync* as_type = <_TypeWithAsync*>awaitable
    if as_type.tp_as_async is not NULL:
        as_type.tp_as_async.am_send = slot
