"""Wire codec of the messenger mux (sans-IO): the framing of records into batches.

A batch is the payload of one ``_stream_batch`` active message (``_stream_batch.k``
on lane k). The messenger frames the message, so a batch carries only its own
header and records::

    batch:   [16 B batch header][record_count x record]
    header:  [u8 mux_version = 2][u8 flags][u16 record_count][u64 peer_epoch][u32 batch_seq]
    record:  [u8 record_type][u32 slot][u32 frame_seq][u32 len][len bytes body]

Every multi-byte field is big-endian. The low four bits of ``flags`` carry the
lane; the high four are written as zero and ignored on receipt, so a later
sender may use them without breaking this receiver. A lane-0 batch therefore
writes ``flags = 0``, the byte senders wrote before lanes existed.

Decoding is strict, and all of its refusals are one exception family rooted at
:class:`MalformedBatch`. A batch arrives from a peer, so every length in it is
hostile until checked: the caller must be able to drop and count a bad batch
with a single ``except`` and never confuse it with a bug of its own.

Decoding checks everything the wire alone can tell: the version, the record
count against the bytes present, every record length, the record type, and
each control body's length and enum value. A batch that decodes is therefore
well formed throughout, and ingress never meets a half-applied batch. The cost
of that choice is that one bad record drops the whole batch, including good
records of other slots in it. That is deliberate: an unknown record type or a
malformed control body means the sender does not speak this version, and the
slot ids and sequence numbers beside it are not worth trusting either. The
batch is dropped and counted by the caller; the slots it touched see a
``frame_seq`` gap and end through their watchdogs, while every stream in other
batches continues. Data bodies are opaque here: they are checked where they
are deserialized.

The hot path (one record per token) follows two rules. Decoding makes one object
per body: :func:`decode_batch` slices it out of a single ``memoryview`` of the
batch (zero-copy), and :func:`decode_batch_owned`, which ingress uses because a
slot's buffer keeps ``bytes``, slices it out of one copy of the batch straight
into the ``bytes`` the consumer reads, with the same checks and refusals.
Encoding appends every record to one reusable ``bytearray`` (:class:`BatchBuilder`)
and writes the header in place at the end, so a batch of a thousand records keeps
no per-record objects alive and leaves the builder as one copy. Records are plain
tuples, not objects, for the same reason. The loops that run per record (the
builder, and the walk under :func:`decode_batch_owned`) are :mod:`.batch_codec`'s, one
of the record path's compiled modules, with the layout they write and read (the version,
the headers, the caps); this module re-exports them.

This module owns that framing: the batch and record headers, the lanes and caps
of a batch, ``batch_seq`` serial arithmetic, :func:`encode_batch`,
:func:`decode_batch`, :func:`decode_batch_owned`, :func:`decode_header` and
:class:`BatchBuilder`, and the refusals about framing (:class:`BadVersion`,
:class:`TruncatedBatch`, :class:`RecordCountMismatch`, :class:`RecordOverrun`).
:mod:`.records` owns what a record means: the record types and enums, each control
body's layout with its encoder and decoder, slot ids, and the error root with the
refusals about a record's contents. They are separate because they change for different reasons
(the byte layout and hot path of a batch against the set of control records),
and each stays small enough to read whole. Every public name of
:mod:`.records` is re-exported here, so this module remains the one import for
the whole codec.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

from ..transport.config import MAX_LANES
from .batch_codec import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    MAX_RECORDS,
    MIN_BATCH_CAP,
    MUX_VERSION,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    BatchBuilder,
    _check_lane,
    _check_record,
    _owned_records,
)
from .records import (
    _CONTROL_BODY_SIZES,
    _DATA,
    _U32,
    BadRecordBody,
    BytesLike,
    CloseReason,
    LifecycleAction,
    MalformedBatch,
    RecordType,
    UnknownRecordType,
    _control_body_error,
    _fail,
    close_slot_body,
    credit_body,
    decode_close_slot,
    decode_credit,
    decode_lifecycle,
    decode_open_slot,
    lifecycle_body,
    open_slot_body,
    slot_generation,
    slot_id,
    slot_index,
)

__all__ = [
    "BATCH_HANDLER",
    "BATCH_HEADER",
    "BATCH_HEADER_SIZE",
    "COALESCE_THRESHOLD",
    "MAX_LANES",
    "MAX_RECORDS",
    "MIN_BATCH_CAP",
    "MUX_VERSION",
    "RECORD_HEADER",
    "RECORD_HEADER_SIZE",
    "BadRecordBody",
    "BadVersion",
    "BatchBuilder",
    "BatchHeader",
    "BytesLike",
    "CloseReason",
    "EncodableRecord",
    "LifecycleAction",
    "MalformedBatch",
    "OwnedRecord",
    "Record",
    "RecordCountMismatch",
    "RecordOverrun",
    "RecordType",
    "TruncatedBatch",
    "UnknownRecordType",
    "batch_cap",
    "batch_handler",
    "close_slot_body",
    "credit_body",
    "decode_batch",
    "decode_batch_owned",
    "decode_close_slot",
    "decode_credit",
    "decode_header",
    "decode_lifecycle",
    "decode_open_slot",
    "encode_batch",
    "lifecycle_body",
    "open_slot_body",
    "seq_after",
    "seq_distance",
    "slot_generation",
    "slot_id",
    "slot_index",
]

# -- constants ------------------------------------------------------------------

# The version, the batch and record headers, and the caps of a batch (MUX_VERSION,
# BATCH_HEADER, RECORD_HEADER, BATCH_HEADER_SIZE, RECORD_HEADER_SIZE, MAX_RECORDS,
# MIN_BATCH_CAP) are defined in .batch_codec, beside the loops that write and walk them,
# and imported above.

COALESCE_THRESHOLD: Final = 64 * 1024
"""The largest frame the coalescing writer packs into one buffered write; a
bigger batch is written in segments and gives back the syscall saving."""


BATCH_HANDLER: Final = "_stream_batch"
"""The batch handler of lane 0; lane k (1..15) uses ``_stream_batch.k``."""

_LANE_MASK: Final = MAX_LANES - 1
_SERIAL_HALF: Final = 1 << 31
_SERIAL_SPAN: Final = 1 << 32

_unpack_header_from: Final = BATCH_HEADER.unpack_from
_pack_record: Final = RECORD_HEADER.pack
_unpack_record_from: Final = RECORD_HEADER.unpack_from


Record = tuple[int, int, int, memoryview]
"""A decoded record: ``(record_type, slot, frame_seq, body)``.

A tuple rather than an object because a 60 KiB batch holds about a thousand of
them. ``record_type`` is a plain ``int`` (compare it with :class:`RecordType`
members); ``body`` is a zero-copy slice of the decoded batch, so it keeps the
batch's buffer alive and must not outlive a buffer the caller means to reuse.
"""

OwnedRecord = tuple[int, int, int, bytes]
"""A decoded record as :func:`decode_batch_owned` gives it: as :data:`Record`, with the
body copied out into ``bytes`` of its own (the object a slot's buffer keeps)."""

EncodableRecord = tuple[int, int, int, BytesLike]
"""A record to encode: as :data:`Record`, with any bytes-like body."""


def batch_handler(lane: int) -> str:
    """The active-message handler name that carries batches of ``lane``.

    Lane 0 keeps the name from before lanes, so an older peer still reaches it.
    """
    if not 0 <= lane < MAX_LANES:
        raise ValueError(f"lane must be in 0..{MAX_LANES - 1}, got {lane}")
    return BATCH_HANDLER if lane == 0 else f"{BATCH_HANDLER}.{lane}"


def batch_cap(max_batch_bytes: int, eager_budget: int) -> int:
    """The byte cap of a batch: the smallest of the three clamps, at least :data:`MIN_BATCH_CAP`.

    ``eager_budget`` is the largest payload the messenger carries inline to the
    peer. A batch above it would become a rendezvous transfer and pay a round
    trip; one above :data:`COALESCE_THRESHOLD` would lose the coalesced write.
    The floor keeps control records inline even under a tiny configured cap.
    """
    return max(MIN_BATCH_CAP, min(max_batch_bytes, eager_budget, COALESCE_THRESHOLD))


# -- errors ---------------------------------------------------------------------


class BadVersion(MalformedBatch):
    """``mux_version`` is not :data:`MUX_VERSION`."""


class TruncatedBatch(MalformedBatch):
    """The batch ends inside its header or inside a record header."""


class RecordCountMismatch(MalformedBatch):
    """``record_count`` disagrees with the bytes: the batch ends cleanly before
    that many records, or bytes follow the last counted record."""


class RecordOverrun(MalformedBatch):
    """A record's ``len`` runs past the end of the batch."""


# -- sequence numbers ------------------------------------------------------------


def _check_serial(value: int) -> None:
    if not 0 <= value <= _U32:
        raise ValueError(f"batch_seq must be a u32, got {value}")


def seq_distance(a: int, b: int) -> int:
    """How far ``a`` is ahead of ``b`` in u32 serial arithmetic, in ``[-2**31, 2**31)``.

    ``batch_seq`` wraps, so plain subtraction is wrong across the wrap: the
    distance from ``2**32 - 1`` to ``0`` is 1, not ``-(2**32 - 1)``. Positive
    means ``a`` is newer; ``seq_distance(a, b) - 1`` batches were missed when
    ``a`` follows a high-water mark ``b``.
    """
    _check_serial(a)
    _check_serial(b)
    return (a - b + _SERIAL_HALF) % _SERIAL_SPAN - _SERIAL_HALF


def seq_after(a: int, b: int) -> bool:
    """True when ``a`` comes after ``b`` under RFC 1982 serial comparison (mod ``2**32``).

    For two values exactly ``2**31`` apart RFC 1982 leaves the order undefined;
    here neither is after the other, so a gap metered against a high-water mark
    is never counted for such a pair.
    """
    return seq_distance(a, b) > 0


# -- batches ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The fields of a batch header that vary; the version byte is :attr:`version`.

    ``peer_epoch`` changes each time the sender re-establishes its view of the
    peer, so ingress can discard an old epoch's batches by header alone;
    ``batch_seq`` advances within an epoch (modulo ``2**32``) to meter gaps.
    On encode, the written record count is the number of records given, not
    ``record_count``.
    """

    version: ClassVar[int] = MUX_VERSION

    lane: int
    record_count: int
    peer_epoch: int
    batch_seq: int


def _as_bytes_view(data: BytesLike) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _parse_header(view: memoryview) -> BatchHeader:
    if len(view) < BATCH_HEADER_SIZE:
        _fail(
            TruncatedBatch, f"batch of {len(view)} bytes is shorter than its 16-byte header", None
        )
    version, flags, count, epoch, batch_seq = _unpack_header_from(view, 0)
    if version != MUX_VERSION:
        _fail(BadVersion, f"mux_version {version}, expected {MUX_VERSION}", None)
    # The high four bits of flags are reserved: written zero, ignored here.
    return BatchHeader(flags & _LANE_MASK, count, epoch, batch_seq)


def decode_header(data: BytesLike) -> BatchHeader:
    """The header of a batch, without walking its records.

    Lets ingress refuse a batch for its lane or a stale epoch, and count its
    records, before paying for the records. Raises :class:`TruncatedBatch` or
    :class:`BadVersion`.
    """
    return _parse_header(_as_bytes_view(data))


def decode_batch(data: BytesLike) -> tuple[BatchHeader, list[Record]]:
    """Parse a whole batch: its header and every record, checked throughout.

    Raises a :class:`MalformedBatch` subclass for any malformed input, and
    nothing else: version, truncation, a count that disagrees with the bytes
    (too few records or trailing bytes), a length past the end, an unknown
    record type, or a malformed control body. Bodies are zero-copy slices of
    ``data``.
    """
    view = _as_bytes_view(data)
    header = _parse_header(view)
    end = len(view)
    pos = BATCH_HEADER_SIZE
    records: list[Record] = []
    append = records.append
    unpack_record = _unpack_record_from
    control_sizes = _CONTROL_BODY_SIZES
    for _ in range(header.record_count):
        if pos + RECORD_HEADER_SIZE > end:
            if pos == end:
                _fail(
                    RecordCountMismatch,
                    f"header counts {header.record_count} records, batch holds {len(records)}",
                    header,
                )
            _fail(TruncatedBatch, f"batch ends inside the header of record {len(records)}", header)
        record_type, slot, frame_seq, length = unpack_record(view, pos)
        pos += RECORD_HEADER_SIZE
        stop = pos + length
        if stop > end:
            _fail(
                RecordOverrun,
                f"record {len(records)} states {length} body bytes, {end - pos} remain",
                header,
            )
        body = view[pos:stop]
        if record_type != _DATA:
            reason = _control_body_error(record_type, body)
            if reason is not None:
                cls = UnknownRecordType if record_type not in control_sizes else BadRecordBody
                _fail(cls, f"record {len(records)}: {reason}", header)
        append((record_type, slot, frame_seq, body))
        pos = stop
    if pos != end:
        _fail(
            RecordCountMismatch,
            f"{end - pos} bytes follow the {header.record_count} counted records",
            header,
        )
    return header, records


_WHOLE_COPY_MAX: Final = 64 * 1024
"""Largest batch :func:`decode_batch_owned` copies whole before slicing its bodies. The
default eager batch (``max_batch_bytes`` 60 KiB) fits; a larger one (a staged singleton, or
a raised ``max_batch_bytes``) holds few records, and is decoded as views instead."""


def decode_batch_owned(data: BytesLike) -> tuple[BatchHeader, list[OwnedRecord]]:
    """:func:`decode_batch` with every body copied out as ``bytes``: the ingress path.

    Accepts and refuses exactly what :func:`decode_batch` does, with the same
    exception and message (any defect sends the batch through :func:`decode_batch`
    to be refused there). The records are the same, except that each body is a
    ``bytes`` slice of one copy of the batch instead of a ``memoryview`` of it.

    Why a second decoder: ingress copies every data body into ``bytes`` anyway (a
    slot's buffer must not pin the messenger's receive buffer, and the consumer's
    ``decode_frame`` is fastest on ``bytes``), so slicing a zero-copy
    ``memoryview`` per record and then copying it cost two objects where one will
    do. Here the batch is copied once (a ``memcpy`` of at most one batch) and each
    body is sliced from that copy straight into its final object, by the walk of
    :mod:`.batch_codec` (compiled where built), which checks only what keeps it inside
    the batch and leaves any batch it cannot walk whole to the strict decoder for its
    exact refusal. A batch larger than an eager batch can be (a staged singleton) is
    decoded as views and only its bodies copied.
    """
    if type(data) is bytes:
        raw = data
    else:
        view = _as_bytes_view(data)
        if len(view) > _WHOLE_COPY_MAX:
            # A staged singleton (one large record): copying the batch first would copy
            # its body twice, and there is no per-record cost to save.
            header, viewed = decode_batch(view)
            return header, [(kind, slot, seq, bytes(body)) for kind, slot, seq, body in viewed]
        raw = bytes(view)
    header = _parse_header(memoryview(raw))
    records = _owned_records(raw, header.record_count)
    if records is None:
        decode_batch(raw)  # raises the refusal this batch earns
        raise AssertionError("decode_batch accepted a batch decode_batch_owned refused")
    return header, records


def encode_batch(header: BatchHeader, records: Sequence[EncodableRecord]) -> bytes:
    """Encode a batch in one call; the reference for :class:`BatchBuilder`.

    The record count written is ``len(records)``. Raises ``ValueError`` for more
    than :data:`MAX_RECORDS` records, an out-of-range field, an unknown record
    type, or a control body the decoder would refuse.
    """
    count = len(records)
    if count > MAX_RECORDS:
        raise ValueError(f"{count} records exceed the {MAX_RECORDS} a batch can count")
    _check_lane(header.lane)
    try:
        parts: list[BytesLike] = [
            BATCH_HEADER.pack(MUX_VERSION, header.lane, count, header.peer_epoch, header.batch_seq)
        ]
        append = parts.append
        for record_type, slot, frame_seq, body in records:
            append(_pack_record(record_type, slot, frame_seq, _check_record(record_type, body)))
            append(body)
    except struct.error as exc:
        raise ValueError(f"field out of range: {exc}") from None
    return b"".join(parts)
