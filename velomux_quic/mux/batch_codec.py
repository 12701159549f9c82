"""The byte layout of a mux batch and the loops that run once per record over it:
:class:`BatchBuilder`, which packs records into a batch on the egress side, and
:func:`_owned_records`, the walk under :func:`~.protocol.decode_batch_owned` that turns a
received batch into the records ingress delivers.

Both run once per record on every stream, so this module is one of the record path's
compiled modules (velomux_quic.recordpath): where built, this same file is compiled, with
the C types of ``batch_codec.pxd``; otherwise it runs as it is. The compiled batcher
(``mux/egress.py``) cimports the builder's fields and :func:`_append_data` from there.

The rest of the framing (the header as a value, the strict decoder and its refusals, the
one-call encoder) is :mod:`.protocol`'s, which builds on this module and re-exports its
public names, so that module stays the one import of the codec. Only the loops and the
layout they need live here: the framing's classes stay in one uncompiled module, so a batch
decoded through either implementation carries the same header class and raises the same
refusal classes.

The loops are written for the compiler as much as for the interpreter: a batch's bytes are
read, and a record header is written, a byte at a time through ``at`` (the batch itself
here; a C pointer into it where compiled), and every bound is checked before a read. So the
compiled loops call nothing per record beyond making the record itself, and the source
stays plain Python that both implementations run. The one exception is the walk's read of
a record header: a byte at a time is what the interpreter does worst, so where the source
runs uncompiled the walk takes its other branch (``cython.compiled``), which reads a header
with one ``struct`` call.
"""

from __future__ import annotations

import struct
from typing import Final

try:
    import cython  # type: ignore[import-not-found, unused-ignore]
except ModuleNotFoundError:  # run as source, where Cython (needed only to build) is absent
    from ..recordpath import shadow as cython  # type: ignore[no-redef, unused-ignore]

from ..transport.config import MAX_LANES
from .records import (
    _CONTROL_BODY_SIZES,
    _DATA,
    _U32,
    BytesLike,
    RecordType,
    _control_body_error,
)

__all__ = [
    "BATCH_HEADER",
    "BATCH_HEADER_SIZE",
    "MAX_RECORDS",
    "MIN_BATCH_CAP",
    "MUX_VERSION",
    "RECORD_HEADER",
    "RECORD_HEADER_SIZE",
    "BatchBuilder",
]

MUX_VERSION: Final = 2
"""The ``mux_version`` byte of every batch; anything else is refused."""

BATCH_HEADER: Final = struct.Struct(">BBHQI")
"""mux_version, flags, record_count, peer_epoch, batch_seq."""

RECORD_HEADER: Final = struct.Struct(">BIII")
"""record_type, slot, frame_seq, len."""

BATCH_HEADER_SIZE: Final = BATCH_HEADER.size  # 16
RECORD_HEADER_SIZE: Final = RECORD_HEADER.size  # 13

MAX_RECORDS: Final = 0xFFFF
"""``record_count`` is a u16, so a batch holds at most this many records."""

MIN_BATCH_CAP: Final = BATCH_HEADER_SIZE + RECORD_HEADER_SIZE  # 29
"""A batch header plus one empty record. No cap may go below it, so a control
record (close, credit, heartbeat) always fits an eager batch of its own."""

_pack_header_into: Final = BATCH_HEADER.pack_into
_pack_record: Final = RECORD_HEADER.pack
_unpack_record_from: Final = RECORD_HEADER.unpack_from
_CREDIT_RECORD: Final = struct.Struct(">BIIII")
"""A whole CreditUpdate record: its header (type, slot, frame_seq 0, length 4) and body."""
_pack_credit_record: Final = _CREDIT_RECORD.pack
_CREDIT_RECORD_TYPE: Final = int(RecordType.CREDIT_UPDATE)

_DATA_HEADER: Final = _pack_record(_DATA, 0, 0, 0)
"""A Data record's header before its three u32 fields are written in place."""
_CREDIT_BODY_SIZE: Final = _CONTROL_BODY_SIZES[_CREDIT_RECORD_TYPE]
"""A CreditUpdate's body, its u32 delta: the control record a return of credit carries one
a slot of, so the walk knows it good without a call (records' ``_control_body_error``)."""
_CREDIT_TEMPLATE: Final = _pack_credit_record(_CREDIT_RECORD_TYPE, 0, 0, _CREDIT_BODY_SIZE, 0)
"""A CreditUpdate record before its slot and delta are written in place."""

# The sizes and bounds again, as C integers where this module is compiled (batch_codec.pxd):
# the loops compare with them once per record.
_batch_header_size: Final = BATCH_HEADER_SIZE
_record_header_size: Final = RECORD_HEADER_SIZE
_max_records: Final = MAX_RECORDS
_u32_max: Final = _U32


def _u32_at(at: bytes, index: int) -> int:
    """The big-endian u32 at ``at[index:index + 4]``, which the caller checked is there."""
    high = at[index]  # compiled: unsigned 32 bits, so the shift cannot overflow
    return (high << 24) | (at[index + 1] << 16) | (at[index + 2] << 8) | at[index + 3]


def _put_u32(at: bytearray, index: int, value: int) -> None:
    """Write the u32 ``value`` big-endian at ``at[index:index + 4]``, which exists."""
    at[index] = (value >> 24) & 0xFF
    at[index + 1] = (value >> 16) & 0xFF
    at[index + 2] = (value >> 8) & 0xFF
    at[index + 3] = value & 0xFF


def _append_data(buf: bytearray, slot: int, seq: int, body: BytesLike) -> None:
    """Append one Data record: what ``buf += RECORD_HEADER.pack(DATA, slot, seq, len(body));
    buf += body`` does, with struct's own error for a field that is not a u32.

    The header goes in as a template whose fields are then written in place, so no header
    object is made per record. The compiled batcher's packing loop calls this directly."""
    if type(body) is bytes:
        data = body  # compiled: known to be bytes from here on
        length = len(data)
        if slot < 0 or slot > _u32_max or seq < 0 or seq > _u32_max or length > _u32_max:
            _pack_record(_DATA, slot, seq, length)  # raises struct.error, as below
        start = len(buf)
        buf.extend(_DATA_HEADER)  # compiled, extending by bytes is a resize and a copy
        buf.extend(data)
        at = buf  # compiled: a pointer into the buffer as it is now, after it grew
        _put_u32(at, start + 1, slot)
        _put_u32(at, start + 5, seq)
        _put_u32(at, start + 9, length)
    else:  # any other bytes-like body, as add() takes it
        buf += _pack_record(_DATA, slot, seq, len(body))
        buf += body


def _append_credit(buf: bytearray, slot: int, delta: int) -> None:
    """Append one CreditUpdate record of two u32s (checked by the caller), without making
    the record as an object first."""
    start = len(buf)
    buf.extend(_CREDIT_TEMPLATE)
    at = buf
    _put_u32(at, start + 1, slot)
    _put_u32(at, start + 13, delta)


def _check_lane(lane: int) -> None:
    if not 0 <= lane < MAX_LANES:
        raise ValueError(f"lane must be in 0..{MAX_LANES - 1}, got {lane}")


def _check_record(record_type: int, body: BytesLike) -> int:
    """Validate a record to encode and return its body length in bytes."""
    if type(body) is memoryview and (body.format != "B" or body.ndim != 1):
        body = body.cast("B")
    if record_type != _DATA:
        reason = _control_body_error(record_type, body)
        if reason is not None:
            raise ValueError(reason)
    length = len(body)
    if length > _U32:
        raise ValueError(f"record body of {length} bytes exceeds a u32 length")
    return length


def _owned_records(raw: bytes, count: int) -> list[tuple[int, int, int, bytes]] | None:
    """The ``count`` records of the batch ``raw`` (its header already parsed), each body
    sliced out as ``bytes``; None when the batch cannot be walked whole, for the caller to
    refuse it through the strict decoder.

    The walk checks only what keeps it inside the batch (a record header past the end, a
    body past the end, bytes left over) and each control body as it meets one (they are
    rare), so a well-formed batch pays no other check per record.

    Compiled, it reads each header a byte at a time through a pointer, which is a few C
    loads. Run as source, that costs the interpreter an operation per byte, so there it
    reads a header with one ``struct`` call instead and leaves the bounds to Python: the
    unpack raises on a header past the end, and a body past the end comes out short and
    leaves ``pos`` past ``end``; either way the batch is refused, as above."""
    end = len(raw)
    pos = _batch_header_size
    records: list[tuple[int, int, int, bytes]] = []
    if cython.compiled:
        at = raw  # a pointer to the batch's bytes, which ``raw`` keeps alive
        for _index in range(count):
            start = pos + _record_header_size
            if start > end:
                return None  # a record header past the end
            stop = start + _u32_at(at, pos + 9)
            if stop > end:
                return None  # a body past the end
            body = at[start:stop]
            record_type = at[pos]
            if (
                record_type
                and (record_type != _CREDIT_RECORD_TYPE or stop - start != _CREDIT_BODY_SIZE)
                and _control_body_error(record_type, body) is not None
            ):
                return None
            records.append((record_type, _u32_at(at, pos + 1), _u32_at(at, pos + 5), body))
            pos = stop
    else:
        append = records.append
        unpack = _unpack_record_from
        size = _record_header_size
        try:
            for _index in range(count):
                kind, slot, seq, length = unpack(raw, pos)
                pos += size
                stop = pos + length
                data = raw[pos:stop]
                if (
                    kind
                    and (kind != _CREDIT_RECORD_TYPE or length != _CREDIT_BODY_SIZE)
                    and _control_body_error(kind, data) is not None
                ):
                    return None
                append((kind, slot, seq, data))
                pos = stop
        except struct.error:
            return None  # a record header past the end
    return records if pos == end else None


class BatchBuilder:
    """Packs records into one reusable ``bytearray``: the egress hot path.

    The batch header's 16 bytes are reserved up front, each :meth:`add` appends
    a record header and its body, and :meth:`finish` writes the header in place
    with ``struct.pack_into`` and returns the batch with a single copy.
    :meth:`reset` empties the builder for the next batch; a batcher keeps one
    builder for its whole life.

    Records are appended rather than packed at an offset into a buffer sized
    to the cap: in CPython, copying a body to an offset of an existing buffer
    goes through generic slice assignment and costs about twice as much per
    record as appending it (see ``perf/mux_codec_bench.py``).

    ``cap`` is the batch byte cap, header included (see :func:`~.protocol.batch_cap`).
    :meth:`fits` is the batcher's question "does one more record go in this
    batch?", answered against ``cap`` and :data:`MAX_RECORDS`. :meth:`add`
    itself enforces only the record count: a single record larger than the cap
    is legal alone in its own batch (it travels by rendezvous).
    """

    __slots__ = ("_buf", "_cap", "_count")

    def __init__(self, cap: int) -> None:
        if cap < MIN_BATCH_CAP:
            raise ValueError(f"batch cap {cap} is below the minimum of {MIN_BATCH_CAP} bytes")
        self._cap = cap
        self._buf = bytearray(_batch_header_size)
        self._count = 0

    @property
    def cap(self) -> int:
        """The byte cap :meth:`fits` checks against, header included."""
        return self._cap

    @property
    def size(self) -> int:
        """Bytes the batch holds so far, its 16-byte header included."""
        return len(self._buf)

    @property
    def count(self) -> int:
        """Records added since the last :meth:`reset`."""
        return self._count

    def fits(self, body_len: int) -> bool:
        """Whether a record with a body of ``body_len`` bytes keeps the batch within its caps."""
        return len(self._buf) + _record_header_size + body_len <= self._cap and (
            self._count < _max_records
        )

    def add(self, record_type: int, slot: int, frame_seq: int, body: BytesLike) -> None:
        """Append one record.

        Raises ``ValueError`` when the batch already holds :data:`MAX_RECORDS`
        records, for an out-of-range field or unknown record type, or for a
        control body the decoder would refuse. A failed add leaves the batch
        as it was.
        """
        if self._count >= _max_records:
            raise ValueError(f"a batch holds at most {MAX_RECORDS} records")
        if record_type != _DATA or type(body) is memoryview:
            length = _check_record(record_type, body)
        else:
            length = len(body)
        try:
            record_header = _pack_record(record_type, slot, frame_seq, length)
        except struct.error as exc:
            raise ValueError(f"field out of range: {exc}") from None
        buf = self._buf
        start = len(buf)
        try:
            buf += record_header
            buf += body
        except BaseException:
            del buf[start:]
            raise
        self._count += 1

    def add_data(self, slot: int, frame_seq: int, body: bytes) -> None:
        """Append one Data record on the egress hot path, unchecked.

        The caller guarantees what :meth:`add` would check: :meth:`fits` said yes (so the
        record count is within :data:`MAX_RECORDS`), ``slot`` and ``frame_seq``
        are u32s it allocated, and ``body`` is ``bytes``.
        """
        _append_data(self._buf, slot, frame_seq, body)
        self._count += 1

    def add_data_if_fits(self, slot: int, frame_seq: int, body: bytes) -> bool:
        """:meth:`fits` and :meth:`add_data` in one call: the egress loop asks this once per
        record, so one Python call instead of two is a measurable share of its cost.
        False (nothing added) when the record would break a cap."""
        buf = self._buf
        if len(buf) + _record_header_size + len(body) > self._cap or self._count >= _max_records:
            return False
        _append_data(buf, slot, frame_seq, body)
        self._count += 1
        return True

    def add_credit(self, slot: int, delta: int) -> None:
        """Append one CreditUpdate record, unchecked: the receiver's reply to its own slots.

        The caller guarantees what :meth:`add` would check: :meth:`fits` said yes for a
        4-byte body, ``slot`` is a u32 (a slot id the peer sent), and ``delta`` a u32. A
        consumer that keeps up returns credit every few records of each stream, so these
        replies are a few percent of a frontend's records; :meth:`add`'s generic
        validation of a control body cost more than the rest of the record together.
        """
        if not (
            type(slot) is int and type(delta) is int and 0 <= slot <= _U32 and 0 <= delta <= _U32
        ):
            # struct's own error for the value out of range
            _pack_credit_record(_CREDIT_RECORD_TYPE, slot, 0, _CREDIT_BODY_SIZE, delta)
        _append_credit(self._buf, slot, delta)
        self._count += 1

    @property
    def buffer(self) -> bytearray:
        """The batch being built, for a packer that appends Data records inline (the
        batcher's loop): it appends ``RECORD_HEADER.pack(DATA, slot, seq, len(body))``
        and ``body`` itself within :attr:`cap` and :data:`MAX_RECORDS`
        (counting :attr:`count` in), then reports them with :meth:`added` before any other
        call on the builder. One Python call per record less than :meth:`add_data_if_fits`."""
        return self._buf

    def added(self, records: int) -> None:
        """``records`` Data records were appended to :attr:`buffer` inline."""
        self._count += records

    def finish(self, lane: int, peer_epoch: int, batch_seq: int) -> bytes:
        """Write the header and return the batch as ``bytes``.

        The builder keeps its records until :meth:`reset`, so ``size`` and
        ``count`` stay readable for metrics after the batch is handed off.
        """
        _check_lane(lane)
        buf = self._buf
        try:
            _pack_header_into(buf, 0, MUX_VERSION, lane, self._count, peer_epoch, batch_seq)
        except struct.error as exc:
            raise ValueError(f"field out of range: {exc}") from None
        return bytes(buf)

    def reset(self) -> None:
        """Empty the builder for the next batch."""
        del self._buf[_batch_header_size:]
        self._count = 0
