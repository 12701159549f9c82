"""``StreamFrame``: the body of every record a producer sends to an anchor (sans-IO).

A stream carries seven kinds of frame: data (``Item``), a soft producer error
(``SenderError``), liveness (``Heartbeat``) and the four ways a stream ends
(``Finalized``, ``Detached``, ``Dropped``, ``TransportError``). The encoding is
MessagePack in the shape ``rmp_serde`` gives an externally tagged enum, so a
frame is the same bytes whichever implementation wrote it::

    Heartbeat | Finalized | Detached | Dropped     the bare string, e.g. a7 "Dropped"
    Item(v) | SenderError(s) | TransportError(s)   a one-entry map, e.g. 81 a4 "Item" <v>

Three things sit on the per-token path and are shaped for it.
:func:`encode_item` writes a constant prefix and packs only the payload, with a
pooled ``msgpack.Packer`` rather than ``msgpack.packb``, which builds a new
packer per call (a measurable share of a token's cost: see docs/performance.md).
:func:`is_terminal_sentinel`, which egress asks of every record to decide
whether a slot closes, answers from the encoded bytes: an ``Item`` is
recognised by its six-byte prefix and the unit sentinels by comparison with
their cached encodings, so only the rare error frames are decoded.
:func:`decode_frame` takes the same two shortcuts before a full decode.

The shortcuts never change an answer. A frame written some other legal way (a
``str8`` "Dropped", a ``map16`` header) goes to the full decode and gets the
same answer a canonical one would: ``is_terminal_sentinel(b)`` is true exactly
when ``decode_frame(b)`` succeeds with a terminal kind. An ``Item`` whose
payload happens to be the bytes or the string of a sentinel is data, because
its bytes start with the ``Item`` prefix.

Frames come from peers, so :func:`decode_frame` reports every defect as
:class:`FrameDecodeError` and nothing else: the consumer ends the anchor with a
deserialization error on that one exception without hiding its own bugs.

Every record passes through here, so this module is one of the record path's compiled
modules (velomux_quic.recordpath): where built, this same file is compiled, with the C
declarations of ``frames.pxd``; otherwise it runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Final

import msgpack  # type: ignore[import-untyped]

try:
    import cython  # type: ignore[import-not-found, unused-ignore]
except ModuleNotFoundError:  # run as source, where Cython (needed only to build) is absent
    from ..recordpath import shadow as cython  # type: ignore[no-redef, unused-ignore]

from ..errors import FrameDecodeError, SerializationError

__all__ = [
    "DETACHED",
    "DROPPED",
    "FINALIZED",
    "HEARTBEAT",
    "ITEM_PREFIX",
    "PACKER_BUFFER",
    "POOL_MAX",
    "SHUTDOWN",
    "SHUTDOWN_CODE",
    "TERMINAL_KINDS",
    "FrameDecodeError",
    "FrameKind",
    "ItemPacker",
    "SerializationError",
    "decode_frame",
    "encode_item",
    "encode_items",
    "encode_sender_error",
    "encode_transport_error",
    "is_heartbeat",
    "is_terminal_sentinel",
    "item_frame",
    "pooled_packers",
    "shutdown_message",
]


class FrameKind(IntEnum):
    """The seven ``StreamFrame`` variants, numbered in their declaration order."""

    ITEM = 0
    SENDER_ERROR = 1
    HEARTBEAT = 2
    FINALIZED = 3
    DETACHED = 4
    DROPPED = 5
    TRANSPORT_ERROR = 6


TERMINAL_KINDS: Final = frozenset(
    {FrameKind.FINALIZED, FrameKind.DETACHED, FrameKind.DROPPED, FrameKind.TRANSPORT_ERROR}
)
"""Kinds that end a slot's stream: the slot spends its reserved credit on one and closes."""


_packb: Final = msgpack.packb
_unpackb: Final = msgpack.unpackb
_Packer: Final = msgpack.Packer

ITEM_PREFIX: Final = b"\x81\xa4Item"
"""A one-entry map header and the key ``"Item"``: the first six bytes of every data frame."""

_SENDER_ERROR_PREFIX: Final = _packb({"SenderError": ""})[:-1]
_TRANSPORT_ERROR_PREFIX: Final = _packb({"TransportError": ""})[:-1]

HEARTBEAT: Final[bytes] = _packb("Heartbeat")
FINALIZED: Final[bytes] = _packb("Finalized")
DETACHED: Final[bytes] = _packb("Detached")
DROPPED: Final[bytes] = _packb("Dropped")

_UNIT_BY_NAME: Final = {
    "Heartbeat": FrameKind.HEARTBEAT,
    "Finalized": FrameKind.FINALIZED,
    "Detached": FrameKind.DETACHED,
    "Dropped": FrameKind.DROPPED,
}
_DATA_BY_NAME: Final = {
    "Item": FrameKind.ITEM,
    "SenderError": FrameKind.SENDER_ERROR,
    "TransportError": FrameKind.TRANSPORT_ERROR,
}
# Decoded results of the canonical unit encodings, shared so a heartbeat costs a lookup.
_UNIT_RESULTS: Final[dict[bytes, tuple[FrameKind, object]]] = {
    HEARTBEAT: (FrameKind.HEARTBEAT, None),
    FINALIZED: (FrameKind.FINALIZED, None),
    DETACHED: (FrameKind.DETACHED, None),
    DROPPED: (FrameKind.DROPPED, None),
}
_UNIT_TERMINAL: Final = {body: kind in TERMINAL_KINDS for body, (kind, _) in _UNIT_RESULTS.items()}
# Reading an enum member off its class costs a descriptor call in Python 3.11, and
# hashing one calls Enum.__hash__; the hot paths use these plain references instead.
_ITEM: Final = FrameKind.ITEM
_HEARTBEAT_KIND: Final = FrameKind.HEARTBEAT
_IS_TERMINAL: Final = tuple(kind in TERMINAL_KINDS for kind in FrameKind)
_MAX_UNIT_SIZE: Final = max(map(len, _UNIT_RESULTS))
_PREFIX_SIZE: Final = len(ITEM_PREFIX)
# A memoryview compares equal to bytes with the same content; typeshed does not say so.
_ITEM_PREFIX_OBJ: Final[object] = ITEM_PREFIX

# Idle packers for encode_item. Taking one with pop() and giving it back with
# append() are single C calls, so two threads never share a packer, and a call
# that re-enters encode_item while packing (a finalizer, a dict subclass whose
# items() sends) finds the pool empty and packs with a fresh one instead of
# resetting the buffer under the outer call. A packer keeps its buffer at the
# largest size it ever grew to, so one that packed more than its initial buffer
# is dropped rather than pooled, and the pool holds at most a few. The pool holds
# each packer's bound ``pack``, the one method a token needs: calling ``packer.pack``
# looked the method up by name on every token.
PACKER_BUFFER: Final = 256 << 10
POOL_MAX: Final = 16
# The two again, as C integers where this module is compiled (frames.pxd): encode_item
# compares a record's size with them once per record.
_packer_buffer: Final = PACKER_BUFFER
_pool_max: Final = POOL_MAX
_packer_pool: Final[list[Callable[[object], bytes]]] = [_Packer(buf_size=PACKER_BUFFER).pack]


# Where compiled, a frame of up to this many payload bytes is joined behind a copy of the
# prefix in this buffer and made from it with one allocation and one copy (item_frame).
_FRAME_SCRATCH_PAYLOAD: Final = 4096
_frame_scratch: Final = bytearray(ITEM_PREFIX) + bytearray(_FRAME_SCRATCH_PAYLOAD)
_frame_scratch_payload: Final = _FRAME_SCRATCH_PAYLOAD


def item_frame(packed: bytes) -> bytes:
    """The ``Item`` frame of a payload MessagePack packed: ``ITEM_PREFIX + packed``.

    Compiled, a payload that fits the scratch buffer is copied behind the prefix already
    there and the frame is made from the buffer: bytes' own concatenation asks each side
    for its buffer and copies twice, which on a token's few bytes cost more than the copy.
    No Python code runs between the copy and the frame's making, so no other call (another
    thread's, a finalizer's) writes the buffer in between."""
    if cython.compiled:
        size = len(packed)
        if size <= _frame_scratch_payload:
            at = _frame_scratch  # compiled: a pointer to the buffer, which starts with the prefix
            source = packed  # compiled: a pointer to the payload's bytes
            # A local: a write through a byte pointer may alias a global, which the compiler
            # would then read again on every byte instead of copying the bytes in blocks.
            offset = _PREFIX_SIZE
            for index in range(size):
                at[offset + index] = source[index]
            # compiled: a slice of a pointer, so bytes (the type checker sees the buffer's)
            return at[: offset + size]  # type: ignore[return-value]
    return ITEM_PREFIX + packed


def pooled_packers() -> int:
    """How many idle packers the pool keeps now (at most :data:`POOL_MAX`): a packer that
    grew past :data:`PACKER_BUFFER` is dropped, not pooled, so the count shows it."""
    return len(_packer_pool)


def _serialization_error(item: object, exc: Exception) -> SerializationError:
    return SerializationError(f"cannot encode a {type(item).__name__} item as MessagePack: {exc}")


class ItemPacker:
    """One pooled packer held for a run of items (a forward pass), for a caller that
    encodes inline: ``item_frame(packer.pack(item))`` is :func:`encode_item` without the
    pool round trip per item (a measurable share of a small token's encode).

    After a failed ``pack`` call :meth:`failed`: it returns the :class:`SerializationError`
    to report and swaps in a fresh packer (a failed one is never pooled). :meth:`release`
    gives the packer back at the end of the run, unless it grew past :data:`PACKER_BUFFER`.
    """

    __slots__ = ("pack",)

    def __init__(self) -> None:
        self.pack: Callable[[object], bytes]
        try:
            self.pack = _packer_pool.pop()
        except IndexError:
            self.pack = _Packer(buf_size=PACKER_BUFFER).pack

    def failed(self, item: object, exc: Exception) -> SerializationError:
        self.pack = _Packer(buf_size=PACKER_BUFFER).pack
        return _serialization_error(item, exc)

    def release(self, grew: bool) -> None:
        """Back to the pool; ``grew``: some item packed to more than PACKER_BUFFER bytes."""
        if not grew and len(_packer_pool) < POOL_MAX:
            _packer_pool.append(self.pack)


def encode_item(item: object) -> bytes:
    """The ``Item`` frame of ``item``: :data:`ITEM_PREFIX` followed by ``item`` in MessagePack.

    The same bytes as ``ITEM_PREFIX + msgpack.packb(item)``. Raises
    :class:`SerializationError` for a value MessagePack cannot hold (an unknown
    type, an integer outside [-2**63, 2**64), a string with lone surrogates,
    nesting past the packer's limit).
    """
    pool = _packer_pool
    try:
        pack = pool.pop()
    except IndexError:
        pack = _Packer(buf_size=PACKER_BUFFER).pack
    try:
        packed: bytes = pack(item)
    except (TypeError, ValueError, OverflowError) as exc:
        # The failed packer is not returned: a fresh one costs little on this rare path.
        raise _serialization_error(item, exc) from exc
    if len(packed) <= _packer_buffer and len(pool) < _pool_max:
        pool.append(pack)
    if cython.compiled:
        return item_frame(packed)
    return ITEM_PREFIX + packed  # interpreted, a call to item_frame would cost more


def encode_items(items: Iterable[object]) -> list[bytes]:
    """``[encode_item(item) for item in items]``, taking a packer from the pool once per batch.

    One packer for the batch saves the pool round trip per item, which is a visible
    share of a small token's encode. Raises :class:`SerializationError` on the first
    item that cannot be encoded.
    """
    pool = _packer_pool
    try:
        pack = pool.pop()
    except IndexError:
        pack = _Packer(buf_size=PACKER_BUFFER).pack
    out: list[bytes] = []
    append = out.append
    compiled = cython.compiled  # read once: interpreted, it is a lookup on a module
    prefix = ITEM_PREFIX
    grew = False
    for item in items:
        try:
            packed: bytes = pack(item)
        except (TypeError, ValueError, OverflowError) as exc:
            raise _serialization_error(item, exc) from exc
        if len(packed) > PACKER_BUFFER:
            grew = True
        append(item_frame(packed) if compiled else prefix + packed)
    if not grew and len(pool) < POOL_MAX:
        pool.append(pack)
    return out


def _encode_message(prefix: bytes, message: str, what: str) -> bytes:
    if not isinstance(message, str):
        raise TypeError(f"a {what} message must be a str, got {type(message).__name__}")
    try:
        encoded = message.encode()
    except UnicodeEncodeError:
        # Lone surrogates (from surrogateescape'd OS text, say) have no UTF-8 form. The
        # message only describes a failure; losing a character beats losing the report.
        encoded = message.encode(errors="replace")
    packed: bytes = _packb(encoded.decode())
    return prefix + packed


def encode_sender_error(message: str) -> bytes:
    """A ``SenderError`` frame: a soft producer error the consumer sees and may read past."""
    return _encode_message(_SENDER_ERROR_PREFIX, message, "SenderError")


def encode_transport_error(message: str) -> bytes:
    """A ``TransportError`` frame: an unrecoverable delivery failure that ends the stream."""
    return _encode_message(_TRANSPORT_ERROR_PREFIX, message, "TransportError")


SHUTDOWN_CODE: Final = "producer_shutdown"
"""The code a ``TransportError`` frame's message starts with when the producer's node closed
under the stream: the consumer raises SenderDropped with the message, not a delivery error.
A peer that does not know the code shows the same words as a StreamTransportError."""

SHUTDOWN: Final[bytes] = encode_transport_error(
    f"{SHUTDOWN_CODE}: the producer's node shut down before the stream finished"
)
"""The terminal a closing node sends on each of its streams that was not finished."""


def shutdown_message(value: object) -> str | None:
    """The words of a ``TransportError`` value that says the producer shut down, else None."""
    if isinstance(value, str) and value.startswith(SHUTDOWN_CODE + ": "):
        return value[len(SHUTDOWN_CODE) + 2 :]
    return None


def _map_entries(body: bytes) -> int:
    """The entry count in the header of the map that ``body`` starts with, or -1."""
    first = body[0]
    if 0x80 <= first <= 0x8F:
        return first & 0x0F
    if first == 0xDE:
        return int.from_bytes(body[1:3], "big")
    if first == 0xDF:
        return int.from_bytes(body[1:5], "big")
    return -1


def _decode_generic(body: bytes) -> tuple[FrameKind, object]:
    try:
        frame = _unpackb(body, strict_map_key=False)
    except Exception as exc:
        # msgpack raises a family of types (ExtraData, OutOfData, StackError,
        # FormatError, ValueError, TypeError for an unhashable key, ...) that
        # differs between its C and Python builds; all are a malformed frame.
        raise FrameDecodeError(f"frame is not one MessagePack value: {exc}") from exc
    if type(frame) is str:
        kind = _UNIT_BY_NAME.get(frame)
        if kind is None:
            raise FrameDecodeError(f"unknown frame variant {frame[:64]!r}")
        return kind, None
    if type(frame) is not dict:
        raise FrameDecodeError(f"a frame is a string or a map, not a {type(frame).__name__}")
    # The decoded dict keeps one entry per distinct key; the header tells how many were sent.
    if len(frame) != 1 or _map_entries(body) != 1:
        raise FrameDecodeError(f"a data frame is a one-entry map, got {_map_entries(body)} entries")
    ((key, value),) = frame.items()
    kind = _DATA_BY_NAME.get(key) if type(key) is str else None
    if kind is None:
        raise FrameDecodeError(f"unknown frame variant {str(key)[:64]!r}")
    if kind is not _ITEM and type(value) is not str:
        raise FrameDecodeError(f"a {key} message must be a str, not a {type(value).__name__}")
    return kind, value


def _view(body: object) -> memoryview:
    """A flat byte view of a bytes-like ``body``, for the rare caller that passes a non-bytes."""
    try:
        return memoryview(body).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise FrameDecodeError(f"a frame body is bytes-like, not {type(body).__name__}") from exc


def _item_error(exc: Exception) -> FrameDecodeError:
    # See _decode_generic: every failure to parse peer input is the peer's defect.
    return FrameDecodeError(f"Item payload is not one MessagePack value: {exc}")


def decode_frame(body: bytes | bytearray | memoryview) -> tuple[FrameKind, object]:
    """Decode one frame body into its kind and value.

    The value is the item for ``ITEM``, the message (a ``str``) for
    ``SENDER_ERROR`` and ``TRANSPORT_ERROR``, and ``None`` otherwise. Item maps
    may have non-string keys, as a Rust ``HashMap<u32, _>`` encodes them. A
    ``memoryview`` item payload is decoded in place, not copied. Raises
    :class:`FrameDecodeError`, and only that, for anything that is not exactly
    one well-formed frame, trailing bytes included.
    """
    if type(body) is bytes:
        if body.startswith(ITEM_PREFIX):
            try:
                return _ITEM, _unpackb(body[_PREFIX_SIZE:], strict_map_key=False)
            except Exception as exc:
                raise _item_error(exc) from exc
    else:
        view = _view(body)
        if view[:_PREFIX_SIZE] == _ITEM_PREFIX_OBJ:
            try:
                return _ITEM, _unpackb(view[_PREFIX_SIZE:], strict_map_key=False)
            except Exception as exc:
                raise _item_error(exc) from exc
        body = bytes(view)
    if len(body) <= _MAX_UNIT_SIZE:
        unit = _UNIT_RESULTS.get(body)
        if unit is not None:
            return unit
        if not body:
            raise FrameDecodeError("empty frame body")
    return _decode_generic(body)


def _non_item(body: bytes | bytearray | memoryview) -> bytes | None:
    """``body`` as bytes, or None when it is an Item (never a sentinel) or unreadable."""
    if type(body) is not bytes:
        try:
            view = _view(body)
        except FrameDecodeError:
            return None
        if view[:_PREFIX_SIZE] == _ITEM_PREFIX_OBJ:
            return None
        return bytes(view)
    return None if body.startswith(ITEM_PREFIX) else body


def is_terminal_sentinel(body: bytes | bytearray | memoryview) -> bool:
    """Whether ``body`` is a ``Finalized``, ``Detached``, ``Dropped`` or ``TransportError`` frame.

    Egress asks this of every record, so it answers from the bytes: data frames
    by their prefix, unit frames by their cached encodings, and decodes only
    what is left (error frames and non-canonical encodings). Never raises: a
    malformed body is not a terminal; the receiver's decode rejects it instead.
    """
    data = _non_item(body)
    if data is None:
        return False
    if len(data) <= _MAX_UNIT_SIZE:
        known = _UNIT_TERMINAL.get(data)
        if known is not None:
            return known
    try:
        return _IS_TERMINAL[_decode_generic(data)[0]]
    except FrameDecodeError:
        return False


def is_heartbeat(body: bytes | bytearray | memoryview) -> bool:
    """Whether ``body`` is a ``Heartbeat`` frame, which the consumer filters out unseen.

    Same shortcuts and the same never-raises rule as :func:`is_terminal_sentinel`.
    """
    data = _non_item(body)
    if data is None:
        return False
    if data == HEARTBEAT:
        return True
    if len(data) <= _MAX_UNIT_SIZE and data in _UNIT_RESULTS:
        return False
    try:
        return _decode_generic(data)[0] is _HEARTBEAT_KIND
    except FrameDecodeError:
        return False
