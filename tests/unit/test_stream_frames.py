"""StreamFrame codec: exact bytes, round trips, sentinel detection, and refusal of bad frames."""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velomux_quic.streaming import frames as frames_module
from velomux_quic.streaming.frames import (
    DETACHED,
    DROPPED,
    FINALIZED,
    HEARTBEAT,
    ITEM_PREFIX,
    TERMINAL_KINDS,
    FrameDecodeError,
    FrameKind,
    SerializationError,
    decode_frame,
    encode_item,
    encode_items,
    encode_sender_error,
    encode_transport_error,
    is_heartbeat,
    is_terminal_sentinel,
    item_frame,
)

I64_MIN = -(1 << 63)
U64_MAX = (1 << 64) - 1

# The wire form of every kind, written out from the MessagePack spec rather than
# produced by the code under test: fixstr a0|len, fixmap 80|n, positive fixint.
GOLDEN: list[tuple[bytes, bytes, FrameKind, object]] = [
    (HEARTBEAT, b"\xa9Heartbeat", FrameKind.HEARTBEAT, None),
    (FINALIZED, b"\xa9Finalized", FrameKind.FINALIZED, None),
    (DETACHED, b"\xa8Detached", FrameKind.DETACHED, None),
    (DROPPED, b"\xa7Dropped", FrameKind.DROPPED, None),
    (
        encode_item({"token": 123, "text": "hello"}),
        b"\x81\xa4Item" + b"\x82\xa5token\x7b\xa4text\xa5hello",
        FrameKind.ITEM,
        {"token": 123, "text": "hello"},
    ),
    (encode_item(None), b"\x81\xa4Item\xc0", FrameKind.ITEM, None),
    (
        encode_sender_error("bad item"),
        b"\x81\xabSenderError\xa8bad item",
        FrameKind.SENDER_ERROR,
        "bad item",
    ),
    (
        encode_transport_error("peer lost"),
        b"\x81\xaeTransportError\xa9peer lost",
        FrameKind.TRANSPORT_ERROR,
        "peer lost",
    ),
]
VALID_FRAMES = [wire for _, wire, _, _ in GOLDEN] + [
    encode_item([1, -1, 1.5, b"\x00\xff", "Dropped", {"k": [None, True]}]),
    encode_item({1: "int key", 2: {3: 4}}),
    encode_item(DROPPED),
    encode_sender_error(""),
]

# Everything msgpack can carry and give back unchanged: lists (not tuples), maps
# with str or int keys, no NaN (it is not equal to itself).
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=I64_MIN, max_value=U64_MAX)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
)
items = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text() | st.integers(I64_MIN, U64_MAX), inner, max_size=5)
    ),
    max_leaves=20,
)


def expect_decode(body: Any) -> tuple[FrameKind, object] | None:
    """decode_frame's answer, or None when it refuses; any other exception fails the test."""
    try:
        return decode_frame(body)
    except FrameDecodeError:
        return None


def check_consistent(body: bytes) -> None:
    """The fast predicates agree with a full decode, for bytes and for views of them."""
    decoded = expect_decode(body)
    terminal = decoded is not None and decoded[0] in TERMINAL_KINDS
    heartbeat = decoded is not None and decoded[0] is FrameKind.HEARTBEAT
    for form in (body, memoryview(body), bytearray(body)):
        assert expect_decode(form) == decoded
        assert is_terminal_sentinel(form) is terminal
        assert is_heartbeat(form) is heartbeat


# -- wire form --------------------------------------------------------------------


@pytest.mark.parametrize(("encoded", "wire", "kind", "value"), GOLDEN)
def test_golden_bytes(encoded: bytes, wire: bytes, kind: FrameKind, value: object) -> None:
    assert encoded == wire
    assert type(encoded) is bytes
    assert decode_frame(wire) == (kind, value)
    assert decode_frame(memoryview(wire)) == (kind, value)
    assert decode_frame(bytearray(wire)) == (kind, value)


def test_item_prefix_and_kinds() -> None:
    assert ITEM_PREFIX == b"\x81\xa4Item" == msgpack.packb({"Item": None})[:-1]
    assert [kind.name for kind in FrameKind] == [
        "ITEM",
        "SENDER_ERROR",
        "HEARTBEAT",
        "FINALIZED",
        "DETACHED",
        "DROPPED",
        "TRANSPORT_ERROR",
    ]
    assert [int(kind) for kind in FrameKind] == list(range(7))
    assert {FrameKind.FINALIZED, FrameKind.DETACHED, FrameKind.DROPPED} < TERMINAL_KINDS
    assert FrameKind.TRANSPORT_ERROR in TERMINAL_KINDS
    assert len(TERMINAL_KINDS) == 4


def test_unit_constants_are_msgpack_strings() -> None:
    for constant, name in [
        (HEARTBEAT, "Heartbeat"),
        (FINALIZED, "Finalized"),
        (DETACHED, "Detached"),
        (DROPPED, "Dropped"),
    ]:
        assert constant == msgpack.packb(name)
        assert msgpack.unpackb(constant) == name


def test_data_frames_are_one_entry_maps() -> None:
    assert msgpack.unpackb(encode_item([1, 2])) == {"Item": [1, 2]}
    assert msgpack.unpackb(encode_sender_error("x")) == {"SenderError": "x"}
    assert msgpack.unpackb(encode_transport_error("y")) == {"TransportError": "y"}


# -- encoding ---------------------------------------------------------------------


@given(items)
def test_encode_item_is_prefix_plus_packb_and_round_trips(item: object) -> None:
    body = encode_item(item)
    assert body == ITEM_PREFIX + msgpack.packb(item)
    assert decode_frame(body) == (FrameKind.ITEM, item)
    assert decode_frame(memoryview(body)) == (FrameKind.ITEM, item)
    assert not is_terminal_sentinel(body)
    assert not is_heartbeat(body)


@given(st.lists(items, max_size=10))
def test_encode_items_matches_encode_item(batch: list[object]) -> None:
    assert encode_items(batch) == [encode_item(item) for item in batch]
    assert encode_items(iter(batch)) == encode_items(batch)


def test_item_frame_is_the_prefix_and_the_payload_at_every_size() -> None:
    """Sizes on both sides of the 4 KiB payload the compiled path joins in its scratch
    buffer (past it, the plain concatenation), and a short frame after a long one: nothing
    of an earlier frame is left in a later."""
    sizes = [0, 1, 47, 4095, 4096, 4097, 12288, 2, 0]
    for size in sizes:
        payload = bytes((size + offset) % 251 for offset in range(size))
        frame = item_frame(payload)
        assert type(frame) is bytes
        assert frame == ITEM_PREFIX + payload, size


@given(st.lists(st.binary(max_size=80), min_size=2, max_size=6))
def test_item_frames_made_in_turn_keep_their_own_bytes(payloads: list[bytes]) -> None:
    frames = [item_frame(payload) for payload in payloads]
    assert frames == [ITEM_PREFIX + payload for payload in payloads]


def test_encode_items_empty() -> None:
    assert encode_items([]) == []


@pytest.mark.parametrize(
    "bad",
    [
        {1, 2},
        object(),
        1 << 64,
        -(1 << 63) - 1,
        "\ud800",
        {"ok": [1, 2, {"nested": frozenset()}]},
        (lambda: None),
    ],
    ids=["set", "object", "u64+1", "i64-1", "surrogate", "nested", "function"],
)
def test_unencodable_item_raises_serialization_error(bad: object) -> None:
    with pytest.raises(SerializationError) as info:
        encode_item(bad)
    assert isinstance(info.value, ValueError)
    with pytest.raises(SerializationError):
        encode_items([1, bad, 2])
    # A failure leaves nothing behind in the pooled packers.
    assert encode_item({"after": 1}) == ITEM_PREFIX + msgpack.packb({"after": 1})
    assert encode_items(["a", "b"]) == [ITEM_PREFIX + b"\xa1a", ITEM_PREFIX + b"\xa1b"]


def test_too_deep_item_raises_serialization_error() -> None:
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SerializationError):
        encode_item(deep)


def test_encode_item_reentered_while_packing() -> None:
    """A dict subclass whose items() encodes another item must not corrupt either frame."""
    inner_frames: list[bytes] = []

    class Sneaky(dict[str, int]):
        def items(self) -> Any:
            inner_frames.append(encode_item(["inner", 1]))
            return super().items()

    outer = encode_item({"x": Sneaky(a=1), "y": "after"})
    assert outer == ITEM_PREFIX + msgpack.packb({"x": {"a": 1}, "y": "after"})
    assert inner_frames == [ITEM_PREFIX + msgpack.packb(["inner", 1])]


def test_encode_item_from_many_threads() -> None:
    expected = {
        n: ITEM_PREFIX + msgpack.packb({"token": n, "text": "t" * (n % 50)}) for n in range(2000)
    }
    failures: list[int] = []
    start = threading.Barrier(4)

    def worker(offset: int) -> None:
        start.wait()
        for n in range(offset, 2000, 4):
            item = {"token": n, "text": "t" * (n % 50)}
            if encode_item(item) != expected[n] or encode_items([item]) != [expected[n]]:
                failures.append(n)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_pool_does_not_keep_a_grown_packer() -> None:
    """A packer keeps the largest buffer it grew to; one that grew is not pooled again."""
    big = b"x" * (frames_module.PACKER_BUFFER + 1)
    for encode in (encode_item, lambda item: encode_items([item])):
        encode_item(1)  # at least one packer is idle, and it is the next one taken
        idle = frames_module.pooled_packers()
        assert idle >= 1
        encode(big)  # takes an idle packer, grows it, and drops it
        assert frames_module.pooled_packers() == idle - 1
        assert encode_item(b"small") == ITEM_PREFIX + msgpack.packb(b"small")
        assert 1 <= frames_module.pooled_packers() <= frames_module.POOL_MAX


@given(st.text())
def test_error_frames_round_trip(message: str) -> None:
    assert decode_frame(encode_sender_error(message)) == (FrameKind.SENDER_ERROR, message)
    assert decode_frame(encode_transport_error(message)) == (FrameKind.TRANSPORT_ERROR, message)
    assert not is_terminal_sentinel(encode_sender_error(message))
    assert is_terminal_sentinel(encode_transport_error(message))


def test_error_message_with_lone_surrogate_is_replaced_not_lost() -> None:
    kind, value = decode_frame(encode_transport_error("bad \udcff byte"))
    assert kind is FrameKind.TRANSPORT_ERROR
    assert value == "bad ? byte"


@pytest.mark.parametrize("message", [None, 1, b"bytes"])
def test_error_message_must_be_str(message: object) -> None:
    with pytest.raises(TypeError):
        encode_sender_error(message)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_transport_error(message)  # type: ignore[arg-type]


# -- sentinels ----------------------------------------------------------------------

TRUTH_TABLE: list[tuple[str, bytes, bool, bool]] = [
    ("Finalized", FINALIZED, True, False),
    ("Detached", DETACHED, True, False),
    ("Dropped", DROPPED, True, False),
    ("TransportError", encode_transport_error("lost"), True, False),
    ("TransportError empty", encode_transport_error(""), True, False),
    ("Heartbeat", HEARTBEAT, False, True),
    ("SenderError", encode_sender_error("soft"), False, False),
    ("Item", encode_item({"token": 1}), False, False),
    ("Item of the string Dropped", encode_item("Dropped"), False, False),
    ("Item of the string Heartbeat", encode_item("Heartbeat"), False, False),
    ("Item of the bytes of Dropped", encode_item(DROPPED), False, False),
    ("Item of the bytes of Finalized", encode_item(FINALIZED), False, False),
    ("Item of a TransportError frame", encode_item(encode_transport_error("x")), False, False),
    ("Item of a TransportError-shaped map", encode_item({"TransportError": "x"}), False, False),
    ("Item of nil", encode_item(None), False, False),
    ("Dropped, str8 form", b"\xd9\x07Dropped", True, False),
    ("Heartbeat, str16 form", b"\xda\x00\x09Heartbeat", False, True),
    ("TransportError, map16 header", b"\xde\x00\x01\xaeTransportError\xa1x", True, False),
    ("Item, str8 key", b"\x81\xd9\x04Item\xa7Dropped", False, False),
    ("empty", b"", False, False),
    ("Dropped truncated", DROPPED[:-1], False, False),
    ("Dropped plus a byte", DROPPED + b"\x00", False, False),
    ("lower-case dropped", b"\xa7dropped", False, False),
    ("Item prefix alone", ITEM_PREFIX, False, False),
    ("Item prefix and garbage", ITEM_PREFIX + b"\xc1", False, False),
    ("TransportError with int", b"\x81\xaeTransportError\x01", False, False),
    ("Dropped as a map key", b"\x81\xa7Dropped\xc0", False, False),
    ("two Dropped strings", DROPPED + DROPPED, False, False),
]


@pytest.mark.parametrize(
    ("body", "terminal", "heartbeat"),
    [case[1:] for case in TRUTH_TABLE],
    ids=[case[0] for case in TRUTH_TABLE],
)
def test_sentinel_truth_table(body: bytes, terminal: bool, heartbeat: bool) -> None:
    for form in (body, memoryview(body), bytearray(body)):
        assert is_terminal_sentinel(form) is terminal
        assert is_heartbeat(form) is heartbeat
    check_consistent(body)


def test_item_with_sentinel_payload_decodes_as_data() -> None:
    assert decode_frame(encode_item("Dropped")) == (FrameKind.ITEM, "Dropped")
    assert decode_frame(encode_item(DROPPED)) == (FrameKind.ITEM, DROPPED)


@pytest.mark.parametrize("body", [None, 7, "Dropped", object()])
def test_predicates_never_raise_on_non_bytes(body: object) -> None:
    assert is_terminal_sentinel(body) is False  # type: ignore[arg-type]
    assert is_heartbeat(body) is False  # type: ignore[arg-type]
    with pytest.raises(FrameDecodeError):
        decode_frame(body)  # type: ignore[arg-type]


def test_memoryview_of_other_format_and_slices() -> None:
    frame = encode_item({"token": 9})
    padded = b"xx" + frame + b"yy"
    view = memoryview(padded)[2:-2]
    assert decode_frame(view) == (FrameKind.ITEM, {"token": 9})
    wide = memoryview(bytearray(DROPPED + b"\xc0")).cast("B")[:-1]
    assert is_terminal_sentinel(wide)
    assert decode_frame(wide) == (FrameKind.DROPPED, None)


# -- refusal ------------------------------------------------------------------------

MALFORMED: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("reserved byte", b"\xc1"),
    ("truncated map", b"\x81"),
    ("unknown string", b"\xa5Bogus"),
    ("string of the wrong case", b"\xa9heartbeat"),
    ("Item as a bare string", b"\xa4Item"),
    ("nil", b"\xc0"),
    ("int", b"\x05"),
    ("array", b"\x91\xa7Dropped"),
    ("empty map", b"\x80"),
    ("two-entry map", b"\x82\xa4Item\x01\xabSenderError\xa1x"),
    ("duplicate Item key", b"\x82\xa4Item\x01\xa4Item\x02"),
    ("unknown key", b"\x81\xa3Foo\x01"),
    ("unit variant as a key", b"\x81\xa9Heartbeat\xc0"),
    ("int key", b"\x81\x01\x02"),
    ("bin key", b"\x81\xc4\x04Item\x01"),
    ("SenderError with int", b"\x81\xabSenderError\x01"),
    ("SenderError with nil", b"\x81\xabSenderError\xc0"),
    ("SenderError with bin", b"\x81\xabSenderError\xc4\x01x"),
    ("TransportError with array", b"\x81\xaeTransportError\x91\xa1x"),
    ("Item without payload", ITEM_PREFIX),
    ("Item with trailing bytes", ITEM_PREFIX + b"\x01\x02"),
    ("unit with trailing bytes", HEARTBEAT + b"\xc0"),
    ("error with trailing bytes", encode_sender_error("x") + b"\x00"),
    ("invalid UTF-8 string", b"\xa2\xff\xfe"),
    ("invalid UTF-8 in Item", ITEM_PREFIX + b"\xa1\xff"),
    ("bad timestamp in Item", ITEM_PREFIX + b"\xd5\xff\x00\x00"),
    ("unhashable key in Item", ITEM_PREFIX + b"\x81\x91\x01\x02"),
    ("too deep Item", ITEM_PREFIX + b"\x91" * 5000 + b"\xc0"),
    ("length past the end", ITEM_PREFIX + b"\xdb\xff\xff\xff\xffabc"),
    ("huge array claim", b"\xdd\xff\xff\xff\xff"),
]


@pytest.mark.parametrize("body", [case[1] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_frames_raise_frame_decode_error(body: bytes) -> None:
    for form in (body, memoryview(body), bytearray(body)):
        with pytest.raises(FrameDecodeError) as info:
            decode_frame(form)
        assert isinstance(info.value, ValueError)
        assert is_terminal_sentinel(form) is False
        assert is_heartbeat(form) is False


def test_non_canonical_encodings_decode_like_canonical_ones() -> None:
    assert decode_frame(b"\xd9\x07Dropped") == (FrameKind.DROPPED, None)
    assert decode_frame(b"\xdb\x00\x00\x00\x08Detached") == (FrameKind.DETACHED, None)
    assert decode_frame(b"\xde\x00\x01\xa4Item\x05") == (FrameKind.ITEM, 5)
    assert decode_frame(b"\xdf\x00\x00\x00\x01\xa4Item\x05") == (FrameKind.ITEM, 5)
    assert decode_frame(b"\x81\xd9\x0bSenderError\xa1x") == (FrameKind.SENDER_ERROR, "x")


# -- fuzz -----------------------------------------------------------------------------


@settings(max_examples=500)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_refuse(body: bytes) -> None:
    check_consistent(body)


@settings(max_examples=300)
@given(
    st.sampled_from([*VALID_FRAMES, ITEM_PREFIX, b"\x81", b"\xde\x00\x01"]), st.binary(max_size=24)
)
def test_valid_prefix_with_random_tail(prefix: bytes, tail: bytes) -> None:
    check_consistent(prefix + tail)


@pytest.mark.parametrize("frame", VALID_FRAMES, ids=range(len(VALID_FRAMES)))
def test_every_truncation_and_byte_corruption(frame: bytes) -> None:
    for end in range(len(frame)):
        check_consistent(frame[:end])
    for position in range(len(frame)):
        for value in range(256):
            corrupted = frame[:position] + bytes([value]) + frame[position + 1 :]
            decoded = expect_decode(corrupted)
            kind_is_terminal = decoded is not None and decoded[0] in TERMINAL_KINDS
            assert is_terminal_sentinel(corrupted) is kind_is_terminal
            assert is_heartbeat(corrupted) is (
                decoded is not None and decoded[0] is FrameKind.HEARTBEAT
            )
