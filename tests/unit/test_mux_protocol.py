"""The mux wire codec: exact bytes, round trips, and refusal of every malformed batch."""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import pickle
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velomux_quic.mux.protocol import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    COALESCE_THRESHOLD,
    MAX_LANES,
    MAX_RECORDS,
    MIN_BATCH_CAP,
    MUX_VERSION,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    BadRecordBody,
    BadVersion,
    BatchBuilder,
    BatchHeader,
    BytesLike,
    CloseReason,
    EncodableRecord,
    LifecycleAction,
    MalformedBatch,
    Record,
    RecordCountMismatch,
    RecordOverrun,
    RecordType,
    TruncatedBatch,
    UnknownRecordType,
    batch_cap,
    batch_handler,
    close_slot_body,
    credit_body,
    decode_batch,
    decode_close_slot,
    decode_credit,
    decode_header,
    decode_lifecycle,
    decode_open_slot,
    encode_batch,
    lifecycle_body,
    open_slot_body,
    seq_after,
    seq_distance,
    slot_generation,
    slot_id,
    slot_index,
)

from .twins import each_twin

builder_twin = each_twin("velomux_quic.mux.batch_codec", "BatchBuilder")
"""The builder tests run against both twins of the record path."""

U32 = 2**32 - 1
U64 = 2**64 - 1

# -- the golden batch -------------------------------------------------------------
#
# Lane 3, epoch 7, batch_seq 2**32-1, one record of each type. Written out byte by
# byte from the layout, so the encoder is checked against the chapter, not itself.

GOLDEN_HEADER = BatchHeader(lane=3, record_count=6, peer_epoch=7, batch_seq=U32)
GOLDEN_RECORDS: list[EncodableRecord] = [
    (RecordType.DATA, 0x0000_0100, 1, b"hello"),
    (RecordType.OPEN_SLOT, 0x0000_0201, 0, open_slot_body(0x0102030405060708, 0x1112131415161718)),
    (RecordType.CLOSE_SLOT, 0x0000_0100, 2, close_slot_body(CloseReason.PEER_GONE)),
    (RecordType.CREDIT_UPDATE, 0xFFFF_FFFF, 0, credit_body(32)),
    (RecordType.SLOT_HEARTBEAT, 0x0000_0302, 5, b""),
    (RecordType.LIFECYCLE_SLOT, 0x0000_0201, 0, lifecycle_body(0x1112131415161718, 1)),
]
GOLDEN = bytes.fromhex(
    # header: version 2, flags = lane 3, 6 records, epoch 7, batch_seq 2**32-1
    "02 03 0006 0000000000000007 ffffffff"
    # Data, slot (index 1, gen 0), frame_seq 1, len 5, "hello"
    "00 00000100 00000001 00000005 68656c6c6f"
    # OpenSlot, slot (index 2, gen 1), frame_seq 0, len 16, anchor id, session id
    "01 00000201 00000000 00000010 0102030405060708 1112131415161718"
    # CloseSlot, slot (index 1, gen 0), frame_seq 2, len 1, reason 1 (peer gone)
    "02 00000100 00000002 00000001 01"
    # CreditUpdate, slot (index 0xffffff, gen 0xff), frame_seq 0, len 4, delta 32
    "03 ffffffff 00000000 00000004 00000020"
    # SlotHeartbeat, slot (index 3, gen 2), frame_seq 5, len 0
    "04 00000302 00000005 00000000"
    # LifecycleSlot, slot (index 2, gen 1), frame_seq 0, len 9, session, action 1 (cancel)
    "05 00000201 00000000 00000009 1112131415161718 01"
)
# Offsets into GOLDEN used by the corruption tests.
FLAGS_AT = 1
COUNT_AT = 2
FIRST_RECORD_AT = 16
LAST_RECORD_AT = len(GOLDEN) - RECORD_HEADER_SIZE - 9


def patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


def raw_batch(
    records: list[tuple[int, int, int, bytes]],
    *,
    count: int | None = None,
    flags: int = 0,
    version: int = MUX_VERSION,
) -> bytes:
    """A batch built with struct alone, so tests can write what the encoder refuses."""
    out = BATCH_HEADER.pack(version, flags, len(records) if count is None else count, 1, 0)
    for record_type, slot, frame_seq, body in records:
        out += RECORD_HEADER.pack(record_type, slot, frame_seq, len(body)) + body
    return out


def assert_well_formed(data: bytes, header: BatchHeader, records: list[Record]) -> None:
    """What a caller may rely on for any batch decode_batch accepts."""
    assert 0 <= header.lane < MAX_LANES
    assert header.record_count == len(records)
    assert 0 <= header.peer_epoch <= U64 and 0 <= header.batch_seq <= U32
    for record_type, slot, frame_seq, body in records:
        assert record_type in set(RecordType)
        assert 0 <= slot <= U32 and 0 <= frame_seq <= U32
        assert type(body) is memoryview and body.obj is data  # zero-copy
        if record_type == RecordType.OPEN_SLOT:
            decode_open_slot(body)
        elif record_type == RecordType.CLOSE_SLOT:
            decode_close_slot(body)
        elif record_type == RecordType.CREDIT_UPDATE:
            decode_credit(body)
        elif record_type == RecordType.LIFECYCLE_SLOT:
            decode_lifecycle(body)
        elif record_type == RecordType.SLOT_HEARTBEAT:
            assert len(body) == 0
    # Decoding loses nothing but the reserved flag bits.
    expected = data[:FLAGS_AT] + bytes([data[FLAGS_AT] & 0x0F]) + data[FLAGS_AT + 1 :]
    assert encode_batch(header, records) == expected


def decode_or_refuse(data: bytes) -> type[MalformedBatch] | None:
    """Decode ``data``; a refusal must be a MalformedBatch, anything else fails the test."""
    try:
        header, records = decode_batch(data)
    except MalformedBatch as exc:
        return type(exc)
    assert_well_formed(data, header, records)
    return None


# -- constants and small helpers -----------------------------------------------------


def test_constants() -> None:
    assert MUX_VERSION == 2
    assert BATCH_HEADER.format == ">BBHQI" and BATCH_HEADER.size == BATCH_HEADER_SIZE == 16
    assert RECORD_HEADER.format == ">BIII" and RECORD_HEADER.size == RECORD_HEADER_SIZE == 13
    assert MAX_RECORDS == 65_535
    assert MIN_BATCH_CAP == 29 == BATCH_HEADER_SIZE + RECORD_HEADER_SIZE
    assert COALESCE_THRESHOLD == 64 * 1024
    assert MAX_LANES == 16
    assert BatchHeader.version == MUX_VERSION


def test_enum_values() -> None:
    assert [(t.name, t.value) for t in RecordType] == [
        ("DATA", 0),
        ("OPEN_SLOT", 1),
        ("CLOSE_SLOT", 2),
        ("CREDIT_UPDATE", 3),
        ("SLOT_HEARTBEAT", 4),
        ("LIFECYCLE_SLOT", 5),
    ]
    assert [(r.name, r.value) for r in CloseReason] == [
        ("TERMINAL_SENT", 0),
        ("PEER_GONE", 1),
        ("UNKNOWN_SLOT", 2),
        ("PROTOCOL_ERROR", 3),
    ]
    assert [(a.name, a.value) for a in LifecycleAction] == [("STOP", 0), ("CANCEL", 1)]


def test_batch_handler_names() -> None:
    assert batch_handler(0) == "_stream_batch"
    assert batch_handler(1) == "_stream_batch.1"
    assert batch_handler(15) == "_stream_batch.15"
    for lane in (-1, 16):
        with pytest.raises(ValueError):
            batch_handler(lane)


def test_batch_cap_is_the_smallest_clamp_with_a_floor() -> None:
    assert batch_cap(60 * 1024, 1 << 20) == 60 * 1024
    assert batch_cap(1 << 20, 40_000) == 40_000
    assert batch_cap(1 << 20, 1 << 20) == COALESCE_THRESHOLD
    assert batch_cap(10, 1 << 20) == MIN_BATCH_CAP
    assert batch_cap(60 * 1024, 0) == MIN_BATCH_CAP


# -- slot ids ---------------------------------------------------------------------


def test_slot_id_layout() -> None:
    assert slot_id(0, 0) == 0
    assert slot_id(1, 0) == 0x100
    assert slot_id(2, 1) == 0x201
    assert slot_id(0xFFFFFF, 0xFF) == U32
    # The index is in the high bits, so ids sort by index whatever the generation.
    assert slot_id(1, 255) < slot_id(2, 0)


@given(st.integers(0, 0xFFFFFF), st.integers(0, 0xFF))
def test_slot_id_round_trip(index: int, generation: int) -> None:
    slot = slot_id(index, generation)
    assert 0 <= slot <= U32
    assert slot_index(slot) == index
    assert slot_generation(slot) == generation


@pytest.mark.parametrize(("index", "generation"), [(-1, 0), (1 << 24, 0), (0, -1), (0, 256)])
def test_slot_id_range_checks(index: int, generation: int) -> None:
    with pytest.raises(ValueError):
        slot_id(index, generation)


@pytest.mark.parametrize("slot", [-1, 2**32])
def test_slot_parts_range_checks(slot: int) -> None:
    with pytest.raises(ValueError):
        slot_index(slot)
    with pytest.raises(ValueError):
        slot_generation(slot)


# -- batch sequence numbers ----------------------------------------------------------


def test_seq_after_wraps() -> None:
    assert seq_after(1, 0)
    assert not seq_after(0, 1)
    assert not seq_after(5, 5)
    assert seq_after(0, U32)  # across the wrap
    assert not seq_after(U32, 0)
    assert seq_after(5, U32 - 5)
    assert seq_distance(0, U32) == 1
    assert seq_distance(U32, 0) == -1
    assert seq_distance(5, U32 - 5) == 11
    assert seq_distance(7, 7) == 0


def test_seq_half_range_is_unordered() -> None:
    # RFC 1982 leaves a pair exactly 2**31 apart undefined: neither is after.
    assert not seq_after(2**31, 0)
    assert not seq_after(0, 2**31)
    assert seq_after(2**31 - 1, 0)
    assert seq_after(0, 2**31 + 1)


@given(st.integers(0, U32), st.integers(-(2**31) + 1, 2**31 - 1))
def test_seq_distance_inverts_addition(base: int, step: int) -> None:
    ahead = (base + step) % 2**32
    assert seq_distance(ahead, base) == step
    assert seq_after(ahead, base) == (step > 0)
    assert seq_after(base, ahead) == (step < 0)


@pytest.mark.parametrize(("a", "b"), [(-1, 0), (0, -1), (2**32, 0), (0, 2**32)])
def test_seq_range_checks(a: int, b: int) -> None:
    with pytest.raises(ValueError):
        seq_distance(a, b)
    with pytest.raises(ValueError):
        seq_after(a, b)


# -- record bodies --------------------------------------------------------------------


def test_body_encodings() -> None:
    assert open_slot_body(1, 2) == bytes(7) + b"\x01" + bytes(7) + b"\x02"
    assert [close_slot_body(r) for r in CloseReason] == [b"\x00", b"\x01", b"\x02", b"\x03"]
    assert close_slot_body(2) == b"\x02"
    assert credit_body(0x01020304) == b"\x01\x02\x03\x04"
    assert lifecycle_body(0xAB, LifecycleAction.STOP) == bytes(7) + b"\xab\x00"
    assert lifecycle_body(0xAB, 1) == bytes(7) + b"\xab\x01"


@pytest.mark.parametrize(
    "call",
    [
        lambda: open_slot_body(-1, 0),
        lambda: open_slot_body(0, 2**64),
        lambda: close_slot_body(4),
        lambda: close_slot_body(-1),
        lambda: credit_body(2**32),
        lambda: credit_body(-1),
        lambda: lifecycle_body(2**64, 0),
        lambda: lifecycle_body(1, 2),
    ],
)
def test_body_encoders_refuse_out_of_range_values(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


@given(st.integers(0, U64), st.integers(0, U64))
def test_open_slot_body_round_trip(anchor_id: int, session_id: int) -> None:
    assert decode_open_slot(open_slot_body(anchor_id, session_id)) == (anchor_id, session_id)


@given(st.integers(0, U32))
def test_credit_body_round_trip(delta: int) -> None:
    assert decode_credit(credit_body(delta)) == delta


@given(st.integers(0, U64), st.sampled_from(LifecycleAction))
def test_lifecycle_body_round_trip(session: int, action: LifecycleAction) -> None:
    got = decode_lifecycle(lifecycle_body(session, action))
    assert got == (session, action)
    assert type(got[1]) is LifecycleAction


@pytest.mark.parametrize("reason", list(CloseReason))
def test_close_slot_body_round_trip(reason: CloseReason) -> None:
    got = decode_close_slot(close_slot_body(reason))
    assert got is reason


@pytest.mark.parametrize(
    ("decode", "body"),
    [
        (decode_open_slot, bytes(15)),
        (decode_open_slot, bytes(17)),
        (decode_close_slot, b""),
        (decode_close_slot, b"\x00\x00"),
        (decode_close_slot, b"\x04"),
        (decode_close_slot, b"\xff"),
        (decode_credit, bytes(3)),
        (decode_credit, bytes(5)),
        (decode_lifecycle, bytes(8)),
        (decode_lifecycle, bytes(10)),
        (decode_lifecycle, bytes(8) + b"\x02"),
    ],
)
def test_body_decoders_refuse_bad_bodies(
    decode: Callable[[BytesLike], object], body: bytes
) -> None:
    with pytest.raises(BadRecordBody):
        decode(body)
    with pytest.raises(BadRecordBody):
        decode(memoryview(body))


def test_body_decoders_accept_bytes_like() -> None:
    body = open_slot_body(3, 4)
    assert decode_open_slot(bytearray(body)) == (3, 4)
    assert decode_open_slot(memoryview(b"xx" + body)[2:]) == (3, 4)
    # A cast memoryview counts its length in items; the body still has 16 bytes.
    assert decode_open_slot(memoryview(body).cast("Q")) == (3, 4)


# -- the golden batch ---------------------------------------------------------------------


def test_golden_encode() -> None:
    assert len(GOLDEN) == 16 + 6 * 13 + 5 + 16 + 1 + 4 + 0 + 9
    assert encode_batch(GOLDEN_HEADER, GOLDEN_RECORDS) == GOLDEN


@pytest.mark.usefixtures("builder_twin")
def test_golden_builder() -> None:
    builder = BatchBuilder(COALESCE_THRESHOLD)
    for record in GOLDEN_RECORDS:
        builder.add(*record)
    assert builder.count == 6
    assert builder.size == len(GOLDEN)
    assert builder.finish(3, 7, U32) == GOLDEN


def test_golden_decode() -> None:
    header, records = decode_batch(GOLDEN)
    assert header == GOLDEN_HEADER
    assert [(t, s, f, bytes(b)) for t, s, f, b in records] == [
        (int(t), s, f, bytes(b)) for t, s, f, b in GOLDEN_RECORDS
    ]
    assert decode_open_slot(records[1][3]) == (0x0102030405060708, 0x1112131415161718)
    assert decode_close_slot(records[2][3]) is CloseReason.PEER_GONE
    assert decode_credit(records[3][3]) == 32
    assert decode_lifecycle(records[5][3]) == (0x1112131415161718, LifecycleAction.CANCEL)
    assert decode_header(GOLDEN) == GOLDEN_HEADER


def test_lane_zero_writes_flags_zero() -> None:
    data = encode_batch(BatchHeader(0, 0, 1, 0), [])
    assert data == b"\x02\x00\x00\x00" + bytes(7) + b"\x01" + bytes(4)


def test_decoded_bodies_are_zero_copy_slices() -> None:
    _, records = decode_batch(GOLDEN)
    for *_, body in records:
        assert type(body) is memoryview and body.obj is GOLDEN
    assert bytes(records[0][3]) == b"hello"


def test_decode_accepts_bytearray_and_memoryview() -> None:
    assert decode_batch(bytearray(GOLDEN))[0] == GOLDEN_HEADER
    framed = b"xyz" + GOLDEN + b"tail"
    header, records = decode_batch(memoryview(framed)[3 : 3 + len(GOLDEN)])
    assert header == GOLDEN_HEADER
    assert bytes(records[0][3]) == b"hello"
    assert records[0][3].obj is framed


# -- refusals -----------------------------------------------------------------------------


def test_protocol_errors_are_one_family_of_value_errors() -> None:
    for cls in (
        BadVersion,
        TruncatedBatch,
        RecordCountMismatch,
        RecordOverrun,
        UnknownRecordType,
        BadRecordBody,
    ):
        assert issubclass(cls, MalformedBatch)
    assert issubclass(MalformedBatch, ValueError)


@pytest.mark.parametrize("version", [0, 1, 3, 255])
def test_wrong_version(version: int) -> None:
    data = patched(GOLDEN, 0, bytes([version]))
    with pytest.raises(BadVersion) as info:
        decode_batch(data)
    assert info.value.header is None
    with pytest.raises(BadVersion):
        decode_header(data)


@pytest.mark.parametrize("length", range(BATCH_HEADER_SIZE))
def test_shorter_than_a_header(length: int) -> None:
    with pytest.raises(TruncatedBatch):
        decode_batch(GOLDEN[:length])
    with pytest.raises(TruncatedBatch):
        decode_header(GOLDEN[:length])


def test_record_count_larger_than_records_present() -> None:
    data = patched(GOLDEN, COUNT_AT, b"\x00\x07")
    with pytest.raises(RecordCountMismatch) as info:
        decode_batch(data)
    # The parsed header rides on the error, so the caller can count the drop.
    assert info.value.header == BatchHeader(3, 7, 7, U32)
    with pytest.raises(RecordCountMismatch):
        decode_batch(patched(GOLDEN, COUNT_AT, b"\xff\xff"))


def test_record_count_smaller_than_records_present() -> None:
    for count in (b"\x00\x05", b"\x00\x00"):
        with pytest.raises(RecordCountMismatch):
            decode_batch(patched(GOLDEN, COUNT_AT, count))


def test_trailing_bytes() -> None:
    with pytest.raises(RecordCountMismatch):
        decode_batch(GOLDEN + b"\x00")
    with pytest.raises(RecordCountMismatch):
        decode_batch(encode_batch(BatchHeader(0, 0, 1, 0), []) + b"\x00")


def test_truncated_inside_a_record_header() -> None:
    with pytest.raises(TruncatedBatch):
        decode_batch(GOLDEN[: FIRST_RECORD_AT + 5])


def test_record_len_past_the_end() -> None:
    len_at = LAST_RECORD_AT + 9
    with pytest.raises(RecordOverrun):
        decode_batch(patched(GOLDEN, len_at, b"\x00\x00\x00\x0a"))
    with pytest.raises(RecordOverrun):
        decode_batch(patched(GOLDEN, FIRST_RECORD_AT + 9, b"\xff\xff\xff\xff"))
    with pytest.raises(RecordOverrun):
        decode_batch(GOLDEN[:-1])


@pytest.mark.parametrize("record_type", [6, 7, 0x80, 0xFF])
def test_unknown_record_type_refuses_the_batch(record_type: int) -> None:
    data = raw_batch([(0, 0x100, 1, b"ok"), (record_type, 0x100, 2, b"??"), (0, 0x100, 3, b"")])
    with pytest.raises(UnknownRecordType) as info:
        decode_batch(data)
    assert info.value.header is not None and info.value.header.record_count == 3


@pytest.mark.parametrize(
    ("record_type", "body"),
    [
        (RecordType.OPEN_SLOT, bytes(15)),
        (RecordType.OPEN_SLOT, bytes(17)),
        (RecordType.CLOSE_SLOT, b""),
        (RecordType.CLOSE_SLOT, b"\x00\x00"),
        (RecordType.CLOSE_SLOT, b"\x04"),
        (RecordType.CREDIT_UPDATE, bytes(3)),
        (RecordType.SLOT_HEARTBEAT, b"\x00"),
        (RecordType.LIFECYCLE_SLOT, bytes(8)),
        (RecordType.LIFECYCLE_SLOT, bytes(8) + b"\x02"),
    ],
)
@pytest.mark.usefixtures("builder_twin")
def test_bad_control_body_refuses_the_batch(record_type: RecordType, body: bytes) -> None:
    with pytest.raises(BadRecordBody):
        decode_batch(raw_batch([(0, 0x100, 1, b"ok"), (record_type, 0x100, 2, body)]))
    # The encoder will not write what the decoder refuses.
    with pytest.raises(ValueError):
        encode_batch(BatchHeader(0, 0, 1, 0), [(record_type, 0x100, 2, body)])
    with pytest.raises(ValueError):
        BatchBuilder(COALESCE_THRESHOLD).add(record_type, 0x100, 2, body)


@pytest.mark.parametrize("flags", [0x13, 0x83, 0xF3])
def test_nonzero_high_flag_bits_are_ignored(flags: int) -> None:
    header, records = decode_batch(patched(GOLDEN, FLAGS_AT, bytes([flags])))
    assert header == GOLDEN_HEADER
    assert len(records) == 6


def test_protocol_error_pickles_with_its_header() -> None:
    with pytest.raises(RecordCountMismatch) as info:
        decode_batch(GOLDEN + b"\x00")
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is RecordCountMismatch
    assert copy.header == GOLDEN_HEADER
    assert str(copy) == str(info.value)


# -- fuzzing: nothing but a MalformedBatch ever escapes ---------------------------------------


def test_every_truncation_is_refused() -> None:
    for length in range(len(GOLDEN)):
        assert decode_or_refuse(GOLDEN[:length]) is not None, length


def test_every_single_byte_corruption() -> None:
    refused = accepted = 0
    for offset in range(len(GOLDEN)):
        for value in range(256):
            if value == GOLDEN[offset]:
                continue
            if decode_or_refuse(patched(GOLDEN, offset, bytes([value]))) is None:
                accepted += 1
            else:
                refused += 1
    # Both outcomes occur: payload and id bytes are free, framing bytes are not.
    assert refused and accepted


u32s = st.integers(0, U32)
u64s = st.integers(0, U64)

records_strategy = st.one_of(
    st.tuples(st.just(0), u32s, u32s, st.binary(max_size=64)),
    st.tuples(st.just(1), u32s, u32s, st.builds(open_slot_body, u64s, u64s)),
    st.tuples(st.just(2), u32s, u32s, st.sampled_from(CloseReason).map(close_slot_body)),
    st.tuples(st.just(3), u32s, u32s, u32s.map(credit_body)),
    st.tuples(st.just(4), u32s, u32s, st.just(b"")),
    st.tuples(
        st.just(5), u32s, u32s, st.builds(lifecycle_body, u64s, st.sampled_from(LifecycleAction))
    ),
)
headers_strategy = st.builds(
    BatchHeader,
    lane=st.integers(0, MAX_LANES - 1),
    record_count=st.just(0),
    peer_epoch=u64s,
    batch_seq=u32s,
)


@given(headers_strategy, st.lists(records_strategy, max_size=30))
def test_round_trip(header: BatchHeader, records: list[tuple[int, int, int, bytes]]) -> None:
    data = encode_batch(header, records)
    assert len(data) == 16 + sum(13 + len(body) for *_, body in records)
    got_header, got_records = decode_batch(data)
    assert got_header == BatchHeader(header.lane, len(records), header.peer_epoch, header.batch_seq)
    assert [(t, s, f, bytes(b)) for t, s, f, b in got_records] == records
    assert_well_formed(data, got_header, got_records)


@given(headers_strategy, st.lists(records_strategy, max_size=30))
@pytest.mark.usefixtures("builder_twin")
def test_builder_matches_encode_batch(
    header: BatchHeader, records: list[tuple[int, int, int, bytes]]
) -> None:
    builder = BatchBuilder(COALESCE_THRESHOLD)
    builder.add(0, 1, 1, b"left over from the previous batch")
    builder.reset()
    for record in records:
        builder.add(*record)
    expected = encode_batch(header, records)
    assert builder.size == len(expected)
    assert builder.count == len(records)
    assert builder.finish(header.lane, header.peer_epoch, header.batch_seq) == expected


@given(
    headers_strategy,
    st.lists(records_strategy, min_size=1, max_size=10),
    st.data(),
)
def test_damaged_batches_decode_or_raise_protocol_error(
    header: BatchHeader, records: list[tuple[int, int, int, bytes]], data: st.DataObject
) -> None:
    wire = bytearray(encode_batch(header, records))
    for _ in range(data.draw(st.integers(1, 4))):
        offset = data.draw(st.integers(0, len(wire) - 1))
        action = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        if action == "set":
            wire[offset] = data.draw(st.integers(0, 255))
        elif action == "insert":
            wire[offset:offset] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del wire[offset : offset + data.draw(st.integers(1, 8))]
        else:
            del wire[offset:]
        if not wire:
            break
    decode_or_refuse(bytes(wire))


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    decode_or_refuse(data)


@settings(max_examples=500)
@given(st.integers(0, 255), st.integers(0, 8), st.binary(max_size=200))
def test_arbitrary_records_decode_or_raise_protocol_error(
    flags: int, count: int, tail: bytes
) -> None:
    # Past the version check, so the record walk itself is fuzzed.
    decode_or_refuse(BATCH_HEADER.pack(MUX_VERSION, flags, count, 1, 2) + tail)


# -- encoder checks -----------------------------------------------------------------------


def test_encode_batch_writes_the_record_count_from_the_records() -> None:
    data = encode_batch(BatchHeader(0, 99, 1, 0), [(0, 1, 1, b"a")])
    assert decode_batch(data)[0].record_count == 1


def test_encode_batch_record_cap() -> None:
    header = BatchHeader(0, 0, 1, 0)
    empty: EncodableRecord = (RecordType.SLOT_HEARTBEAT, 0, 0, b"")
    data = encode_batch(header, [empty] * MAX_RECORDS)
    assert decode_batch(data)[0].record_count == MAX_RECORDS
    with pytest.raises(ValueError):
        encode_batch(header, [empty] * (MAX_RECORDS + 1))


@pytest.mark.parametrize(
    ("header", "record"),
    [
        (BatchHeader(16, 0, 1, 0), (0, 0, 0, b"")),
        (BatchHeader(-1, 0, 1, 0), (0, 0, 0, b"")),
        (BatchHeader(0, 0, 2**64, 0), (0, 0, 0, b"")),
        (BatchHeader(0, 0, -1, 0), (0, 0, 0, b"")),
        (BatchHeader(0, 0, 1, 2**32), (0, 0, 0, b"")),
        (BatchHeader(0, 0, 1, 0), (6, 0, 0, b"")),
        (BatchHeader(0, 0, 1, 0), (-1, 0, 0, b"")),
        (BatchHeader(0, 0, 1, 0), (0, 2**32, 0, b"")),
        (BatchHeader(0, 0, 1, 0), (0, -1, 0, b"")),
        (BatchHeader(0, 0, 1, 0), (0, 0, 2**32, b"")),
    ],
)
@pytest.mark.usefixtures("builder_twin")
def test_encoders_refuse_out_of_range_fields(header: BatchHeader, record: EncodableRecord) -> None:
    with pytest.raises(ValueError):
        encode_batch(header, [record])
    builder = BatchBuilder(COALESCE_THRESHOLD)
    with pytest.raises(ValueError):
        builder.add(*record)
        builder.finish(header.lane, header.peer_epoch, header.batch_seq)


@pytest.mark.usefixtures("builder_twin")
def test_encoders_count_memoryview_bodies_in_bytes() -> None:
    wide = memoryview(b"abcdefgh").cast("I")
    assert len(wide) == 2
    data = encode_batch(BatchHeader(0, 0, 1, 0), [(0, 1, 1, wide)])
    builder = BatchBuilder(COALESCE_THRESHOLD)
    builder.add(0, 1, 1, wide)
    assert builder.finish(0, 1, 0) == data
    assert bytes(decode_batch(data)[1][0][3]) == b"abcdefgh"
    # A control body given as a cast view is checked by its byte length too.
    credit = memoryview(credit_body(9)).cast("I")
    assert len(credit) == 1
    builder.reset()
    builder.add(RecordType.CREDIT_UPDATE, 1, 0, credit)
    assert decode_credit(decode_batch(builder.finish(0, 1, 0))[1][0][3]) == 9


# -- BatchBuilder ----------------------------------------------------------------------------


@pytest.mark.usefixtures("builder_twin")
def test_builder_refuses_a_cap_below_the_minimum() -> None:
    with pytest.raises(ValueError):
        BatchBuilder(MIN_BATCH_CAP - 1)
    assert BatchBuilder(MIN_BATCH_CAP).cap == MIN_BATCH_CAP


@pytest.mark.usefixtures("builder_twin")
def test_builder_fits_honours_the_byte_cap() -> None:
    builder = BatchBuilder(MIN_BATCH_CAP)
    assert builder.size == BATCH_HEADER_SIZE and builder.count == 0
    # The minimum cap holds exactly one empty record: control can always go inline.
    assert builder.fits(0)
    assert not builder.fits(1)
    builder.add(RecordType.SLOT_HEARTBEAT, 1, 0, b"")
    assert builder.size == MIN_BATCH_CAP
    assert not builder.fits(0)

    cap = BATCH_HEADER_SIZE + (RECORD_HEADER_SIZE + 5) + RECORD_HEADER_SIZE + 4
    builder = BatchBuilder(cap)
    builder.add(0, 1, 1, b"12345")
    assert builder.fits(4)
    assert not builder.fits(5)
    builder.add(RecordType.CREDIT_UPDATE, 1, 0, credit_body(1))
    assert builder.size == cap
    assert not builder.fits(0)


@pytest.mark.usefixtures("builder_twin")
def test_builder_fits_honours_the_record_cap() -> None:
    builder = BatchBuilder(1 << 30)
    for _ in range(MAX_RECORDS):
        builder.add(RecordType.SLOT_HEARTBEAT, 1, 0, b"")
    assert builder.count == MAX_RECORDS
    assert not builder.fits(0)
    size = builder.size
    with pytest.raises(ValueError):
        builder.add(RecordType.SLOT_HEARTBEAT, 1, 0, b"")
    assert builder.count == MAX_RECORDS and builder.size == size
    header, records = decode_batch(builder.finish(0, 1, 0))
    assert header.record_count == len(records) == MAX_RECORDS


@pytest.mark.usefixtures("builder_twin")
def test_builder_takes_a_singleton_over_the_cap() -> None:
    # A record above the cap travels alone (by rendezvous); fits() says no, add() still works.
    builder = BatchBuilder(MIN_BATCH_CAP)
    assert not builder.fits(100_000)
    builder.add(0, 1, 1, bytes(100_000))
    header, records = decode_batch(builder.finish(2, 5, 6))
    assert header == BatchHeader(2, 1, 5, 6)
    assert len(records[0][3]) == 100_000
    builder.reset()
    assert builder.size == BATCH_HEADER_SIZE and builder.count == 0
    assert builder.fits(0)


@pytest.mark.usefixtures("builder_twin")
def test_builder_reset_and_reuse() -> None:
    builder = BatchBuilder(COALESCE_THRESHOLD)
    builder.add(0, 1, 1, b"first")
    first = builder.finish(0, 1, 0)
    # finish() leaves the records in place until reset().
    assert builder.count == 1 and builder.size == len(first)
    assert builder.finish(0, 1, 0) == first
    builder.reset()
    builder.add(0, 2, 1, b"second")
    second = builder.finish(1, 1, 1)
    assert second == encode_batch(BatchHeader(1, 1, 1, 1), [(0, 2, 1, b"second")])
    assert first == encode_batch(BatchHeader(0, 1, 1, 0), [(0, 1, 1, b"first")])


@pytest.mark.usefixtures("builder_twin")
def test_builder_finish_of_an_empty_batch() -> None:
    assert BatchBuilder(MIN_BATCH_CAP).finish(0, 1, 0) == encode_batch(BatchHeader(0, 0, 1, 0), [])


@pytest.mark.usefixtures("builder_twin")
def test_failed_add_leaves_the_batch_unchanged() -> None:
    builder = BatchBuilder(COALESCE_THRESHOLD)
    builder.add(0, 1, 1, b"kept")
    size = builder.size
    with pytest.raises(ValueError):
        builder.add(0, -1, 2, b"bad slot")
    with pytest.raises(TypeError):
        builder.add(0, 1, 2, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        builder.add(RecordType.CLOSE_SLOT, 1, 2, b"\x09")
    assert builder.size == size and builder.count == 1
    assert builder.finish(0, 1, 0) == encode_batch(BatchHeader(0, 1, 1, 0), [(0, 1, 1, b"kept")])


@given(st.integers(0, 0xFFFF_FFFF), st.integers(0, 0xFFFF_FFFF))
@pytest.mark.usefixtures("builder_twin")
def test_add_credit_writes_the_credit_record_add_writes(slot: int, delta: int) -> None:
    checked = BatchBuilder(COALESCE_THRESHOLD)
    checked.add(RecordType.CREDIT_UPDATE, slot, 0, credit_body(delta))
    unchecked = BatchBuilder(COALESCE_THRESHOLD)
    unchecked.add_credit(slot, delta)
    assert unchecked.count == checked.count == 1
    assert unchecked.finish(3, 7, 9) == checked.finish(3, 7, 9)
    _, records = decode_batch(unchecked.finish(3, 7, 9))
    assert [(t, s, q, decode_credit(b)) for t, s, q, b in records] == [
        (RecordType.CREDIT_UPDATE, slot, 0, delta)
    ]


@pytest.mark.parametrize(("slot", "delta"), [(-1, 1), (1 << 32, 1), (1, -1), (1, 1 << 32)])
@pytest.mark.usefixtures("builder_twin")
def test_add_credit_refuses_a_field_past_a_u32_and_keeps_the_batch(slot: int, delta: int) -> None:
    builder = BatchBuilder(COALESCE_THRESHOLD)
    builder.add_credit(1, 2)
    size = builder.size
    with pytest.raises(struct.error):
        builder.add_credit(slot, delta)
    assert builder.size == size and builder.count == 1


@pytest.mark.parametrize(
    ("lane", "epoch", "seq"), [(16, 1, 0), (-1, 1, 0), (0, 2**64, 0), (0, 1, -1)]
)
@pytest.mark.usefixtures("builder_twin")
def test_builder_finish_range_checks(lane: int, epoch: int, seq: int) -> None:
    with pytest.raises(ValueError):
        BatchBuilder(MIN_BATCH_CAP).finish(lane, epoch, seq)
