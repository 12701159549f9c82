# cython: language_level=3
"""The compiled twin of the streaming layer's per-record loops (see velomux_quic.recordpath).

It twins ``sender._stage_pass`` (a whole forward pass staged without waiting, the loop of
``send_pass``) and ``StreamAnchor._take_items`` (the consumer's take of every item already
buffered). The rules are the pure code's, line for line, with the same errors and counters;
a rare path (a failed pack, a closed stream, a record that is not an item) calls the same
pure helpers. The package's own modules are imported when first needed: this module is
loaded while the pure modules that select it are still being defined.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

cdef Py_ssize_t PREFIX_SIZE = 6
cdef bytes ITEM_PREFIX = b"\x81\xa4Item"

cdef object _sender = None
cdef object _frames = None


cdef object sender_module():
    global _sender
    if _sender is None:
        from velomux_quic.streaming import sender as module
        _sender = module
    return _sender


cdef object frames_module():
    global _frames
    if _frames is None:
        from velomux_quic.streaming import frames as module
        _frames = module
    return _frames


cdef inline bytes _item_frame(bytes packed):
    """``ITEM_PREFIX + packed`` in one allocation."""
    cdef Py_ssize_t size = PyBytes_GET_SIZE(packed)
    cdef bytes frame = PyBytes_FromStringAndSize(NULL, PREFIX_SIZE + size)
    cdef char* at = PyBytes_AS_STRING(frame)
    memcpy(at, PyBytes_AS_STRING(ITEM_PREFIX), PREFIX_SIZE)
    memcpy(at + PREFIX_SIZE, PyBytes_AS_STRING(packed), size)
    return frame


def _stage_pass(pairs, dict failed, list left):
    """Twin of ``velomux_quic.streaming.sender._stage_pass``."""
    module = sender_module()
    frames = frames_module()
    cdef Py_ssize_t packer_buffer = frames.PACKER_BUFFER
    cdef set blocked = set()
    cdef Py_ssize_t taken = 0
    cdef Py_ssize_t index = -1
    cdef bint grew = False
    packer = frames.ItemPacker()
    pack = packer.pack
    try:
        for pair in pairs:
            index += 1
            sender, item = pair
            state = sender._state
            if state.terminal_sent:
                failed[index] = module._closed_error(state)
                continue
            try:
                packed = pack(item)
            except (TypeError, ValueError, OverflowError) as exc:
                failed[index] = packer.failed(item, exc)
                pack = packer.pack
                continue
            if type(packed) is bytes:
                if PyBytes_GET_SIZE(packed) > packer_buffer:
                    grew = True
                body = _item_frame(<bytes>packed)
            else:
                if len(packed) > packer_buffer:
                    grew = True
                body = ITEM_PREFIX + packed
            if blocked and id(state) in blocked:
                left.append((index, state, body))
                state.metrics.producer_send_backpressure += 1
                continue
            channel = state.channel
            if channel.try_send(body):
                taken += 1
                continue
            if channel.closed:
                failed[index] = module.ChannelClosed("the stream's channel is closed")
                continue
            blocked.add(id(state))
            left.append((index, state, body))
            state.metrics.producer_send_backpressure += 1
    finally:
        packer.release(grew)
    return taken


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
