# cython: language_level=3
"""The hand-written compiled twin of the consumer's take (see velomux_quic.recordpath).

It twins ``StreamAnchor._take_items`` (the consumer's take of every item already buffered)
and ``StreamAnchor.__anext__`` (an awaitable instead of a coroutine per item). The rules are
the pure code's, line for line, with the same errors and counters; a rare path (a record
that is not an item) calls the same pure helpers. The rest of the streaming layer's record
path (the inbox, the frames, the sender) is compiled from its own modules instead. The
package's own modules are imported when first needed: this module is loaded while the pure
anchor module that selects it is still being defined.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from libc.string cimport memcmp

from velomux_quic.streaming.inbox cimport Inbox

cdef Py_ssize_t PREFIX_SIZE = 6
cdef bytes ITEM_PREFIX = b"\x81\xa4Item"

cdef object _frames = None


cdef object frames_module():
    global _frames
    if _frames is None:
        from velomux_quic.streaming import frames as module
        _frames = module
    return _frames


def StreamAnchor__take_items(self, list items, Py_ssize_t limit):
    """Twin of ``StreamAnchor._take_items``."""
    frames = frames_module()
    decode_frame = frames.decode_frame
    decode_error = frames.FrameDecodeError
    item_kind = frames.FrameKind.ITEM
    heartbeat_kind = frames.FrameKind.HEARTBEAT
    inbox = self._entry.inbox
    cdef Py_ssize_t room = limit - len(items)
    first = inbox.first_feed()
    if first is not None:
        sender_id, feed = first
        take_body = feed.take
        while room > 0:
            body = take_body()
            if body is None:
                break
            try:
                kind, value = decode_frame(body)
            except decode_error:
                inbox.push_front(sender_id, body)
                return
            if kind is item_kind:
                items.append(value)
                room -= 1
            elif kind is not heartbeat_kind:
                inbox.push_front(sender_id, body)
                return
        if not len(inbox):
            return
    take = inbox.take
    while room > 0:
        peek = take()
        if peek is None:
            return
        body = peek[1]
        try:
            kind, value = decode_frame(body)
        except decode_error:
            inbox.push_front(peek[0], body)
            return
        if kind is item_kind:
            items.append(value)
            room -= 1
        elif kind is not heartbeat_kind:
            inbox.push_front(peek[0], body)
            return


# -- anchor.py --------------------------------------------------------------------------


cdef object _anchor = None
cdef object _unpackb = None
cdef object _ITEM = None
cdef object _HEARTBEAT = None
cdef object _SENDER_ERROR = None
cdef object _DETACHED = None
cdef object _FINALIZED = None
cdef object _DROPPED = None


cdef int _bind_anchor() except -1:
    global _anchor, _unpackb, _ITEM, _HEARTBEAT, _SENDER_ERROR, _DETACHED, _FINALIZED, _DROPPED
    from velomux_quic.streaming import anchor as module

    frames = frames_module()
    kinds = frames.FrameKind
    _unpackb = frames._unpackb
    _ITEM = kinds.ITEM
    _HEARTBEAT = kinds.HEARTBEAT
    _SENDER_ERROR = kinds.SENDER_ERROR
    _DETACHED = kinds.DETACHED
    _FINALIZED = kinds.FINALIZED
    _DROPPED = kinds.DROPPED
    _anchor = module
    return 0


cdef inline bint _is_item(object body):
    return (
        type(body) is bytes
        and PyBytes_GET_SIZE(body) >= PREFIX_SIZE
        and memcmp(PyBytes_AS_STRING(body), PyBytes_AS_STRING(ITEM_PREFIX), PREFIX_SIZE) == 0
    )


def StreamAnchor___anext__(self):
    """Twin of ``StreamAnchor.__anext__``: an awaitable that reads the next item (see
    :class:`_AnchorNext`)."""
    if _anchor is None:
        _bind_anchor()
    cdef _AnchorNext step = _AnchorNext.__new__(_AnchorNext)
    step._anchor = self
    return step


@cython.final
@cython.freelist(16)
cdef class _AnchorNext:
    """The awaitable the compiled ``StreamAnchor.__anext__`` returns: the pure coroutine's
    loop, run by the awaiting task through the iterator protocol, as an asyncio future's
    ``__await__`` is.

    A coroutine per item costs a coroutine object, its closure and the wrapper its
    ``__await__`` returns, each allocated, set up and freed for every item a task reads;
    this object comes from a free list and is its own iterator. Its steps are the
    coroutine's: the reading flag is taken at the first step, an item ends the await
    (returned by the ``am_send`` slot below, or as ``StopIteration(item)`` by ``__next__``
    and ``send``), a sentinel raises what the coroutine raises, and while
    nothing is readable it yields the inbox's waiter future to the task. ``throw`` and
    ``close`` (a cancelled or closed awaiting coroutine) release the flag, as the
    coroutine's ``finally`` does. An item is decoded here (the ``Item`` prefix, then
    MessagePack), every other frame by the pure ``decode_frame``."""

    cdef object _anchor
    cdef bint _reading
    cdef bint _done

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        value = self._step()
        if self._done:
            raise StopIteration(value)
        return value

    def send(self, value):
        value = self._step()
        if self._done:
            raise StopIteration(value)
        return value

    def throw(self, typ, value=None, traceback=None):
        self._release()
        self._done = True
        if value is None:
            value = typ if isinstance(typ, BaseException) else typ()
        if traceback is not None:
            raise value.with_traceback(traceback)
        raise value

    def close(self):
        self._release()
        self._done = True

    cdef inline void _release(self) except *:
        if self._reading:
            self._reading = False
            self._anchor._reading = False

    cdef object _step(self):
        """One step of the read: the item (the await is over: ``_done`` is set) or the
        waiter future to yield (``_done`` is not); an error is raised as it is."""
        module = _anchor
        anchor = self._anchor
        if self._done:
            raise RuntimeError("cannot reuse an already awaited __anext__()")
        if not self._reading:
            if anchor._reading:
                self._done = True
                raise module.UsageError(module._ONE_READER)
            anchor._reading = True
            self._reading = True
        try:
            entry = anchor._entry
            inbox = entry.inbox
            compiled = type(inbox) is Inbox
            while True:
                taken = (<Inbox>inbox).take() if compiled else inbox.take()
                if taken is not None:
                    sender_id, body = taken
                    if _is_item(body):
                        try:
                            value = _unpackb(body[PREFIX_SIZE:], strict_map_key=False)
                        except Exception as exc:
                            error = frames_module()._item_error(exc)
                            error.__cause__ = exc
                            anchor._end("a record did not decode")
                            raise module.DeserializationError(str(error)) from error
                        self._finish()
                        return value
                    try:
                        kind, value = frames_module().decode_frame(body)
                    except module.FrameDecodeError as exc:
                        anchor._end("a record did not decode")
                        raise module.DeserializationError(str(exc)) from exc
                    if kind is _ITEM:
                        self._finish()
                        return value
                    if kind is _HEARTBEAT:
                        continue
                    if kind is _SENDER_ERROR:
                        raise module.SenderError(str(value))
                    if kind is _DETACHED:
                        anchor._owner.sender_detached(entry.local_id, sender_id)
                        continue
                    if kind is _FINALIZED:
                        anchor._end("finished")
                        raise StopAsyncIteration
                    if kind is _DROPPED:
                        anchor._end("the producer went away")
                        raise module.SenderDropped(
                            "the producer went away without finishing the stream"
                        )
                    shutdown = module.shutdown_message(value)
                    if shutdown is not None:
                        anchor._end("the producer shut down")
                        raise module.SenderDropped(shutdown)
                    anchor._end("a transport error")
                    raise module.StreamTransportError(str(value))
                if compiled:
                    if (<Inbox>inbox).any_feed_exhausted() and anchor._owner.feed_exhausted(
                        entry, 0
                    ):
                        continue
                elif inbox.any_feed_exhausted() and anchor._owner.feed_exhausted(entry, 0):
                    continue
                if entry.finished:
                    anchor._ended_finished()
                waiter = (<Inbox>inbox).wait() if compiled else inbox.wait()
                waiter._asyncio_future_blocking = True
                return waiter
        except BaseException:
            self._finish()
            raise

    cdef inline void _finish(self) except *:
        self._release()
        self._done = True


# -- the awaitable's send slot -----------------------------------------------------------
#
# An awaiting coroutine resumes an awaitable that is not a coroutine through the
# interpreter's PyIter_Send, which calls the type's ``am_send`` slot where it has one, and
# otherwise ``__next__``, whose return value is a StopIteration: an exception object, and
# a traceback entry for each compiled function it passes, for every item read. The slot
# returns the item as a value instead. An interpreter that does not call the slot (a
# newer one, or one tracing) still reads ``__next__``, with the same results.

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


cdef object _step_of(object step):
    return (<_AnchorNext>step)._step()


cdef _raw_step_fn _raw_step = <_raw_step_fn>_step_of
"""``_step_of`` as the C function it is: a new reference, or NULL with the error set (a
call Cython makes would handle that error instead of giving it back to the slot)."""


cdef PySendResult _anchor_next_send(PyObject* step, PyObject* arg, PyObject** result) noexcept:
    cdef PyObject* value = _raw_step(step)
    result[0] = value
    if value is NULL:
        return PYGEN_ERROR
    if (<_AnchorNext>step)._done:
        return PYGEN_RETURN
    return PYGEN_NEXT


cdef _TypeWithAsync* _anchor_next_type = <_TypeWithAsync*>_AnchorNext
if _anchor_next_type.tp_as_async is not NULL:
    _anchor_next_type.tp_as_async.am_send = _anchor_next_send
