# cython: language_level=3
"""The ``am_send`` slot of the compiled send's done awaitable (:class:`SendDone`, written
once in ``sender.py``), which pure-mode Cython cannot declare; this module holds nothing
else.

Through the slot (see ``_am_send.pxd``) an await of a send that took its item at once ends
with None as a value rather than a StopIteration. ``sender.py`` imports this module where
the compiled path runs (velomux_quic.recordpath's ``companion``), so the type has its slot
before any send is made.
"""

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF

from velomux_quic.streaming._am_send cimport PYGEN_RETURN, PySendResult, install_am_send
from velomux_quic.streaming.sender cimport SendDone


cdef PySendResult _done_send(PyObject* done, PyObject* arg, PyObject** result) noexcept:
    cdef PyObject* none = <PyObject*>None
    Py_INCREF(None)
    result[0] = none
    return PYGEN_RETURN


install_am_send(SendDone, _done_send)
