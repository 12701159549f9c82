"""Properties of every decoder a peer's bytes reach: round trips, and structure-aware junk.

Two kinds of property, the hypothesis half of the fuzzing (the byte-level half is
``fuzz/targets.py``, run by ``tests/unit/test_fuzz_targets.py`` and ``make fuzz``):

* round trips: for every value an encoder accepts, ``decode(encode(x)) == x``;
* structure-aware junk: well-formed containers (a MessagePack array of fields, a JSON
  object of a peer record) holding arbitrary values, which a byte mutator rarely builds, and
  for which the decoder must still raise only its typed refusal.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgpack  # type: ignore[import-untyped]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.targets import CONTROL_MESSAGES
from velomux_quic.discovery import PeerRecord
from velomux_quic.errors import ControlDecodeError, FrameDecodeError, PeerRecordError
from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.messenger.envelope import (
    ErrorCode,
    Kind,
    StagedDescriptor,
    decode_envelope,
    decode_error,
    encode_envelope,
    encode_error,
)
from velomux_quic.mux.protocol import (
    BatchBuilder,
    BatchHeader,
    CloseReason,
    LifecycleAction,
    RecordType,
    close_slot_body,
    credit_body,
    decode_batch,
    decode_close_slot,
    decode_credit,
    decode_lifecycle,
    decode_open_slot,
    encode_batch,
    lifecycle_body,
    open_slot_body,
)
from velomux_quic.streaming.control import (
    AnchorAttachErr,
    AnchorAttachOk,
    AnchorAttachRequest,
    AnchorAttachResponse,
    AnchorRef,
    ControlMessage,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    MpscAnchorAttachResponse,
    MpscSenderRef,
    StreamControl,
    StreamOpenTicket,
)
from velomux_quic.streaming.frames import (
    FrameKind,
    decode_frame,
    encode_item,
    encode_sender_error,
    encode_transport_error,
)
from velomux_quic.transport.framing import FrameDecoder, encode_frames

EXAMPLES = int(os.environ.get("VELOMUX_FUZZ_EXAMPLES", "150"))
"""Examples per property: 150 in the default run (a few seconds for the file); ``make fuzz``
sets ``VELOMUX_FUZZ_EXAMPLES`` (FUZZ_EXAMPLES, default 5000) for its long run."""

FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u8 = st.integers(0, 0xFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, (1 << 64) - 1)
lanes = st.integers(0, 15)
handles = st.builds(StreamAnchorHandle.pack, u64, u64)
keys = st.text(max_size=20)

# -- mux batches -------------------------------------------------------------------------------

control_records = st.one_of(
    st.tuples(st.just(RecordType.OPEN_SLOT), st.builds(open_slot_body, u64, u64)),
    st.tuples(st.just(RecordType.CLOSE_SLOT), st.sampled_from(CloseReason).map(close_slot_body)),
    st.tuples(st.just(RecordType.CREDIT_UPDATE), u32.map(credit_body)),
    st.tuples(st.just(RecordType.SLOT_HEARTBEAT), st.just(b"")),
    st.tuples(
        st.just(RecordType.LIFECYCLE_SLOT),
        st.builds(lifecycle_body, u64, st.sampled_from(LifecycleAction)),
    ),
    st.tuples(st.just(RecordType.DATA), st.binary(max_size=64)),
)
records = st.lists(
    st.builds(
        lambda kind_body, slot, seq: (kind_body[0], slot, seq, kind_body[1]),
        control_records,
        u32,
        u32,
    ),
    max_size=12,
)


@FAST
@given(lanes, u64, u32, records)
def test_a_batch_round_trips_and_the_builder_writes_the_same_bytes(
    lane: int, epoch: int, seq: int, batch: list[tuple[int, int, int, bytes]]
) -> None:
    encoded = encode_batch(BatchHeader(lane, len(batch), epoch, seq), batch)
    header, decoded = decode_batch(encoded)
    assert header == BatchHeader(lane, len(batch), epoch, seq)
    assert [(t, s, q, bytes(b)) for t, s, q, b in decoded] == [
        (int(t), s, q, b) for t, s, q, b in batch
    ]
    builder = BatchBuilder(1 << 16)
    for record in batch:
        builder.add(*record)
    assert builder.finish(lane, epoch, seq) == encoded


@FAST
@given(u64, u64, st.sampled_from(CloseReason), u32, u64, st.sampled_from(LifecycleAction))
def test_control_bodies_round_trip(
    anchor: int, session: int, reason: CloseReason, delta: int, life: int, action: LifecycleAction
) -> None:
    assert decode_open_slot(open_slot_body(anchor, session)) == (anchor, session)
    assert decode_close_slot(close_slot_body(reason)) is reason
    assert decode_credit(credit_body(delta)) == delta
    assert decode_lifecycle(lifecycle_body(life, action)) == (life, action)


# -- lane frames -------------------------------------------------------------------------------


@FAST
@given(st.lists(st.binary(max_size=300), max_size=10), st.lists(st.integers(1, 64), min_size=1))
def test_frames_round_trip_however_the_stream_is_cut(bodies: list[bytes], cuts: list[int]) -> None:
    stream = encode_frames(bodies)
    decoder = FrameDecoder(300)
    frames: list[bytes] = []
    pos = turn = 0
    while pos < len(stream):
        size = cuts[turn % len(cuts)]
        frames += decoder.feed(stream[pos : pos + size])
        pos += size
        turn += 1
    assert frames == bodies
    assert decoder.buffered_bytes == 0


# -- envelopes and their contents --------------------------------------------------------------

handler_names = st.text(min_size=1, max_size=40).filter(lambda name: len(name.encode()) <= 255)
header_maps = st.none() | st.dictionaries(keys, st.text(max_size=40), max_size=4)


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(Kind))
    named = kind in (Kind.MESSAGE, Kind.SYNC, Kind.REQUEST)
    staged = kind not in (Kind.ERROR, Kind.ACK) and draw(st.booleans())
    return {
        "kind": kind,
        "handler": draw(handler_names) if named else "",
        "message_id": 0 if kind is Kind.MESSAGE else draw(st.integers(1, (1 << 64) - 1)),
        "headers": draw(header_maps),
        "payload": StagedDescriptor(draw(u64), draw(u64)).encode()
        if staged
        else draw(st.binary(max_size=64)),
        "staged": staged,
    }


@FAST
@given(envelopes())
def test_an_envelope_round_trips(fields: dict[str, Any]) -> None:
    envelope = decode_envelope(encode_envelope(**fields))
    assert envelope.kind is fields["kind"]
    assert envelope.handler == fields["handler"]
    assert envelope.message_id == fields["message_id"]
    assert envelope.headers == (fields["headers"] or None)
    assert bytes(envelope.payload) == fields["payload"]
    assert envelope.staged == fields["staged"]


@FAST
@given(st.sampled_from(ErrorCode), st.text(max_size=80), u64, u64)
def test_error_payloads_and_descriptors_round_trip(
    code: ErrorCode, message: str, staged_id: int, size: int
) -> None:
    assert decode_error(encode_error(code, message)) == (code, message)
    descriptor = StagedDescriptor(staged_id, size)
    assert StagedDescriptor.decode(descriptor.encode()) == descriptor


# -- control messages and tickets --------------------------------------------------------------

transport_keys = st.lists(keys, max_size=3).map(tuple)
attach_requests = st.builds(
    AnchorAttachRequest, handles, u64, st.tuples(u64, u64), transport_keys, st.none() | u64
)
mpsc_requests = st.builds(
    MpscAnchorAttachRequest, handles, u64, st.tuples(u64, u64), transport_keys, st.none() | u64
)
attach_oks = st.builds(AnchorAttachOk, keys, u64, u64, u32, u32, lanes)
mpsc_oks = st.builds(MpscAnchorAttachOk, keys, u64, u64, u64, u32, u32, lanes)
attach_errs = st.builds(AnchorAttachErr, st.text(max_size=40))
tickets = st.builds(
    StreamOpenTicket,
    keys,
    u64,
    u64,
    st.integers(1, 0xFFFF_FFFF),
    st.integers(1, 0xFFFF_FFFF),
    lanes,
)

MESSAGES: dict[type[ControlMessage], st.SearchStrategy[Any]] = {
    AnchorAttachRequest: attach_requests,
    MpscAnchorAttachRequest: mpsc_requests,
    AnchorAttachResponse: attach_oks | attach_errs,
    MpscAnchorAttachResponse: mpsc_oks | attach_errs,
    AnchorAttachOk: attach_oks,
    MpscAnchorAttachOk: mpsc_oks,
    AnchorAttachErr: attach_errs,
    AnchorRef: st.builds(AnchorRef, handles),
    MpscSenderRef: st.builds(MpscSenderRef, handles, u64),
    StreamControl: st.builds(StreamControl, u64),
    StreamOpenTicket: tickets,
}


def test_every_control_message_the_fuzz_target_decodes_has_a_round_trip_property() -> None:
    assert set(CONTROL_MESSAGES) | {StreamOpenTicket} == set(MESSAGES)


@FAST
@given(
    st.sampled_from(sorted(MESSAGES, key=lambda cls: cls.__name__)).flatmap(
        lambda cls: st.tuples(st.just(cls), MESSAGES[cls])
    )
)
def test_a_control_message_round_trips(case: tuple[type[ControlMessage], ControlMessage]) -> None:
    cls, message = case
    assert cls.decode(message.encode()) == message


# Values MessagePack can carry, including handle-shaped maps with the wrong contents.
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
wire_values = st.recursive(
    _leaves | st.fixed_dictionaries({"hi": _leaves, "lo": _leaves}),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@FAST
@given(
    st.sampled_from(sorted(MESSAGES, key=lambda cls: cls.__name__)),
    st.lists(wire_values, max_size=8),
    st.sampled_from(["", "Ok", "Err", "other"]),
)
def test_control_fields_of_any_type_are_a_control_decode_error(
    cls: type[ControlMessage], fields: list[object], tag: str
) -> None:
    body = msgpack.packb({tag: fields} if tag else fields)
    try:
        message = cls.decode(body)
    except ControlDecodeError:
        return
    assert cls.decode(message.encode()) == message


# -- stream frames -----------------------------------------------------------------------------

items = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=16,
)


@FAST
@given(items, st.text(max_size=40))
def test_stream_frames_round_trip(item: object, message: str) -> None:
    assert decode_frame(encode_item(item)) == (FrameKind.ITEM, item)
    assert decode_frame(encode_sender_error(message)) == (FrameKind.SENDER_ERROR, message)
    assert decode_frame(encode_transport_error(message)) == (FrameKind.TRANSPORT_ERROR, message)


@FAST
@given(wire_values)
def test_any_messagepack_value_is_a_frame_or_a_frame_decode_error(value: object) -> None:
    try:
        kind, _ = decode_frame(msgpack.packb(value))
    except FrameDecodeError:
        return
    # Only a variant name or a one-entry map of one decodes; anything else is refused.
    assert isinstance(value, str | dict)
    assert isinstance(kind, FrameKind)


# -- peer records ------------------------------------------------------------------------------

hosts = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
peer_records = st.builds(
    PeerRecord,
    st.uuids().map(InstanceId),
    st.tuples(hosts, st.integers(1, 65535)),
    name=st.text(max_size=20),
    lanes=st.integers(1, 16),
    updated_at=st.floats(min_value=0, max_value=1e12),
)


@FAST
@given(peer_records)
def test_a_peer_record_round_trips_through_its_stored_bytes(record: PeerRecord) -> None:
    assert PeerRecord.from_bytes(json.dumps(record.to_json()).encode()) == record


json_values = st.recursive(
    st.none()
    | st.booleans()
    # JSON integers have any length: past a u64 and past a float's range (1e308) too.
    | st.integers()
    | st.integers(-(10**500), 10**500)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
RECORD = PeerRecord(
    InstanceId.parse("6f1c2d3e-4b5a-4c6d-8e7f-901a2b3c4d5e"), ("10.0.0.7", 4433), updated_at=1.0
).to_json()
FIELDS = ["instance_id", "address", "host", "port", "name", "lanes", "updated_at"]


@FAST
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, min_size=1, max_size=3))
def test_peer_record_fields_of_any_json_value_are_a_peer_record_error(
    replaced: dict[str, object],
) -> None:
    obj: dict[str, Any] = {**RECORD, "address": dict(RECORD["address"])}
    for field, value in replaced.items():
        if field not in ("host", "port"):
            obj[field] = value
    for field, value in replaced.items():
        if field in ("host", "port") and isinstance(obj["address"], dict):
            obj["address"][field] = value
    try:
        record = PeerRecord.from_json(obj)
    except PeerRecordError:
        return
    assert PeerRecord.from_bytes(json.dumps(record.to_json()).encode()) == record
