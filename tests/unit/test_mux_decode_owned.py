"""``decode_batch_owned``, the ingress decoder: the same answers as ``decode_batch``.

It skips the per-record bounds checks of the strict decoder and hands any batch it cannot
walk to that decoder for its refusal, so the property that matters is agreement: every
input either decodes to the same records under both (bodies as ``bytes`` here) or is
refused by both with the same exception class and message.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velomux_quic.mux.protocol import (
    RECORD_HEADER,
    BadRecordBody,
    BatchHeader,
    EncodableRecord,
    MalformedBatch,
    OwnedRecord,
    Record,
    RecordCountMismatch,
    RecordOverrun,
    RecordType,
    TruncatedBatch,
    UnknownRecordType,
    close_slot_body,
    credit_body,
    decode_batch,
    decode_batch_owned,
    encode_batch,
    lifecycle_body,
    open_slot_body,
    slot_id,
)

from .twins import each_twin

pytestmark = pytest.mark.usefixtures("decoder_twin")
decoder_twin = each_twin(
    "velomux_quic.mux.batch_codec", "_owned_records", into="velomux_quic.mux.protocol"
)
"""Every test here runs against both implementations of the ingress decoder's walk."""

_BODIES = {
    int(RecordType.OPEN_SLOT): open_slot_body(7, 9),
    int(RecordType.CLOSE_SLOT): close_slot_body(0),
    int(RecordType.CREDIT_UPDATE): credit_body(3),
    int(RecordType.SLOT_HEARTBEAT): b"",
    int(RecordType.LIFECYCLE_SLOT): lifecycle_body(5, 1),
}


Decoder = Callable[[bytes], tuple[BatchHeader, Sequence[Record | OwnedRecord]]]


def _outcome(decode: Decoder, data: bytes) -> object:
    """What a decoder makes of ``data``: its records with bodies as bytes, or its refusal."""
    try:
        header, records = decode(data)
    except MalformedBatch as exc:
        return type(exc), str(exc), exc.header
    return header, [(t, s, q, bytes(b)) for t, s, q, b in records]


def _batch(records: list[EncodableRecord], *, lane: int = 0, batch_seq: int = 3) -> bytes:
    return encode_batch(BatchHeader(lane, len(records), 1, batch_seq), records)


records_strategy = st.lists(
    st.one_of(
        st.tuples(
            st.just(int(RecordType.DATA)),
            st.integers(0, 0xFFFF_FFFF),
            st.integers(0, 0xFFFF_FFFF),
            st.binary(max_size=40),
        ),
        st.sampled_from(sorted(_BODIES)).map(lambda kind: (kind, slot_id(1, 1), 0, _BODIES[kind])),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(records_strategy, st.data())
def test_agrees_with_the_strict_decoder_on_any_cut_or_flipped_batch(
    records: list[EncodableRecord], data: st.DataObject
) -> None:
    batch = bytearray(_batch(records))
    expected = _outcome(decode_batch, bytes(batch))
    assert _outcome(decode_batch_owned, bytes(batch)) == expected
    # A damaged copy: cut short, extended, or one byte changed anywhere.
    damage = data.draw(st.sampled_from(["cut", "extend", "flip"]))
    if damage == "cut":
        del batch[data.draw(st.integers(0, len(batch))) :]
    elif damage == "extend":
        batch += data.draw(st.binary(min_size=1, max_size=20))
    else:
        at = data.draw(st.integers(0, len(batch) - 1))
        batch[at] = data.draw(st.integers(0, 255))
    assert _outcome(decode_batch_owned, bytes(batch)) == _outcome(decode_batch, bytes(batch))


def test_bodies_are_bytes_of_their_own_and_any_buffer_is_accepted() -> None:
    payload = _batch([(0, slot_id(0, 1), 1, b"abc"), (0, slot_id(1, 1), 1, b"")])
    for given_as in (payload, bytearray(payload), memoryview(b"xx" + payload)[2:]):
        header, records = decode_batch_owned(given_as)
        assert header.record_count == 2
        assert records == [(0, slot_id(0, 1), 1, b"abc"), (0, slot_id(1, 1), 1, b"")]
        assert all(type(body) is bytes for _, _, _, body in records)
    mutable = bytearray(payload)
    _, records = decode_batch_owned(mutable)
    mutable[-1:] = b"!"  # the caller may reuse its buffer: the bodies do not change
    assert records[0][3] == b"abc"


def _record(kind: int, length: int, body: bytes = b"") -> bytes:
    return RECORD_HEADER.pack(kind, slot_id(0, 1), 1, length) + body


def _raw(count: int, tail: bytes) -> bytes:
    return struct.pack(">BBHQI", 2, 0, count, 1, 0) + tail


@pytest.mark.parametrize(
    ("payload", "refusal"),
    [
        (b"\x02\x00", TruncatedBatch),  # shorter than the header
        (_raw(1, b""), RecordCountMismatch),  # counts a record the batch does not hold
        (_raw(1, _record(0, 3, b"ab")), RecordOverrun),  # the last body ends past the end
        (_raw(2, _record(0, 40, b"abc") + _record(0, 0)), RecordOverrun),  # a middle one does
        (_raw(2, _record(0, 1, b"a") + b"\x00\x00"), TruncatedBatch),  # inside a header
        (_raw(1, _record(0, 1, b"a") + b"zz"), RecordCountMismatch),  # trailing bytes
        (_raw(0, b"z"), RecordCountMismatch),  # trailing bytes after no records
        (_raw(1, _record(9, 0)), UnknownRecordType),
        (_raw(1, _record(int(RecordType.CREDIT_UPDATE), 2, b"ab")), BadRecordBody),
        (_raw(1, _record(int(RecordType.CLOSE_SLOT), 1, b"\x09")), BadRecordBody),
    ],
)
def test_each_refusal_is_the_strict_decoders(payload: bytes, refusal: type[Exception]) -> None:
    with pytest.raises(refusal) as caught:
        decode_batch_owned(payload)
    with pytest.raises(refusal) as strict:
        decode_batch(payload)
    assert str(caught.value) == str(strict.value)


def test_a_batch_larger_than_an_eager_one_decodes_the_same_from_any_buffer() -> None:
    big = bytes(range(256)) * 400  # 100 KiB: a staged singleton's size
    payload = _batch([(0, slot_id(2, 3), 7, big), (0, slot_id(4, 1), 1, b"tail")])
    for given_as in (payload, bytearray(payload), memoryview(b"x" + payload)[1:]):
        header, records = decode_batch_owned(given_as)
        assert header.record_count == 2
        assert records == [(0, slot_id(2, 3), 7, big), (0, slot_id(4, 1), 1, b"tail")]
        assert all(type(body) is bytes for _, _, _, body in records)
    cut = memoryview(payload)[:-1]
    with pytest.raises(RecordOverrun) as caught:
        decode_batch_owned(cut)
    with pytest.raises(RecordOverrun) as strict:
        decode_batch(cut)
    assert str(caught.value) == str(strict.value)
