"""The messenger envelope: wire layout, round trips, and refusal of every malformed body."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velomux_quic.errors import ConfigurationError
from velomux_quic.messenger.envelope import (
    DESCRIPTOR_SIZE,
    FIXED_HEADER_SIZE,
    HAS_HEADERS,
    KNOWN_FLAGS,
    MAX_HANDLER_NAME_SIZE,
    MAX_HEADER_VALUE_SIZE,
    MAX_HEADERS_SIZE,
    NAME_CACHE_MAX,
    STAGED,
    Envelope,
    ErrorCode,
    Kind,
    MalformedEnvelope,
    MessagePrefix,
    StagedDescriptor,
    decode_envelope,
    decode_error,
    encode_envelope,
    encode_error,
    handler_name_cache_size,
    message_prefix,
)
from velomux_quic.messenger.headers import HeaderCodec
from velomux_quic.mux.handlers import MUX_SLOT, MUX_SLOT_HEADER, MuxSlotRef

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1

NAMED_KINDS = (Kind.MESSAGE, Kind.SYNC, Kind.REQUEST)
REPLY_KINDS = (Kind.RESPONSE, Kind.ERROR, Kind.ACK)
ID_KINDS = (Kind.SYNC, Kind.REQUEST, Kind.RESPONSE, Kind.ERROR, Kind.ACK)
STAGEABLE_KINDS = (Kind.MESSAGE, Kind.SYNC, Kind.REQUEST, Kind.RESPONSE)

# Text UTF-8 can carry (no lone surrogates). 60 characters are at most 240 bytes,
# so every generated handler name fits the u8 name_len.
utf8_text = st.characters(codec="utf-8")
handler_names = st.text(utf8_text, min_size=1, max_size=60)
header_maps = st.dictionaries(
    st.text(utf8_text, max_size=24), st.text(utf8_text, max_size=64), max_size=6
)
u64s = st.integers(0, U64_MAX)
message_ids = st.integers(1, U64_MAX)
descriptors = st.builds(StagedDescriptor, u64s, u64s)


def fixed(
    kind: int, flags: int = 0, name_len: int = 0, message_id: int = 0, version: int = 1
) -> bytes:
    """A fixed header with any field values, valid or not."""
    return bytes((version, kind, flags, name_len)) + message_id.to_bytes(8, "big")


def headers_block(packed: bytes) -> bytes:
    return len(packed).to_bytes(2, "big") + packed


def check_accepted(env: Envelope, body: bytes) -> None:
    """Invariants every envelope the decoder returns must satisfy."""
    assert env.kind in Kind
    assert env.flags & ~KNOWN_FLAGS == 0
    if env.kind in NAMED_KINDS:
        assert 0 < len(env.handler.encode()) <= MAX_HANDLER_NAME_SIZE
    else:
        assert env.handler == ""
    assert (env.message_id == 0) == (env.kind is Kind.MESSAGE)
    assert (env.headers is not None) == bool(env.flags & HAS_HEADERS)
    if env.headers is not None:
        for name, value in env.headers.items():
            assert type(name) is str and type(value) is str
            assert len(value.encode()) <= MAX_HEADER_VALUE_SIZE
    assert env.payload.readonly
    assert env.payload.obj is body
    assert bytes(env.payload) == body[len(body) - env.payload.nbytes :]
    if env.staged:
        assert env.kind in STAGEABLE_KINDS
        assert env.payload.nbytes == DESCRIPTOR_SIZE
        assert env.descriptor is not None
    else:
        assert env.descriptor is None


def decode_or_refuse(body: bytes) -> Envelope | None:
    """Decode; a refusal must be MalformedEnvelope (any other exception fails the test)."""
    try:
        env = decode_envelope(body)
    except MalformedEnvelope as exc:
        assert str(exc)
        assert exc.field
        return None
    check_accepted(env, body)
    return env


# -- golden vectors -------------------------------------------------------------
# Each vector is written out field by field; a change here is a wire format change.

GOLDEN_REQUEST = (
    b"\x01\x02\x01\x04"  # version 1, REQUEST, flags HAS_HEADERS, name_len 4
    b"\x01\x02\x03\x04\x05\x06\x07\x08"  # message_id
    b"echo"  # handler
    b"\x00\x14"  # headers_len 20
    b"\x81"  # map of 1
    b"\xa9_mux_slot"  # str of 9
    b"\xa87:513:42"  # str of 8
    b"ping"  # payload
)

GOLDEN: list[tuple[dict[str, Any], bytes]] = [
    (
        {"kind": Kind.MESSAGE, "handler": "_stream_batch", "payload": b"\x02\x00\x01"},
        b"\x01\x00\x00\x0d"  # version, MESSAGE, no flags, name_len 13
        b"\x00\x00\x00\x00\x00\x00\x00\x00"  # message_id 0
        b"_stream_batch"
        b"\x02\x00\x01",
    ),
    (
        {"kind": Kind.SYNC, "handler": "audit", "message_id": 1, "payload": b"x"},
        b"\x01\x01\x00\x05\x00\x00\x00\x00\x00\x00\x00\x01auditx",
    ),
    (
        {
            "kind": Kind.REQUEST,
            "handler": "echo",
            "message_id": 0x0102030405060708,
            "headers": {"_mux_slot": "7:513:42"},
            "payload": b"ping",
        },
        GOLDEN_REQUEST,
    ),
    (
        {"kind": Kind.RESPONSE, "message_id": 0x0102030405060708, "payload": b"pong"},
        b"\x01\x03\x00\x00\x01\x02\x03\x04\x05\x06\x07\x08pong",
    ),
    (
        {
            "kind": Kind.ERROR,
            "message_id": 9,
            "payload": encode_error(ErrorCode.UNKNOWN_HANDLER, "nope"),
        },
        b"\x01\x04\x00\x00\x00\x00\x00\x00\x00\x00\x00\x09"
        b"\x92\xafunknown_handler\xa4nope",  # MessagePack ["unknown_handler", "nope"]
    ),
    (
        {"kind": Kind.ACK, "message_id": U64_MAX},
        b"\x01\x05\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff",
    ),
    (
        # A staged mux singleton: _mux_slot header, descriptor as the payload.
        {
            "kind": Kind.MESSAGE,
            "handler": "_stream_batch",
            "headers": {MUX_SLOT_HEADER: "3:16777473:99"},
            "payload": StagedDescriptor(0x1122, 300 << 20).encode(),
            "staged": True,
        },
        b"\x01\x00\x03\x0d"  # MESSAGE, flags HAS_HEADERS | STAGED
        b"\x00\x00\x00\x00\x00\x00\x00\x00"
        b"_stream_batch"
        b"\x00\x19\x81\xa9_mux_slot\xad3:16777473:99"  # headers_len 25
        b"\x00\x00\x00\x00\x00\x00\x11\x22"  # staged_id
        b"\x00\x00\x00\x00\x12\xc0\x00\x00",  # size 300 MiB
    ),
]


@pytest.mark.parametrize(
    ("fields", "wire"), GOLDEN, ids=lambda v: "" if isinstance(v, bytes) else v["kind"].name
)
def test_golden_vectors(fields: dict[str, Any], wire: bytes) -> None:
    assert encode_envelope(**fields) == wire
    env = decode_envelope(wire)
    assert env.kind is fields["kind"]
    assert env.handler == fields.get("handler", "")
    assert env.message_id == fields.get("message_id", 0)
    assert env.headers == fields.get("headers")
    assert env.payload == fields.get("payload", b"")
    assert env.staged is fields.get("staged", False)
    check_accepted(env, wire)


def test_golden_request_with_mux_slot_header() -> None:
    wire = encode_envelope(
        Kind.REQUEST,
        handler="echo",
        message_id=0x0102030405060708,
        headers={"_mux_slot": "7:513:42"},
        payload=b"ping",
    )
    assert wire == GOLDEN_REQUEST
    env = decode_envelope(wire)
    assert env.headers is not None
    assert MuxSlotRef.parse(env.headers[MUX_SLOT_HEADER]) == MuxSlotRef(7, 513, 42)


def test_golden_staged_descriptor() -> None:
    env = decode_envelope(GOLDEN[-1][1])
    assert env.descriptor == StagedDescriptor(0x1122, 300 << 20)


def test_fixed_header_size() -> None:
    assert FIXED_HEADER_SIZE == 12
    assert DESCRIPTOR_SIZE == 16
    assert (HAS_HEADERS, STAGED, KNOWN_FLAGS) == (1, 2, 3)
    assert [int(k) for k in Kind] == [0, 1, 2, 3, 4, 5]


# -- round trips ----------------------------------------------------------------


@st.composite
def envelope_fields(draw: st.DrawFn, kind: Kind) -> dict[str, Any]:
    fields: dict[str, Any] = {"kind": kind}
    if kind in NAMED_KINDS:
        fields["handler"] = draw(handler_names)
    if kind is not Kind.MESSAGE:
        fields["message_id"] = draw(message_ids)
    fields["headers"] = draw(st.none() | header_maps)
    staged = kind in STAGEABLE_KINDS and draw(st.booleans())
    if staged:
        fields["staged"] = True
        fields["payload"] = draw(descriptors).encode()
    else:
        fields["payload"] = draw(st.binary(max_size=300))
    return fields


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@given(data=st.data())
def test_round_trip(kind: Kind, data: st.DataObject) -> None:
    fields = data.draw(envelope_fields(kind))
    wire = encode_envelope(**fields)
    env = decode_envelope(wire)
    check_accepted(env, wire)
    assert env.kind is kind
    assert env.handler == fields.get("handler", "")
    assert env.message_id == fields.get("message_id", 0)
    # An empty header map is sent as no headers at all.
    assert env.headers == (fields["headers"] or None)
    assert env.payload == fields["payload"]
    assert env.staged is fields.get("staged", False)
    if env.staged:
        assert env.descriptor == StagedDescriptor.decode(fields["payload"])


@given(handler=handler_names, payload=st.binary(max_size=300))
def test_message_prefix_matches_general_encoder(handler: str, payload: bytes) -> None:
    prefix = message_prefix(Kind.MESSAGE, handler)
    assert prefix + payload == encode_envelope(Kind.MESSAGE, handler=handler, payload=payload)
    assert len(prefix) == FIXED_HEADER_SIZE + len(handler.encode())
    assert decode_envelope(prefix + payload).payload == payload


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@given(data=st.data())
def test_message_prefix_class_matches_general_encoder(kind: Kind, data: st.DataObject) -> None:
    handler = data.draw(handler_names) if kind in NAMED_KINDS else ""
    message_id = 0 if kind is Kind.MESSAGE else data.draw(message_ids)
    payload = data.draw(st.binary(max_size=64))
    expected = encode_envelope(kind, handler=handler, message_id=message_id, payload=payload)

    encoder = MessagePrefix(kind, handler)
    assert encoder.kind is kind
    assert encoder.handler == handler
    assert encoder.encode(message_id, payload) == expected
    assert encoder.encode(message_id, memoryview(payload)) == expected
    assert encoder.header(message_id) + payload == expected
    assert encoder.size == len(expected) - len(payload)

    buffer = bytearray(b"\xee" * (3 + len(expected)))
    end = encoder.pack_into(buffer, 3, message_id)
    assert end == 3 + encoder.size
    buffer[end:] = payload
    assert buffer[:3] == b"\xee" * 3
    assert bytes(buffer[3:]) == expected


def test_payload_is_a_zero_copy_view() -> None:
    body = encode_envelope(Kind.RESPONSE, message_id=5, payload=b"x" * 4096)
    env = decode_envelope(body)
    assert env.payload.obj is body
    assert env.payload.readonly
    payload = env.payload
    del body, env
    assert payload == b"x" * 4096  # the view keeps the frame alive


def test_memoryview_payload_is_encoded_by_bytes() -> None:
    view = memoryview(bytearray(b"abcdefgh")).cast("I")  # 2 items, 8 bytes
    wire = encode_envelope(Kind.RESPONSE, message_id=1, payload=view)
    assert bytes(decode_envelope(wire).payload) == b"abcdefgh"


def test_empty_headers_are_no_headers() -> None:
    assert encode_envelope(Kind.ACK, message_id=1, headers={}) == encode_envelope(
        Kind.ACK, message_id=1
    )


def test_empty_header_map_on_the_wire_is_accepted() -> None:
    env = decode_envelope(fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\x80"))
    assert env.headers == {}


def test_longest_handler_name() -> None:
    name = "é" * 127 + "a"  # 255 UTF-8 bytes
    env = decode_envelope(encode_envelope(Kind.SYNC, handler=name, message_id=1))
    assert env.handler == name


def test_largest_headers() -> None:
    headers = {f"k{i:02}": "v" * MAX_HEADER_VALUE_SIZE for i in range(16)}
    excess = len(msgpack.packb(headers)) - MAX_HEADERS_SIZE
    headers["k15"] = "v" * (MAX_HEADER_VALUE_SIZE - excess)
    assert len(msgpack.packb(headers)) == MAX_HEADERS_SIZE
    wire = encode_envelope(Kind.MESSAGE, handler="h", headers=headers, payload=b"p")
    assert decode_envelope(wire).headers == headers


def test_handler_names_are_interned_and_the_cache_is_bounded() -> None:
    wire = encode_envelope(Kind.MESSAGE, handler="_stream_batch")
    assert decode_envelope(wire).handler is decode_envelope(wire).handler
    limit = NAME_CACHE_MAX
    for i in range(3 * limit):
        assert decode_envelope(message_prefix(Kind.MESSAGE, f"h{i}")).handler == f"h{i}"
        assert 0 < handler_name_cache_size() <= limit
    # A name that failed to decode is never cached.
    decode_envelope(message_prefix(Kind.MESSAGE, "h0"))  # the cache holds at least one more
    before = handler_name_cache_size()
    assert before < limit  # so a cached bad name would be seen to grow it
    with pytest.raises(MalformedEnvelope):
        decode_envelope(fixed(Kind.MESSAGE, 0, 1) + b"\xff")
    assert handler_name_cache_size() == before


# -- fuzzing --------------------------------------------------------------------

# Valid envelopes whose every truncation and every single-byte change is decoded.
CORPUS = [wire for _, wire in GOLDEN] + [
    encode_envelope(
        Kind.SYNC,
        handler="ünïcødé",
        message_id=U64_MAX,
        headers={"a": "", "": "b", "ключ": "значение"},
        payload=b"\x00" * 20,
    ),
    encode_envelope(
        Kind.RESPONSE,
        message_id=7,
        headers={"k": "v" * 40},
        payload=StagedDescriptor(1, 2).encode(),
        staged=True,
    ),
]


@pytest.mark.parametrize("wire", CORPUS, ids=range(len(CORPUS)))
def test_every_truncation_is_refused(wire: bytes) -> None:
    for cut in range(len(wire)):
        env = decode_or_refuse(wire[:cut])
        # A shorter payload is still an envelope; anything cut before the payload is not.
        if env is not None:
            assert cut >= len(wire) - decode_envelope(wire).payload.nbytes


@pytest.mark.parametrize("wire", CORPUS, ids=range(len(CORPUS)))
def test_every_single_byte_corruption_decodes_or_is_refused(wire: bytes) -> None:
    body = bytearray(wire)
    for pos in range(len(wire)):
        original = body[pos]
        for value in range(256):
            if value != original:
                body[pos] = value
                decode_or_refuse(bytes(body))
        body[pos] = original


@given(st.binary(max_size=400))
def test_random_bytes_decode_or_are_refused(body: bytes) -> None:
    decode_or_refuse(body)


@given(
    version=st.sampled_from([1, 1, 1, 0, 2, 255]),
    kind=st.integers(0, 7),
    flags=st.sampled_from([0, 1, 2, 3]) | st.integers(0, 255),
    name_len=st.integers(0, 20),
    message_id=st.sampled_from([0, 1]) | u64s,
    rest=st.binary(max_size=80),
)
def test_plausible_headers_decode_or_are_refused(
    version: int, kind: int, flags: int, name_len: int, message_id: int, rest: bytes
) -> None:
    decode_or_refuse(fixed(kind, flags, name_len, message_id, version) + rest)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64_MAX)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(
    headers=msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True))
    | st.binary(max_size=80),
    stated=st.none() | st.integers(0, 0xFFFF),
    payload=st.binary(max_size=20),
)
def test_arbitrary_header_blocks_decode_or_are_refused(
    headers: bytes, stated: int | None, payload: bytes
) -> None:
    length = len(headers) if stated is None else stated
    body = fixed(Kind.REQUEST, HAS_HEADERS, 1, 1) + b"h" + length.to_bytes(2, "big") + headers
    decode_or_refuse(body + payload)


# -- each rejection -------------------------------------------------------------

REJECTIONS: list[tuple[str, bytes, str, str]] = [
    ("empty", b"", "header", "fixed header needs 12"),
    ("short header", fixed(Kind.ACK, 0, 0, 1)[:11], "header", "11 bytes"),
    ("version 0", fixed(Kind.ACK, 0, 0, 1, version=0), "version", "version 0"),
    ("version 2", fixed(Kind.ACK, 0, 0, 1, version=2), "version", "version 2"),
    ("unknown kind", fixed(6, 0, 0, 1), "kind", "unknown kind 6"),
    ("kind 255", fixed(255, 0, 0, 1), "kind", "unknown kind 255"),
    ("flag bit 2", fixed(Kind.ACK, 0x04, 0, 1), "flags", "0x04"),
    ("flag bit 7", fixed(Kind.ACK, 0x81, 0, 1), "flags", "0x80"),
    ("MESSAGE without a name", fixed(Kind.MESSAGE, 0, 0, 0), "name_len", "needs a handler"),
    ("SYNC without a name", fixed(Kind.SYNC, 0, 0, 1), "name_len", "needs a handler"),
    ("REQUEST without a name", fixed(Kind.REQUEST, 0, 0, 1), "name_len", "needs a handler"),
    ("name past the end", fixed(Kind.REQUEST, 0, 5, 1) + b"echo", "handler", "5 bytes stated"),
    ("name not UTF-8", fixed(Kind.REQUEST, 0, 2, 1) + b"\xc3\x28", "handler", "UTF-8"),
    ("name on RESPONSE", fixed(Kind.RESPONSE, 0, 1, 1) + b"x", "name_len", "must not name"),
    ("name on ERROR", fixed(Kind.ERROR, 0, 1, 1) + b"x", "name_len", "must not name"),
    ("name on ACK", fixed(Kind.ACK, 0, 1, 1) + b"x", "name_len", "must not name"),
    ("id on MESSAGE", fixed(Kind.MESSAGE, 0, 1, 5) + b"h", "message_id", "must be 0"),
    ("no id on SYNC", fixed(Kind.SYNC, 0, 1, 0) + b"h", "message_id", "non-zero"),
    ("no id on REQUEST", fixed(Kind.REQUEST, 0, 1, 0) + b"h", "message_id", "non-zero"),
    ("no id on RESPONSE", fixed(Kind.RESPONSE, 0, 0, 0), "message_id", "non-zero"),
    ("no id on ERROR", fixed(Kind.ERROR, 0, 0, 0), "message_id", "non-zero"),
    ("no id on ACK", fixed(Kind.ACK, 0, 0, 0), "message_id", "non-zero"),
    ("no headers_len", fixed(Kind.ACK, HAS_HEADERS, 0, 1) + b"\x00", "headers_len", "past the end"),
    (
        "headers past the end",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + b"\x00\x05\x81\xa1a",
        "headers_len",
        "5 bytes stated, 3 present",
    ),
    (
        "headers over 16 KiB",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + b"\x40\x01" + b"\x00" * 0x4001,
        "headers_len",
        "16385 bytes, over the 16384 limit",
    ),
    (
        "zero-length headers",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + b"\x00\x00",
        "headers",
        "MessagePack",
    ),
    (
        "headers not MessagePack",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\xc1"),
        "headers",
        "MessagePack",
    ),
    (
        "headers truncated map",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\x82\xa1a\xa1b"),
        "headers",
        "MessagePack",
    ),
    (
        "headers with extra data",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\x80\x80"),
        "headers",
        "MessagePack",
    ),
    (
        "headers not a map",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(msgpack.packb(["a", "b"])),
        "headers",
        "not a map but list",
    ),
    (
        "header name is bytes",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1)
        + headers_block(msgpack.packb({b"a": "b"}, use_bin_type=True)),
        "headers",
        "str -> str",
    ),
    (
        "header name is an int",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(msgpack.packb({1: "b"})),
        "headers",
        "MessagePack",  # msgpack's strict_map_key refuses it while parsing
    ),
    (
        "header value is an int",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(msgpack.packb({"a": 1})),
        "headers",
        "str -> str",
    ),
    (
        "header value is bytes",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1)
        + headers_block(msgpack.packb({"a": b"b"}, use_bin_type=True)),
        "headers",
        "str -> str",
    ),
    (
        "header value is a map",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(msgpack.packb({"a": {"b": "c"}})),
        "headers",
        "str -> str",
    ),
    (
        "header value not UTF-8",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\x81\xa1a\xa1\xff"),
        "headers",
        "MessagePack",
    ),
    (
        "header value is an ext type",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1)
        + headers_block(msgpack.packb({"a": msgpack.ExtType(5, b"x")})),
        "headers",
        "str -> str",
    ),
    (
        "header value is a bad timestamp",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\x81\xa1a\xd4\xff\x00"),
        "headers",
        "MessagePack",
    ),
    (
        "header value is a reserved ext type",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(b"\x81\xa1a\xd4\xfb\x00"),
        "headers",
        "MessagePack",
    ),
    (
        "header value over 1 KiB",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(msgpack.packb({"a": "v" * 1025})),
        "headers",
        "over 1024 bytes",
    ),
    (
        "header value over 1 KiB in UTF-8",
        fixed(Kind.ACK, HAS_HEADERS, 0, 1) + headers_block(msgpack.packb({"a": "é" * 513})),
        "headers",
        "over 1024 bytes",
    ),
    ("STAGED ERROR", fixed(Kind.ERROR, STAGED, 0, 1) + bytes(16), "flags", "cannot be STAGED"),
    ("STAGED ACK", fixed(Kind.ACK, STAGED, 0, 1) + bytes(16), "flags", "cannot be STAGED"),
    (
        "STAGED without payload",
        fixed(Kind.RESPONSE, STAGED, 0, 1),
        "payload",
        "truncated descriptor: 0 bytes",
    ),
    (
        "STAGED short descriptor",
        fixed(Kind.RESPONSE, STAGED, 0, 1) + bytes(15),
        "payload",
        "truncated descriptor: 15 bytes",
    ),
    (
        "STAGED long descriptor",
        fixed(Kind.RESPONSE, STAGED, 0, 1) + bytes(17),
        "payload",
        "descriptor followed by 1 trailing bytes",
    ),
    (
        "STAGED after headers",
        fixed(Kind.MESSAGE, STAGED | HAS_HEADERS, 1, 0) + b"h" + headers_block(b"\x80") + bytes(8),
        "payload",
        "truncated descriptor: 8 bytes",
    ),
]


@pytest.mark.parametrize(
    ("body", "field", "match"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS]
)
def test_rejection(body: bytes, field: str, match: str) -> None:
    with pytest.raises(MalformedEnvelope, match=match) as info:
        decode_envelope(body)
    assert info.value.field == field
    assert info.value.offset is not None
    assert f"{field} at offset {info.value.offset}:" in str(info.value)


def test_offsets_point_at_the_field() -> None:
    with pytest.raises(MalformedEnvelope) as info:
        decode_envelope(fixed(Kind.REQUEST, HAS_HEADERS, 3, 1) + b"abc" + b"\x00\x09")
    assert info.value.offset == 15  # headers_len follows the 3-byte name
    with pytest.raises(MalformedEnvelope) as info:
        decode_envelope(fixed(Kind.REQUEST, STAGED, 3, 1) + b"abc" + b"\x00")
    assert info.value.offset == 15  # where the payload starts


def test_malformed_envelope_pickles() -> None:
    with pytest.raises(MalformedEnvelope) as info:
        decode_envelope(b"\x01")
    copy = pickle.loads(pickle.dumps(info.value))
    assert (str(copy), copy.field, copy.offset) == (
        str(info.value),
        info.value.field,
        info.value.offset,
    )
    assert isinstance(copy, ValueError)


# -- encoder validation ---------------------------------------------------------

ENCODE_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown kind", {"kind": 6}, "unknown envelope kind"),
    ("kind not an int", {"kind": "MESSAGE"}, "unknown envelope kind"),
    ("kind a bool", {"kind": True}, "unknown envelope kind"),
    ("MESSAGE without a name", {"kind": Kind.MESSAGE}, "1 to 255 UTF-8 bytes, got 0"),
    ("SYNC without a name", {"kind": Kind.SYNC, "message_id": 1}, "needs a handler name"),
    ("name too long", {"kind": Kind.MESSAGE, "handler": "x" * 256}, "got 256"),
    ("name too long in UTF-8", {"kind": Kind.MESSAGE, "handler": "é" * 128}, "got 256"),
    ("name not encodable", {"kind": Kind.MESSAGE, "handler": "a\ud800"}, "UTF-8"),
    ("name not a str", {"kind": Kind.MESSAGE, "handler": b"abc"}, "must be a str"),
    ("name on a reply", {"kind": Kind.RESPONSE, "handler": "x", "message_id": 1}, "must not name"),
    ("id on MESSAGE", {"kind": Kind.MESSAGE, "handler": "h", "message_id": 1}, "must be 0"),
    ("no id on REQUEST", {"kind": Kind.REQUEST, "handler": "h"}, "got 0"),
    ("negative id", {"kind": Kind.ACK, "message_id": -1}, "got -1"),
    ("id over u64", {"kind": Kind.ACK, "message_id": 1 << 64}, "1..18446744073709551615"),
    ("id not an int", {"kind": Kind.ACK, "message_id": 1.0}, "must be an int"),
    ("id a bool", {"kind": Kind.ACK, "message_id": True}, "must be an int"),
    (
        "header name not str",
        {"kind": Kind.ACK, "message_id": 1, "headers": {1: "a"}},
        "must be str",
    ),
    (
        "header value not str",
        {"kind": Kind.ACK, "message_id": 1, "headers": {"a": 1}},
        "must be str",
    ),
    (
        "header value over 1 KiB",
        {"kind": Kind.ACK, "message_id": 1, "headers": {"a": "é" * 513}},
        "value of 1026 bytes",
    ),
    (
        "header not encodable",
        {"kind": Kind.ACK, "message_id": 1, "headers": {"a\udc80": "b"}},
        "UTF-8",
    ),
    (
        "headers over 16 KiB",
        {"kind": Kind.ACK, "message_id": 1, "headers": {f"k{i}": "v" * 1024 for i in range(16)}},
        "over 16384",
    ),
    (
        "STAGED ERROR",
        {"kind": Kind.ERROR, "message_id": 1, "payload": bytes(16), "staged": True},
        "cannot be STAGED",
    ),
    (
        "STAGED ACK",
        {"kind": Kind.ACK, "message_id": 1, "payload": bytes(16), "staged": True},
        "cannot be STAGED",
    ),
    (
        "STAGED short payload",
        {"kind": Kind.RESPONSE, "message_id": 1, "payload": bytes(15), "staged": True},
        "got 15 bytes",
    ),
    (
        "STAGED long payload",
        {"kind": Kind.RESPONSE, "message_id": 1, "payload": bytes(17), "staged": True},
        "got 17 bytes",
    ),
]


@pytest.mark.parametrize(
    ("args", "match"), [e[1:] for e in ENCODE_ERRORS], ids=[e[0] for e in ENCODE_ERRORS]
)
def test_encoder_refuses(args: dict[str, Any], match: str) -> None:
    kind = args.pop("kind")
    with pytest.raises(ValueError, match=match) as info:
        encode_envelope(kind, **args)
    assert not isinstance(info.value, MalformedEnvelope)  # our bug, not the peer's


def test_message_prefix_refuses() -> None:
    with pytest.raises(ValueError, match="only MESSAGE"):
        message_prefix(Kind.REQUEST, "h")
    with pytest.raises(ValueError, match="needs a handler name"):
        message_prefix(Kind.MESSAGE, "")
    with pytest.raises(ValueError, match="must not name"):
        MessagePrefix(Kind.ACK, "h")
    request = MessagePrefix(Kind.REQUEST, "h")
    for bad in (0, -1, 1 << 64):
        with pytest.raises(ValueError, match="message_id"):
            request.encode(bad, b"")
        with pytest.raises(ValueError, match="message_id"):
            request.header(bad)
        with pytest.raises(ValueError, match="message_id"):
            request.pack_into(bytearray(64), 0, bad)
    with pytest.raises(ValueError, match="must be 0 for MESSAGE"):
        MessagePrefix(Kind.MESSAGE, "h").encode(1, b"")
    assert repr(request) == "MessagePrefix(REQUEST, 'h')"


# -- _mux_slot ------------------------------------------------------------------


@given(st.integers(0, U64_MAX), st.integers(0, U32_MAX), st.integers(0, U64_MAX))
def test_mux_slot_round_trip(epoch: int, slot: int, session: int) -> None:
    ref = MuxSlotRef(epoch, slot, session)
    text = ref.format()
    assert text == f"{epoch}:{slot}:{session}"
    assert MuxSlotRef.parse(text) == ref


def test_the_mux_slot_header_codec_writes_and_reads_one_header() -> None:
    ref = MuxSlotRef(7, 513, 42)
    headers = MUX_SLOT.write(ref)
    assert headers == {MUX_SLOT_HEADER: "7:513:42"}
    assert MUX_SLOT.read(headers) == ref
    assert MUX_SLOT.read(None) is None
    assert MUX_SLOT.read({"other": "1"}) is None
    with pytest.raises(MalformedEnvelope, match=MUX_SLOT_HEADER):
        MUX_SLOT.read({MUX_SLOT_HEADER: "7:513"})
    # Through the envelope and back, the bytes the messenger always sent.
    wire = encode_envelope(Kind.MESSAGE, handler="_stream_batch", headers=headers, payload=b"x")
    assert MUX_SLOT.read(decode_envelope(wire).headers) == ref


def test_a_header_codec_names_a_reserved_header() -> None:
    for name in ("mux_slot", "_", ""):
        with pytest.raises(ConfigurationError, match="reserved header"):
            HeaderCodec(name, str, str)


def test_mux_slot_bounds() -> None:
    assert MuxSlotRef.parse(f"{U64_MAX}:{U32_MAX}:{U64_MAX}") == MuxSlotRef(
        U64_MAX, U32_MAX, U64_MAX
    )
    assert MuxSlotRef.parse("0:0:0") == MuxSlotRef(0, 0, 0)
    for text, field in (
        (f"{U64_MAX + 1}:0:0", "epoch exceeds"),
        (f"0:{U32_MAX + 1}:0", "slot exceeds"),
        (f"0:0:{U64_MAX + 1}", "session exceeds"),
        (f"0:0:{'9' * 21}", "session is not a canonical decimal"),
    ):
        with pytest.raises(MalformedEnvelope, match=field) as info:
            MuxSlotRef.parse(text)
        assert info.value.field == MUX_SLOT_HEADER
        assert info.value.offset is None
    for epoch, slot, session in (
        (-1, 0, 0),
        (U64_MAX + 1, 0, 0),
        (0, U32_MAX + 1, 0),
        (0, -1, 0),
        (0, 0, U64_MAX + 1),
    ):
        with pytest.raises(ValueError, match="must be in"):
            MuxSlotRef(epoch, slot, session)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1:2",
        "1:2:3:4",
        "a:b:c",
        "1::3",
        ":2:3",
        "1:2:",
        " 1:2:3",
        "1:2:3 ",
        "1:2:3\n",
        "+1:2:3",
        "-1:2:3",
        "1_0:2:3",
        "01:2:3",
        "1:002:3",
        "0x1:2:3",
        "1.0:2:3",
        "\u0661:2:3",  # ARABIC-INDIC DIGIT ONE: int() accepts it, the wire does not
        "\uff11:2:3",  # FULLWIDTH DIGIT ONE
        "1;2;3",
        "9" * 5000 + ":1:1",
    ],
)
def test_mux_slot_junk(text: str) -> None:
    with pytest.raises(MalformedEnvelope, match=MUX_SLOT_HEADER):
        MuxSlotRef.parse(text)


@given(st.text(max_size=40))
def test_mux_slot_parse_never_raises_anything_else(text: str) -> None:
    try:
        ref = MuxSlotRef.parse(text)
    except MalformedEnvelope:
        return
    assert ref.format() == text  # only the canonical spelling is accepted


# -- error payloads -------------------------------------------------------------


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.value)
@given(message=st.text(utf8_text, max_size=200))
def test_error_round_trip(code: ErrorCode, message: str) -> None:
    payload = encode_error(code, message)
    assert decode_error(payload) == (code, message)
    assert decode_error(memoryview(payload)) == (code, message)
    assert msgpack.unpackb(payload) == [code.value, message]


def test_error_codes_on_the_wire() -> None:
    assert [c.value for c in ErrorCode] == [
        "unknown_handler",
        "handler_failed",
        "malformed",
        "refused",
        "shutting_down",
    ]


def test_error_code_accepts_its_string_value() -> None:
    assert encode_error("refused", "m") == encode_error(ErrorCode.REFUSED, "m")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_error("no_such_code", "m")  # type: ignore[arg-type]


def test_error_message_that_utf8_cannot_carry_is_replaced() -> None:
    code, message = decode_error(encode_error(ErrorCode.HANDLER_FAILED, "bad name b'\udcff'"))
    assert (code, message) == (ErrorCode.HANDLER_FAILED, "bad name b'?'")


def test_unknown_error_code_becomes_handler_failed() -> None:
    code, message = decode_error(msgpack.packb(["quota_exceeded", "too many"]))
    assert code is ErrorCode.HANDLER_FAILED
    assert message == "too many (unknown error code 'quota_exceeded')"


def test_error_payload_extra_fields_are_ignored() -> None:
    assert decode_error(msgpack.packb(["refused", "busy", 42, {"retry": 1}])) == (
        ErrorCode.REFUSED,
        "busy",
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x92\xa1a",
        msgpack.packb(["refused", "m"]) + b"\x00",
        msgpack.packb("refused"),
        msgpack.packb({"code": "refused", "message": "m"}),
        msgpack.packb(["refused"]),
        msgpack.packb([]),
        msgpack.packb([1, "m"]),
        msgpack.packb(["refused", 5]),
        msgpack.packb(["refused", None]),
        msgpack.packb([b"refused", "m"], use_bin_type=True),
    ],
)
def test_error_payload_junk(payload: bytes) -> None:
    with pytest.raises(MalformedEnvelope, match="error payload") as info:
        decode_error(payload)
    assert info.value.field == "error"


@given(st.binary(max_size=100) | msgpack_values.map(msgpack.packb))
def test_error_payload_fuzz(payload: bytes) -> None:
    try:
        code, message = decode_error(payload)
    except MalformedEnvelope:
        return
    assert isinstance(code, ErrorCode)
    assert isinstance(message, str)


# -- staged descriptors ---------------------------------------------------------


@given(u64s, u64s)
def test_descriptor_round_trip(staged_id: int, size: int) -> None:
    descriptor = StagedDescriptor(staged_id, size)
    data = descriptor.encode()
    assert data == staged_id.to_bytes(8, "big") + size.to_bytes(8, "big")
    assert StagedDescriptor.decode(data) == descriptor
    wire = encode_envelope(Kind.REQUEST, handler="put", message_id=3, payload=data, staged=True)
    env = decode_envelope(wire)
    assert env.staged
    assert env.flags == STAGED
    assert env.descriptor == descriptor


def test_descriptor_bounds() -> None:
    for staged_id, size in ((-1, 0), (1 << 64, 0), (0, -1), (0, 1 << 64)):
        with pytest.raises(ValueError, match="must be a u64"):
            StagedDescriptor(staged_id, size)


@pytest.mark.parametrize("size", [0, 1, 8, 15, 17, 32])
def test_descriptor_wrong_size(size: int) -> None:
    match = "truncated descriptor" if size < DESCRIPTOR_SIZE else "trailing bytes"
    with pytest.raises(MalformedEnvelope, match=match) as info:
        StagedDescriptor.decode(bytes(size))
    assert info.value.field == "descriptor"
    body = fixed(Kind.MESSAGE, STAGED, 1, 0) + b"h" + bytes(size)
    with pytest.raises(MalformedEnvelope, match=match):
        decode_envelope(body)


def test_not_staged_has_no_descriptor() -> None:
    env = decode_envelope(encode_envelope(Kind.RESPONSE, message_id=1, payload=bytes(16)))
    assert not env.staged
    assert env.descriptor is None
