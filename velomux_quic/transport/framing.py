"""Length-prefixed frame codec for QUIC lane streams (sans-IO).

A lane stream is a sequence of frames, each ``[u32 big-endian length][body]``.
QUIC delivers a stream as arbitrary chunks: one data event may carry a fraction
of a frame, or hundreds of small frames, or the tail of one frame and the head
of the next. :class:`FrameDecoder` turns those chunks back into frame bodies,
and the ``encode_*`` functions produce the wire form.

Nothing here touches a socket or an event loop, so the codec is tested by
feeding it bytes directly, and the transport owns every decision about what to
do with a protocol error (it closes the connection).

The decoder sits on the hot path: it runs for every stream data event, and most
frames are small (tens to a few thousand bytes). It therefore parses with
``struct.unpack_from`` at an offset into the chunk it was given, slicing each
body out once, and keeps only the unparsed tail between calls. No buffer is ever
re-sliced per frame, so the cost of a chunk is linear in its size however many
frames it holds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final, NoReturn

from ..errors import FrameTooLarge, FramingError

__all__ = [
    "FRAME_HEADER_SIZE",
    "MAX_FRAME_LENGTH",
    "BytesLike",
    "FrameDecoder",
    "FrameTooLarge",
    "FramingError",
    "encode_frame",
    "encode_frames",
    "frame_header",
]

BytesLike = bytes | bytearray | memoryview
"""What the encoders accept as a body, and the decoder as input."""

_HEADER: Final = struct.Struct(">I")
_pack_header: Final = _HEADER.pack
_unpack_header_from: Final = _HEADER.unpack_from

FRAME_HEADER_SIZE: Final = _HEADER.size
"""Bytes in a frame header: the body length as a big-endian u32."""

MAX_FRAME_LENGTH: Final = 0xFFFF_FFFF
"""The largest body length a header can state."""


def _body_length(body: BytesLike) -> int:
    # len() of a memoryview counts items, not bytes, once it has been cast to a
    # wider format; the header must state bytes.
    return body.nbytes if isinstance(body, memoryview) else len(body)


def frame_header(length: int) -> bytes:
    """The 4-byte header announcing a body of ``length`` bytes.

    For callers that write the header and the body separately (for example to
    avoid copying a large body). Raises ``ValueError`` for a negative length
    and :class:`FrameTooLarge` for one a u32 cannot state.
    """
    if length < 0:
        raise ValueError(f"a frame length cannot be negative, got {length}")
    if length > MAX_FRAME_LENGTH:
        raise FrameTooLarge(length, MAX_FRAME_LENGTH)
    return _pack_header(length)


def encode_frame(body: BytesLike) -> bytes:
    """One frame: header and body as a single ``bytes``."""
    length = _body_length(body)
    if length > MAX_FRAME_LENGTH:
        raise FrameTooLarge(length, MAX_FRAME_LENGTH)
    return b"".join((_pack_header(length), body))


def encode_frames(bodies: Iterable[BytesLike]) -> bytes:
    """Several frames back to back, built with a single join.

    Cheaper than concatenating :func:`encode_frame` results when a batch of
    records is written to a stream at once: each body is copied exactly once.
    """
    parts: list[BytesLike] = []
    append = parts.append
    for body in bodies:
        length = _body_length(body)
        if length > MAX_FRAME_LENGTH:
            raise FrameTooLarge(length, MAX_FRAME_LENGTH)
        append(_pack_header(length))
        append(body)
    return b"".join(parts)


class FrameDecoder:
    """Incremental decoder for one stream: feed it chunks, get whole frame bodies.

    The decoder holds at most one incomplete frame between calls: either up to
    three bytes of a header, or a parsed header and the body bytes received so
    far. A large body arriving in many chunks is collected as a list of pieces
    and joined once when its last byte arrives, so its cost stays linear.

    Every header is checked against ``max_message_size`` as soon as its four
    bytes are available, before any of its body is buffered. The length field
    is peer-controlled: checking it first means a peer cannot make us hold up
    to 4 GiB per stream by announcing a huge frame and trickling its body. An
    oversized header raises :class:`FrameTooLarge`; the decoder is then
    poisoned, since the stream position after a refused header is meaningless,
    and any further :meth:`feed` raises :class:`FramingError`. Frames that
    preceded the bad header in the same chunk travel on the exception
    (``FrameTooLarge.frames``), so the caller can deliver them and then close.
    """

    __slots__ = ("_error", "_head", "_length", "_max", "_need", "_parts")

    _max: int
    _head: bytes
    _parts: list[bytes]
    _length: int
    _need: int
    _error: FramingError | None

    def __init__(self, max_message_size: int) -> None:
        if max_message_size < 0:
            raise ValueError(f"max_message_size cannot be negative, got {max_message_size}")
        self._max = max_message_size
        # Up to FRAME_HEADER_SIZE - 1 bytes of a header not yet complete.
        self._head = b""
        # Body of the frame in progress: pieces received, its length, and the
        # bytes still missing. _need > 0 exactly when a body is in progress.
        self._parts = []
        self._length = 0
        self._need = 0
        self._error = None

    @property
    def max_message_size(self) -> int:
        """The largest body length accepted."""
        return self._max

    @property
    def buffered_bytes(self) -> int:
        """Bytes received of the incomplete frame, header included (0 at a frame boundary).

        Always equals the bytes fed minus the bytes of the frames returned, so a
        stream that ends with this non-zero was cut off mid-frame.
        """
        if self._need:
            return FRAME_HEADER_SIZE + self._length - self._need
        return len(self._head)

    def feed(self, data: BytesLike) -> list[bytes]:
        """Consume the next chunk of the stream; return every body it completes.

        Returns an empty list when ``data`` completes no frame. Bodies are
        ``bytes`` in stream order. Raises :class:`FrameTooLarge` on a header
        over the limit and :class:`FramingError` if the decoder already failed.
        """
        if self._error is not None:
            raise FramingError("the frame decoder already failed") from self._error
        if not isinstance(data, bytes):
            # Bodies are returned as slices of data; they must be immutable
            # copies, never views into a buffer the caller may reuse.
            data = bytes(data)
        out: list[bytes] = []
        n = len(data)
        if not n:
            return out
        pos = 0

        if self._need:
            # Continue the body in progress.
            need = self._need
            if n < need:
                self._parts.append(data)
                self._need = need - n
                return out
            parts = self._parts
            parts.append(data[:need])
            out.append(b"".join(parts))
            self._parts = []
            self._need = 0
            pos = need
        elif self._head:
            # Complete the header split by the previous chunk. It is at most
            # four bytes, so the concatenation costs nothing that matters.
            head = self._head
            take = FRAME_HEADER_SIZE - len(head)
            if n < take:
                self._head = head + data
                return out
            self._head = b""
            (length,) = _unpack_header_from(head + data[:take])
            if length > self._max:
                self._fail(length, out)
            pos = take + length
            if pos > n:
                self._start_body(data[take:], length, pos - n)
                return out
            out.append(data[take:pos])

        # Fast path: parse frames in place at an offset into data.
        unpack_from = _unpack_header_from
        limit = self._max
        append = out.append
        last_header = n - FRAME_HEADER_SIZE
        while pos <= last_header:
            (length,) = unpack_from(data, pos)
            if length > limit:
                self._fail(length, out)
            start = pos + FRAME_HEADER_SIZE
            pos = start + length
            if pos > n:
                self._start_body(data[start:], length, pos - n)
                return out
            append(data[start:pos])
        if pos < n:
            self._head = data[pos:]
        return out

    def _start_body(self, first: bytes, length: int, need: int) -> None:
        self._parts = [first]
        self._length = length
        self._need = need

    def _fail(self, length: int, completed: list[bytes]) -> NoReturn:
        # Nothing is held here: the header just refused was the first bytes of
        # a new frame, so any earlier partial frame has already been cleared.
        error = FrameTooLarge(length, self._max, completed)
        self._error = error
        raise error
