"""Records of the mux wire codec: what a record's type byte and control body mean (sans-IO).

This module owns the contents of a record, apart from how records are framed into a
batch: the ``record_type`` byte (:class:`RecordType`) and the enums control bodies carry
(:class:`CloseReason`, :class:`LifecycleAction`); the fixed layout of every control body
with its encoder and its strict decoder (OpenSlot, CloseSlot, CreditUpdate, LifecycleSlot;
a SlotHeartbeat is empty); the one body check both directions share, so the encoder never
writes a control record the decoder would refuse (``_control_body_error``); the packing of
a slot's dense index and generation into its u32 wire id; and the root of the decoding
refusals, :class:`MalformedBatch`, with the two that are about a record's contents
(:class:`UnknownRecordType`, :class:`BadRecordBody`).

:mod:`.protocol` keeps the framing: the batch header (version, lane, ``peer_epoch``,
``batch_seq`` and its serial arithmetic), the record header, the caps of a batch,
:func:`~velomux_quic.mux.protocol.encode_batch`,
:func:`~velomux_quic.mux.protocol.decode_batch` (and its ingress form
:func:`~velomux_quic.mux.protocol.decode_batch_owned`), the reusable
:class:`~velomux_quic.mux.protocol.BatchBuilder`, and the refusals about framing. The two
are separate because they change for different reasons (a new control record or enum
value against the byte layout of a batch and its once-per-record hot path), and each
stays small enough to read whole. :mod:`.protocol` re-exports every public name here, so
callers keep importing the whole codec from there; this module never imports it, not even
for the type checker (a refusal's ``header`` is whatever :mod:`.protocol` parsed, typed
``object`` here), so the two have no import cycle.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Final, NoReturn

from ..errors import MalformedBatch

__all__ = [
    "BadRecordBody",
    "BytesLike",
    "CloseReason",
    "LifecycleAction",
    "MalformedBatch",
    "RecordType",
    "UnknownRecordType",
    "close_slot_body",
    "credit_body",
    "decode_close_slot",
    "decode_credit",
    "decode_lifecycle",
    "decode_open_slot",
    "lifecycle_body",
    "open_slot_body",
    "slot_generation",
    "slot_id",
    "slot_index",
]

_U32: Final = 0xFFFF_FFFF

BytesLike = bytes | bytearray | memoryview
"""What the encoders accept as a body and the decoder as a batch."""


# -- enums ----------------------------------------------------------------------


class RecordType(IntEnum):
    """The ``record_type`` byte."""

    DATA = 0
    OPEN_SLOT = 1
    CLOSE_SLOT = 2
    CREDIT_UPDATE = 3
    SLOT_HEARTBEAT = 4
    LIFECYCLE_SLOT = 5


class CloseReason(IntEnum):
    """The body of a CloseSlot.

    CloseSlot has no direction bit; the reason carries it. TERMINAL_SENT and
    PEER_GONE go from the slot owner to the receiver, UNKNOWN_SLOT and
    PROTOCOL_ERROR the other way, so both sides can hold a slot at the same
    index and still tell whose slot a close is about.
    """

    TERMINAL_SENT = 0
    PEER_GONE = 1
    UNKNOWN_SLOT = 2
    PROTOCOL_ERROR = 3


class LifecycleAction(IntEnum):
    """The action byte of a LifecycleSlot: stop leaves the slot open for the
    remaining output; cancel takes precedence for the same session."""

    STOP = 0
    CANCEL = 1


_DATA: Final = int(RecordType.DATA)
_CLOSE_SLOT: Final = int(RecordType.CLOSE_SLOT)
_LIFECYCLE_SLOT: Final = int(RecordType.LIFECYCLE_SLOT)

_CONTROL_BODY_SIZES: Final[dict[int, int]] = {
    int(RecordType.OPEN_SLOT): 16,
    int(RecordType.CLOSE_SLOT): 1,
    int(RecordType.CREDIT_UPDATE): 4,
    int(RecordType.SLOT_HEARTBEAT): 0,
    int(RecordType.LIFECYCLE_SLOT): 9,
}
"""Body length of every non-Data record type; Data bodies have any length."""

_CLOSE_REASONS: Final = tuple(CloseReason)
_LIFECYCLE_ACTIONS: Final = tuple(LifecycleAction)
_MAX_CLOSE_REASON: Final = len(_CLOSE_REASONS) - 1
_MAX_LIFECYCLE_ACTION: Final = len(_LIFECYCLE_ACTIONS) - 1


# -- errors ---------------------------------------------------------------------


class UnknownRecordType(MalformedBatch):
    """A record type this version does not define."""


class BadRecordBody(MalformedBatch):
    """A control record's body has the wrong length or an unknown enum value."""


def _fail(cls: type[MalformedBatch], message: str, header: object) -> NoReturn:
    """Raise ``cls(message)`` with the batch header parsed so far (None: none parsed)."""
    exc = cls(message)
    exc.header = header
    raise exc


# -- slot ids --------------------------------------------------------------------


def slot_id(index: int, generation: int) -> int:
    """Pack a slot's dense index (u24) and generation (u8) into its u32 wire id.

    The index is in the high bits so raw ids sort by index; the generation makes
    a stale record for a reused index miss instead of landing in a new stream.
    """
    if not 0 <= index <= 0xFF_FFFF:
        raise ValueError(f"slot index must be a u24, got {index}")
    if not 0 <= generation <= 0xFF:
        raise ValueError(f"slot generation must be a u8, got {generation}")
    return index << 8 | generation


def slot_index(slot: int) -> int:
    """The dense index (bits 31..8) of a u32 slot id."""
    if not 0 <= slot <= _U32:
        raise ValueError(f"slot id must be a u32, got {slot}")
    return slot >> 8


def slot_generation(slot: int) -> int:
    """The generation (bits 7..0) of a u32 slot id."""
    if not 0 <= slot <= _U32:
        raise ValueError(f"slot id must be a u32, got {slot}")
    return slot & 0xFF


# -- record bodies ----------------------------------------------------------------

_OPEN_SLOT: Final = struct.Struct(">QQ")
_CLOSE: Final = struct.Struct(">B")
_CREDIT: Final = struct.Struct(">I")
_LIFECYCLE: Final = struct.Struct(">QB")
_CLOSE_BODIES: Final[dict[int, bytes]] = {int(r): bytes((r,)) for r in CloseReason}


def open_slot_body(anchor_id: int, session_id: int) -> bytes:
    """``[u64 anchor_id][u64 session_id]``: the attach pair, moved into a record.

    The anchor id is random, so a peer cannot guess a pair it was not given.
    """
    try:
        return _OPEN_SLOT.pack(anchor_id, session_id)
    except struct.error as exc:
        raise ValueError(f"anchor_id and session_id must be u64: {exc}") from None


def close_slot_body(reason: int) -> bytes:
    """``[u8 reason]``; ``reason`` must be a :class:`CloseReason` value."""
    try:
        return _CLOSE_BODIES[reason]
    except (KeyError, TypeError):
        raise ValueError(f"unknown close reason {reason!r}") from None


def credit_body(delta: int) -> bytes:
    """``[u32 delta]``: credit returned from the receiver to the sender."""
    try:
        return _CREDIT.pack(delta)
    except struct.error as exc:
        raise ValueError(f"credit delta must be a u32: {exc}") from None


def lifecycle_body(session: int, action: int) -> bytes:
    """``[u64 session][u8 action]``: stop or cancel, naming the session.

    The session, not the slot id, names the stream, so a delayed signal cannot
    reach a later stream that reuses the slot after its generation wrapped.
    """
    if action not in _LIFECYCLE_ACTIONS:
        raise ValueError(f"unknown lifecycle action {action!r}")
    try:
        return _LIFECYCLE.pack(session, action)
    except struct.error as exc:
        raise ValueError(f"session must be a u64 and action an int: {exc}") from None


def decode_open_slot(body: BytesLike) -> tuple[int, int]:
    """``(anchor_id, session_id)`` of an OpenSlot body."""
    try:
        anchor_id, session_id = _OPEN_SLOT.unpack(body)
    except struct.error:
        _fail(BadRecordBody, f"OpenSlot body of {_nbytes(body)} bytes, expected 16", None)
    return anchor_id, session_id


def decode_close_slot(body: BytesLike) -> CloseReason:
    """The reason of a CloseSlot body."""
    try:
        (value,) = _CLOSE.unpack(body)
    except struct.error:
        _fail(BadRecordBody, f"CloseSlot body of {_nbytes(body)} bytes, expected 1", None)
    if value > _MAX_CLOSE_REASON:
        _fail(BadRecordBody, f"unknown close reason {value}", None)
    return _CLOSE_REASONS[int(value)]


def decode_credit(body: BytesLike) -> int:
    """The delta of a CreditUpdate body."""
    try:
        (delta,) = _CREDIT.unpack(body)
    except struct.error:
        _fail(BadRecordBody, f"CreditUpdate body of {_nbytes(body)} bytes, expected 4", None)
    return int(delta)


def decode_lifecycle(body: BytesLike) -> tuple[int, LifecycleAction]:
    """``(session, action)`` of a LifecycleSlot body."""
    try:
        session, value = _LIFECYCLE.unpack(body)
    except struct.error:
        _fail(BadRecordBody, f"LifecycleSlot body of {_nbytes(body)} bytes, expected 9", None)
    if value > _MAX_LIFECYCLE_ACTION:
        _fail(BadRecordBody, f"unknown lifecycle action {value}", None)
    return session, _LIFECYCLE_ACTIONS[value]


def _nbytes(body: BytesLike) -> int:
    # len() of a cast memoryview counts items, not bytes; the wire counts bytes.
    return body.nbytes if type(body) is memoryview else len(body)


def _control_body_error(record_type: int, body: BytesLike) -> str | None:
    """Why a record of ``record_type`` cannot carry ``body``, or None if it can.

    Shared by both directions so the encoder never writes a batch the decoder
    would refuse. ``body`` is bytes or a byte-format memoryview.
    """
    expected = _CONTROL_BODY_SIZES.get(record_type)
    if expected is None:
        return f"unknown record type {record_type}"
    if len(body) != expected:
        name = RecordType(record_type).name
        return f"{name} body of {len(body)} bytes, expected {expected}"
    if record_type == _CLOSE_SLOT and body[0] > _MAX_CLOSE_REASON:
        return f"unknown close reason {body[0]}"
    if record_type == _LIFECYCLE_SLOT and body[8] > _MAX_LIFECYCLE_ACTION:
        return f"unknown lifecycle action {body[8]}"
    return None
