"""Attach control messages and tickets: exact bytes, trailing defaults, and refusal of bad input."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from velomux_quic.errors import ControlDecodeError
from velomux_quic.ids import StreamAnchorHandle
from velomux_quic.streaming import control as control_module
from velomux_quic.streaming.control import (
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    MAX_LANES,
    MESSENGER_MUX_KEY,
    PER_STREAM_KEY,
    AnchorAttachErr,
    AnchorAttachOk,
    AnchorAttachRequest,
    AnchorAttachResponse,
    AnchorRef,
    MpscAnchorAttachErr,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    MpscAnchorAttachResponse,
    MpscSenderRef,
    StreamControl,
    StreamOpenTicket,
)

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1

MESSAGE_CLASSES: list[type[Any]] = [
    AnchorAttachRequest,
    MpscAnchorAttachRequest,
    AnchorAttachOk,
    AnchorAttachErr,
    MpscAnchorAttachOk,
    StreamOpenTicket,
    AnchorRef,
    MpscSenderRef,
    StreamControl,
]
DECODERS: list[type[Any]] = [*MESSAGE_CLASSES, AnchorAttachResponse, MpscAnchorAttachResponse]


def s(text: str) -> bytes:
    """A MessagePack fixstr, written by hand so the vectors do not come from the encoder."""
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


HANDLE = StreamAnchorHandle.pack(7, 9)
HANDLE_WIRE = b"\x82" + s("hi") + b"\x07" + s("lo") + b"\x09"
BIG_HANDLE = StreamAnchorHandle.pack(0x0102030405060708, 0x8000000000000001)
BIG_HANDLE_WIRE = (
    b"\x82"
    + s("hi")
    + b"\xcf\x01\x02\x03\x04\x05\x06\x07\x08"
    + s("lo")
    + b"\xcf\x80\x00\x00\x00\x00\x00\x00\x01"
)
CANCEL_WIRE = b"\x82" + s("hi") + b"\x05" + s("lo") + b"\x06"
MUX = s(MESSENGER_MUX_KEY)
WINDOW = b"\xcd\x13\x88" + b"\x0c" + b"\x40" + b"\xce\x00\x10\x00\x00"  # 5000, 12, 64, 1 MiB

GOLDEN: list[tuple[str, Any, bytes]] = [
    (
        "request, nothing offered",
        AnchorAttachRequest(HANDLE, 42, (5, 6)),
        b"\x93" + HANDLE_WIRE + b"\x2a" + CANCEL_WIRE,
    ),
    (
        "request, u64 handle",
        AnchorAttachRequest(BIG_HANDLE, U64_MAX, (5, 6)),
        b"\x93" + BIG_HANDLE_WIRE + b"\xcf" + b"\xff" * 8 + CANCEL_WIRE,
    ),
    (
        "request, keys offered",
        AnchorAttachRequest(HANDLE, 42, (5, 6), [MESSENGER_MUX_KEY, PER_STREAM_KEY]),
        b"\x94" + HANDLE_WIRE + b"\x2a" + CANCEL_WIRE + b"\x92" + MUX + s(PER_STREAM_KEY),
    ),
    (
        "request, lane key 0 without keys",
        AnchorAttachRequest(HANDLE, 42, (5, 6), lane_key=0),
        b"\x95" + HANDLE_WIRE + b"\x2a" + CANCEL_WIRE + b"\x90\x00",
    ),
    (
        "mpsc request",
        MpscAnchorAttachRequest(HANDLE, 42, (5, 6), [MESSENGER_MUX_KEY], 300),
        b"\x95" + HANDLE_WIRE + b"\x2a" + CANCEL_WIRE + b"\x91" + MUX + b"\xcd\x01\x2c",
    ),
    (
        "ok, lane 0",
        AnchorAttachOk(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20),
        b"\x81" + s("Ok") + b"\x95" + MUX + WINDOW,
    ),
    (
        "ok, lane 3",
        AnchorAttachOk(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20, lane=3),
        b"\x81" + s("Ok") + b"\x96" + MUX + WINDOW + b"\x03",
    ),
    (
        "ok, per-stream with every default",
        AnchorAttachOk(PER_STREAM_KEY),
        b"\x81" + s("Ok") + b"\x91" + s(PER_STREAM_KEY),
    ),
    (
        "ok, short heartbeat",
        AnchorAttachOk(PER_STREAM_KEY, heartbeat_interval_ms=1000),
        b"\x81" + s("Ok") + b"\x92" + s(PER_STREAM_KEY) + b"\xcd\x03\xe8",
    ),
    (
        "ok, a default before a set field is sent",
        AnchorAttachOk(MESSENGER_MUX_KEY, initial_credit=64),
        b"\x81" + s("Ok") + b"\x94" + MUX + b"\xcd\x13\x88\x00\x40",
    ),
    ("err", AnchorAttachErr("nope"), b"\x81" + s("Err") + b"\x91" + s("nope")),
    (
        "mpsc ok, lane 0",
        MpscAnchorAttachOk(MESSENGER_MUX_KEY, 5000, 9, 12, 64, 1 << 20),
        b"\x81" + s("Ok") + b"\x96" + MUX + b"\xcd\x13\x88" + b"\x09" + WINDOW[3:],
    ),
    (
        "mpsc ok, lane 2",
        MpscAnchorAttachOk(MESSENGER_MUX_KEY, 5000, 9, 12, 64, 1 << 20, 2),
        b"\x81" + s("Ok") + b"\x97" + MUX + b"\xcd\x13\x88" + b"\x09" + WINDOW[3:] + b"\x02",
    ),
    (
        "mpsc ok, per-stream",
        MpscAnchorAttachOk(PER_STREAM_KEY, 5000, 9),
        b"\x81" + s("Ok") + b"\x93" + s(PER_STREAM_KEY) + b"\xcd\x13\x88\x09",
    ),
    (
        "ticket, lane 0",
        StreamOpenTicket(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20),
        b"\x95" + MUX + WINDOW,
    ),
    (
        "ticket, lane 3",
        StreamOpenTicket(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20, lane=3),
        b"\x96" + MUX + WINDOW + b"\x03",
    ),
    ("anchor ref", AnchorRef(HANDLE), b"\x91" + HANDLE_WIRE),
    ("mpsc sender ref", MpscSenderRef(HANDLE, 3), b"\x92" + HANDLE_WIRE + b"\x03"),
    ("stream control", StreamControl(5), b"\x91\x05"),
    ("stream control, u64", StreamControl(U64_MAX), b"\x91\xcf" + b"\xff" * 8),
]


def decode_as(cls: type[Any], data: Any) -> Any:
    """cls.decode(data), or None when it refuses; any other exception fails the test."""
    try:
        return cls.decode(data)
    except ControlDecodeError:
        return None


# -- wire form --------------------------------------------------------------------


@pytest.mark.parametrize(("message", "wire"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden_bytes(message: Any, wire: bytes) -> None:
    assert message.encode() == wire
    assert type(message).decode(wire) == message
    assert type(message).decode(memoryview(wire)) == message


def test_lane_zero_is_byte_identical_to_a_pre_lane_message() -> None:
    # Before lanes, a ticket and an Ok carried five values; lane 0 must not change a byte.
    pre_lane = msgpack.packb([MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20])
    ticket = StreamOpenTicket(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20)
    assert ticket.encode() == pre_lane
    assert AnchorAttachOk(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20).encode() == (
        msgpack.packb({"Ok": [MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20]})
    )
    # A non-zero lane is one more element, at the end.
    lane3 = StreamOpenTicket(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20, lane=3).encode()
    assert lane3 == b"\x96" + pre_lane[1:] + b"\x03"
    # An explicit lane 0 from a peer that sends it anyway reads the same.
    explicit = msgpack.packb([MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20, 0])
    assert StreamOpenTicket.decode(explicit) == ticket


def test_request_without_lane_key_is_byte_identical_to_a_pre_lane_request() -> None:
    request = AnchorAttachRequest(HANDLE, 42, (5, 6), [PER_STREAM_KEY])
    assert request.encode() == msgpack.packb(
        [{"hi": 7, "lo": 9}, 42, {"hi": 5, "lo": 6}, [PER_STREAM_KEY]]
    )


def test_constants() -> None:
    assert MESSENGER_MUX_KEY == "messenger-mux-v2"
    assert PER_STREAM_KEY == "quic-stream-v1"
    assert DEFAULT_HEARTBEAT_INTERVAL_MS == 5000
    assert MAX_LANES == 16


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda c: c.__name__)
def test_field_table_matches_the_dataclass(cls: type[Any]) -> None:
    """The wire order is the declaration order, and wire defaults are the Python defaults."""
    declared = dataclasses.fields(cls)
    spec = cls.FIELDS
    assert [f.name for f in declared] == [f.name for f in spec]
    for field, wire in zip(declared, spec, strict=True):
        has_default = field.default is not dataclasses.MISSING
        assert has_default or wire.required, field.name
        if not wire.required:
            assert field.default == wire.default, field.name


def test_mpsc_err_is_the_shared_err() -> None:
    assert MpscAnchorAttachErr is AnchorAttachErr
    err = AnchorAttachErr("gone").encode()
    assert isinstance(AnchorAttachResponse.decode(err), AnchorAttachErr)
    assert isinstance(MpscAnchorAttachResponse.decode(err), AnchorAttachErr)


# -- trailing defaults ----------------------------------------------------------------


def test_missing_trailing_fields_take_their_defaults() -> None:
    ok = AnchorAttachResponse.decode(msgpack.packb({"Ok": [PER_STREAM_KEY]}))
    assert ok == AnchorAttachOk(PER_STREAM_KEY, 5000, 0, 0, 0, 0)
    ok = AnchorAttachResponse.decode(msgpack.packb({"Ok": [MESSENGER_MUX_KEY, 250, 7]}))
    assert ok == AnchorAttachOk(MESSENGER_MUX_KEY, 250, 7, 0, 0, 0)
    mpsc = MpscAnchorAttachResponse.decode(msgpack.packb({"Ok": [PER_STREAM_KEY, 100, 4]}))
    assert mpsc == MpscAnchorAttachOk(PER_STREAM_KEY, 100, 4, 0, 0, 0, 0)
    request = AnchorAttachRequest.decode(msgpack.packb([{"hi": 7, "lo": 9}, 1, {"hi": 5, "lo": 6}]))
    assert request.supported_transport_keys == ()
    assert request.lane_key is None
    request = AnchorAttachRequest.decode(
        msgpack.packb([{"hi": 7, "lo": 9}, 1, {"hi": 5, "lo": 6}, ["k"], None])
    )
    assert request == AnchorAttachRequest(HANDLE, 1, (5, 6), ("k",), None)
    ticket = StreamOpenTicket.decode(msgpack.packb(["k", 1, 2, 3, 4]))
    assert ticket.lane == 0


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (StreamOpenTicket, []),
        (StreamOpenTicket, ["k"]),
        (StreamOpenTicket, ["k", 5000]),
        (StreamOpenTicket, ["k", 5000, 12]),
        (StreamOpenTicket, ["k", 5000, 12, 64]),
        (AnchorAttachRequest, []),
        (AnchorAttachRequest, [{"hi": 7, "lo": 9}]),
        (AnchorAttachRequest, [{"hi": 7, "lo": 9}, 42]),
        (MpscAnchorAttachRequest, [{"hi": 7, "lo": 9}, 42]),
        (AnchorRef, []),
        (MpscSenderRef, [{"hi": 7, "lo": 9}]),
        (StreamControl, []),
    ],
)
def test_missing_required_fields_are_refused(cls: type[Any], fields: list[object]) -> None:
    with pytest.raises(ControlDecodeError, match="corrupt"):
        cls.decode(msgpack.packb(fields))


@pytest.mark.parametrize(
    ("cls", "outer"),
    [
        (AnchorAttachResponse, {"Ok": []}),
        (AnchorAttachResponse, {"Err": []}),
        (MpscAnchorAttachResponse, {"Ok": [PER_STREAM_KEY]}),
        (MpscAnchorAttachResponse, {"Ok": [PER_STREAM_KEY, 5000]}),
    ],
)
def test_missing_required_response_fields_are_refused(cls: type[Any], outer: object) -> None:
    with pytest.raises(ControlDecodeError, match="corrupt"):
        cls.decode(msgpack.packb(outer))


@pytest.mark.parametrize(("message", "wire"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_an_extra_trailing_field_is_refused(message: Any, wire: bytes) -> None:
    """A field this version does not know carries a meaning it cannot honour."""
    cls = type(message)
    fields = list(cls.FIELDS)
    full = [field.to_wire(getattr(message, field.name)) for field in fields]
    extras: list[object] = [0, None, "x", []]
    for extra in extras:
        body: Any = [*full, extra]
        if getattr(message, "TAG", ""):  # an answer: a tagged variant
            body = {message.TAG: body}
        with pytest.raises(ControlDecodeError, match="knows"):
            cls.decode(msgpack.packb(body))


def test_pre_lane_worker_refuses_a_lane_ticket() -> None:
    """What the ticket compatibility rule relies on: six values where five are known fail."""

    @dataclasses.dataclass(frozen=True, slots=True)
    class PreLaneTicket(control_module.ControlMessage):
        streaming_transport_key: str
        heartbeat_interval_ms: int
        routing_session_id: int
        initial_credit: int
        slot_byte_budget: int
        FIELDS = StreamOpenTicket.FIELDS[:5]

    lane0 = StreamOpenTicket(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20)
    assert PreLaneTicket.decode(lane0.encode()).routing_session_id == 12
    with pytest.raises(ControlDecodeError):
        PreLaneTicket.decode(StreamOpenTicket(MESSENGER_MUX_KEY, 5000, 12, 64, 1 << 20, 1).encode())


# -- ranges and types -----------------------------------------------------------------

BAD_ARGS: list[tuple[str, type[Any], tuple[Any, ...], dict[str, Any], type[Exception]]] = [
    ("session u64+1", AnchorAttachRequest, (HANDLE, U64_MAX + 1, (1, 2)), {}, ValueError),
    ("session negative", AnchorAttachRequest, (HANDLE, -1, (1, 2)), {}, ValueError),
    ("session bool", AnchorAttachRequest, (HANDLE, True, (1, 2)), {}, TypeError),
    ("session str", AnchorAttachRequest, (HANDLE, "1", (1, 2)), {}, TypeError),
    ("handle int", AnchorAttachRequest, (5, 1, (1, 2)), {}, TypeError),
    ("cancel one value", AnchorAttachRequest, (HANDLE, 1, (1,)), {}, TypeError),
    ("cancel list", AnchorAttachRequest, (HANDLE, 1, [1, 2]), {}, TypeError),
    ("cancel hi u64+1", AnchorAttachRequest, (HANDLE, 1, (U64_MAX + 1, 2)), {}, ValueError),
    ("keys a str", AnchorAttachRequest, (HANDLE, 1, (1, 2), "quic"), {}, TypeError),
    ("keys of int", AnchorAttachRequest, (HANDLE, 1, (1, 2), [1]), {}, TypeError),
    ("key with surrogate", AnchorAttachRequest, (HANDLE, 1, (1, 2), ["\ud800"]), {}, ValueError),
    ("lane key u64+1", AnchorAttachRequest, (HANDLE, 1, (1, 2), (), U64_MAX + 1), {}, ValueError),
    ("mpsc session negative", MpscAnchorAttachRequest, (HANDLE, -1, (1, 2)), {}, ValueError),
    ("key not str", AnchorAttachOk, (5,), {}, TypeError),
    ("heartbeat u64+1", AnchorAttachOk, ("k", U64_MAX + 1), {}, ValueError),
    ("credit u32+1", AnchorAttachOk, ("k",), {"initial_credit": U32_MAX + 1}, ValueError),
    ("budget u32+1", AnchorAttachOk, ("k",), {"slot_byte_budget": U32_MAX + 1}, ValueError),
    ("lane 16", AnchorAttachOk, ("k",), {"lane": MAX_LANES}, ValueError),
    ("lane u16+1", AnchorAttachOk, ("k",), {"lane": 1 << 16}, ValueError),
    ("lane negative", AnchorAttachOk, ("k",), {"lane": -1}, ValueError),
    ("mpsc sender u64+1", MpscAnchorAttachOk, ("k", 5000, U64_MAX + 1), {}, ValueError),
    ("mpsc lane 16", MpscAnchorAttachOk, ("k", 5000, 1), {"lane": 16}, ValueError),
    ("err reason int", AnchorAttachErr, (1,), {}, TypeError),
    ("ticket credit 0", StreamOpenTicket, ("k", 5000, 1, 0, 1), {}, ValueError),
    ("ticket budget 0", StreamOpenTicket, ("k", 5000, 1, 1, 0), {}, ValueError),
    ("ticket credit u32+1", StreamOpenTicket, ("k", 5000, 1, U32_MAX + 1, 1), {}, ValueError),
    ("ticket lane 16", StreamOpenTicket, ("k", 5000, 1, 1, 1, 16), {}, ValueError),
    ("ref handle tuple", AnchorRef, ((7, 9),), {}, TypeError),
    ("sender ref negative", MpscSenderRef, (HANDLE, -1), {}, ValueError),
    ("stream control u64+1", StreamControl, (U64_MAX + 1,), {}, ValueError),
    ("stream control float", StreamControl, (1.0,), {}, TypeError),
]


@pytest.mark.parametrize(
    ("cls", "args", "kwargs", "error"), [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS]
)
def test_out_of_range_values_cannot_be_built(
    cls: type[Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        cls(*args, **kwargs)


def test_values_are_normalised() -> None:
    request = AnchorAttachRequest(HANDLE, 1, (1, 2), [PER_STREAM_KEY, MESSENGER_MUX_KEY])
    assert request.supported_transport_keys == (PER_STREAM_KEY, MESSENGER_MUX_KEY)
    assert hash(request) == hash(
        AnchorAttachRequest(HANDLE, 1, (1, 2), (PER_STREAM_KEY, MESSENGER_MUX_KEY))
    )
    assert AnchorAttachOk("k", lane=MAX_LANES - 1).lane == 15
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.session_id = 2  # type: ignore[misc]


WIRE_DEFECTS: list[tuple[str, type[Any], Any]] = [
    ("ticket credit 0", StreamOpenTicket, ["k", 5000, 1, 0, 1]),
    ("ticket budget 0", StreamOpenTicket, ["k", 5000, 1, 1, 0]),
    ("ticket credit u32+1", StreamOpenTicket, ["k", 5000, 1, U32_MAX + 1, 1]),
    ("ticket lane 16", StreamOpenTicket, ["k", 5000, 1, 1, 1, 16]),
    ("ticket lane u16+1", StreamOpenTicket, ["k", 5000, 1, 1, 1, 1 << 16]),
    ("ticket heartbeat negative", StreamOpenTicket, ["k", -1, 1, 1, 1]),
    ("ticket heartbeat bool", StreamOpenTicket, ["k", True, 1, 1, 1]),
    ("ticket heartbeat float", StreamOpenTicket, ["k", 5000.0, 1, 1, 1]),
    ("ticket heartbeat nil", StreamOpenTicket, ["k", None, 1, 1, 1]),
    ("ticket key bin", StreamOpenTicket, [b"k", 5000, 1, 1, 1]),
    ("ticket lane nil", StreamOpenTicket, ["k", 5000, 1, 1, 1, None]),
    ("ticket as a map", StreamOpenTicket, {"streaming_transport_key": "k"}),
    ("ticket as an int", StreamOpenTicket, 5),
    ("ok lane 16", AnchorAttachResponse, {"Ok": ["k", 5000, 0, 0, 0, 16]}),
    ("ok credit u32+1", AnchorAttachResponse, {"Ok": ["k", 5000, 0, U32_MAX + 1]}),
    ("ok heartbeat nil", AnchorAttachResponse, {"Ok": ["k", None]}),
    ("ok fields a map", AnchorAttachResponse, {"Ok": {"streaming_transport_key": "k"}}),
    ("ok fields a str", AnchorAttachResponse, {"Ok": "k"}),
    ("ok, bare string variant", AnchorAttachResponse, "Ok"),
    ("unknown variant", AnchorAttachResponse, {"Maybe": ["k"]}),
    ("lower-case variant", AnchorAttachResponse, {"ok": ["k"]}),
    ("two variants", AnchorAttachResponse, {"Ok": ["k"], "Err": ["x"]}),
    ("no variant", AnchorAttachResponse, {}),
    ("err reason int", AnchorAttachResponse, {"Err": [1]}),
    ("err two fields", AnchorAttachResponse, {"Err": ["x", "y"]}),
    ("an array", AnchorAttachResponse, ["k"]),
    ("err asked of Ok", AnchorAttachOk, {"Err": ["x"]}),
    ("ok asked of Err", AnchorAttachErr, {"Ok": ["k"]}),
    ("mpsc ok asked of spsc ok", AnchorAttachOk, {"Ok": ["k", 5000, 9, 0, 0, 0, 0]}),
    ("mpsc sender nil", MpscAnchorAttachResponse, {"Ok": ["k", 5000, None]}),
    ("handle as array", AnchorRef, [[7, 9]]),
    ("handle as int", AnchorRef, [7]),
    ("handle missing lo", AnchorRef, [{"hi": 7}]),
    ("handle extra key", AnchorRef, [{"hi": 7, "lo": 9, "x": 1}]),
    ("handle hi negative", AnchorRef, [{"hi": -1, "lo": 9}]),
    ("handle hi bool", AnchorRef, [{"hi": True, "lo": 9}]),
    ("handle lo str", AnchorRef, [{"hi": 7, "lo": "9"}]),
    ("sender ref id negative", MpscSenderRef, [{"hi": 7, "lo": 9}, -3]),
    ("request session negative", AnchorAttachRequest, [{"hi": 7, "lo": 9}, -1, {"hi": 5, "lo": 6}]),
    ("request cancel as array", AnchorAttachRequest, [{"hi": 7, "lo": 9}, 1, [5, 6]]),
    ("request keys nil", AnchorAttachRequest, [{"hi": 7, "lo": 9}, 1, {"hi": 5, "lo": 6}, None]),
    ("request keys a str", AnchorAttachRequest, [{"hi": 7, "lo": 9}, 1, {"hi": 5, "lo": 6}, "k"]),
    ("request key int", AnchorAttachRequest, [{"hi": 7, "lo": 9}, 1, {"hi": 5, "lo": 6}, [1]]),
    (
        "request lane key negative",
        AnchorAttachRequest,
        [{"hi": 7, "lo": 9}, 1, {"hi": 5, "lo": 6}, [], -1],
    ),
    ("stream control str", StreamControl, ["5"]),
    ("stream control negative", StreamControl, [-5]),
]


@pytest.mark.parametrize(
    ("cls", "value"), [w[1:] for w in WIRE_DEFECTS], ids=[w[0] for w in WIRE_DEFECTS]
)
def test_defective_values_on_the_wire_are_refused(cls: type[Any], value: Any) -> None:
    with pytest.raises(ControlDecodeError) as info:
        cls.decode(msgpack.packb(value))
    assert isinstance(info.value, ValueError)


RAW_DEFECTS: list[tuple[str, type[Any], bytes]] = [
    ("empty", StreamControl, b""),
    ("reserved byte", StreamControl, b"\xc1"),
    ("trailing bytes", StreamControl, b"\x91\x05\x00"),
    ("truncated", StreamOpenTicket, StreamOpenTicket("k", 1, 1, 1, 1).encode()[:-1]),
    ("invalid UTF-8 key", AnchorAttachOk, b"\x81\xa2Ok\x91\xa2\xff\xfe"),
    ("duplicate handle key", AnchorRef, b"\x91\x83\xa2hi\x07\xa2lo\x09\xa2hi\x08"),
    ("duplicate variant", AnchorAttachResponse, b"\x82\xa2Ok\x91\xa1k\xa2Ok\x91\xa1j"),
    ("int map key", AnchorRef, b"\x91\x82\x01\x07\xa2lo\x09"),
    ("ext value", StreamControl, b"\x91\xd4\x01\x00"),
    ("timestamp value", StreamControl, b"\x91\xd6\xff\x00\x00\x00\x01"),
    ("too deep", StreamControl, b"\x91" * 5000 + b"\x05"),
    ("huge array claim", StreamControl, b"\xdd\xff\xff\xff\xff"),
]


@pytest.mark.parametrize(
    ("cls", "data"), [r[1:] for r in RAW_DEFECTS], ids=[r[0] for r in RAW_DEFECTS]
)
def test_malformed_bytes_are_refused(cls: type[Any], data: bytes) -> None:
    with pytest.raises(ControlDecodeError):
        cls.decode(data)
    with pytest.raises(ControlDecodeError):
        cls.decode(memoryview(data))


# -- response helpers -------------------------------------------------------------------


def test_family_decode_returns_either_variant() -> None:
    ok = AnchorAttachOk(MESSENGER_MUX_KEY, 5000, 1, 8, 0)
    err = AnchorAttachErr("already_attached: busy")
    assert AnchorAttachResponse.decode(ok.encode()) == ok
    assert AnchorAttachResponse.decode(err.encode()) == err
    assert AnchorAttachOk.decode(ok.encode()) == ok
    assert AnchorAttachErr.decode(err.encode()) == err
    with pytest.raises(ControlDecodeError, match="expected Ok"):
        AnchorAttachOk.decode(err.encode())
    mpsc_ok = MpscAnchorAttachOk(MESSENGER_MUX_KEY, 5000, 3)
    assert MpscAnchorAttachResponse.decode(mpsc_ok.encode()) == mpsc_ok
    assert MpscAnchorAttachOk.decode(mpsc_ok.encode()) == mpsc_ok


def test_err_helper_and_encode_response() -> None:
    assert AnchorAttachResponse.err("nope") == AnchorAttachErr("nope").encode()
    assert MpscAnchorAttachResponse.err("nope") == AnchorAttachErr("nope").encode()
    # A reason quoting undecodable peer text still goes out.
    assert AnchorAttachResponse.decode(AnchorAttachResponse.err("bad \udcff")) == AnchorAttachErr(
        "bad ?"
    )
    ok = AnchorAttachOk(PER_STREAM_KEY)
    assert AnchorAttachResponse.encode_response(ok) == ok.encode()
    mpsc_ok = MpscAnchorAttachOk(PER_STREAM_KEY, 5000, 1)
    assert MpscAnchorAttachResponse.encode_response(mpsc_ok) == mpsc_ok.encode()
    assert MpscAnchorAttachResponse.encode_response(AnchorAttachErr("x")) == (
        AnchorAttachErr("x").encode()
    )
    with pytest.raises(TypeError):
        AnchorAttachResponse.encode_response(mpsc_ok)
    with pytest.raises(TypeError):
        MpscAnchorAttachResponse.encode_response(ok)


# -- round trips -----------------------------------------------------------------------

u64 = st.integers(0, U64_MAX)
u32 = st.integers(0, U32_MAX)
nonzero_u32 = st.integers(1, U32_MAX)
lanes = st.integers(0, MAX_LANES - 1)
handles = st.builds(StreamAnchorHandle, st.integers(0, (1 << 128) - 1))
keys = st.lists(st.text(max_size=20), max_size=4)

MESSAGES = st.one_of(
    st.builds(AnchorAttachRequest, handles, u64, st.tuples(u64, u64), keys, st.none() | u64),
    st.builds(MpscAnchorAttachRequest, handles, u64, st.tuples(u64, u64), keys, st.none() | u64),
    st.builds(AnchorAttachOk, st.text(), u64, u64, u32, u32, lanes),
    st.builds(AnchorAttachErr, st.text()),
    st.builds(MpscAnchorAttachOk, st.text(), u64, u64, u64, u32, u32, lanes),
    st.builds(StreamOpenTicket, st.text(), u64, u64, nonzero_u32, nonzero_u32, lanes),
    st.builds(AnchorRef, handles),
    st.builds(MpscSenderRef, handles, u64),
    st.builds(StreamControl, u64),
)


@settings(max_examples=500)
@given(MESSAGES)
def test_round_trip(message: Any) -> None:
    cls = type(message)
    wire = message.encode()
    assert cls.decode(wire) == message
    assert cls.decode(memoryview(wire)) == message
    assert cls.decode(wire).encode() == wire
    if isinstance(message, AnchorAttachResponse):
        assert AnchorAttachResponse.decode(wire) == message
    if isinstance(message, MpscAnchorAttachResponse):
        assert MpscAnchorAttachResponse.decode(wire) == message


@settings(max_examples=300)
@given(MESSAGES)
def test_only_trailing_defaults_are_left_out(message: Any) -> None:
    fields = message.FIELDS
    values = [getattr(message, field.name) for field in fields]
    sent = msgpack.unpackb(message.encode())
    if getattr(message, "TAG", ""):  # an answer: a tagged variant
        sent = sent[message.TAG]
    # Everything left out holds its default, and the last value sent is either
    # required or not its default: nothing more could have been left out.
    omitted = zip(fields[len(sent) :], values[len(sent) :], strict=True)
    assert all(field.default == value for field, value in omitted)
    assert len(sent) >= message.REQUIRED
    if len(sent) > message.REQUIRED:
        assert values[len(sent) - 1] != fields[len(sent) - 1].default


# -- fuzz -------------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=8)
    | st.sampled_from(["Ok", "Err", "hi", "lo", MESSENGER_MUX_KEY]),
    lambda inner: (
        st.lists(inner, max_size=8)
        | st.dictionaries(
            st.sampled_from(["Ok", "Err", "hi", "lo"]) | st.text(max_size=4), inner, max_size=3
        )
    ),
    max_leaves=20,
)


@settings(max_examples=500)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_refuse(data: bytes) -> None:
    for cls in DECODERS:
        decode_as(cls, data)


def decodes_its_own(cls: type[Any], message: object) -> bool:
    """A message class decodes only itself; a response family decodes its variants, which
    belong to it by its table, not by inheritance."""
    answers = getattr(cls, "answers", None)
    return bool(answers(message)) if answers is not None else isinstance(message, cls)


@settings(max_examples=1000)
@given(msgpack_values)
@example({"Ok": [""]})  # an AnchorAttachOk with defaults: a variant, not a subclass, of its family
def test_arbitrary_msgpack_values_decode_or_refuse(value: object) -> None:
    data = msgpack.packb(value)
    for cls in DECODERS:
        message = decode_as(cls, data)
        if message is not None:
            assert decodes_its_own(cls, message), (cls, message)
            assert type(message).decode(message.encode()) == message


@pytest.mark.parametrize(("message", "wire"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_every_truncation_and_byte_corruption(message: Any, wire: bytes) -> None:
    for end in range(len(wire)):
        for cls in DECODERS:
            decode_as(cls, wire[:end])
    for position in range(len(wire)):
        for value in range(256):
            corrupted = wire[:position] + bytes([value]) + wire[position + 1 :]
            got = decode_as(type(message), corrupted)
            if got is not None:
                assert isinstance(got, type(message))


def test_the_documented_differences_from_the_rust_encoding_hold() -> None:
    """The module docstring says where these bytes differ from a Rust peer's, which writes
    every ``#[serde(default)]`` field and leaves out only ``lane`` / ``lane_key``; a Rust
    peer's longer form decodes here to the same message."""
    per_stream = AnchorAttachOk(PER_STREAM_KEY, 5000, 7, 0, 0, 0)
    assert msgpack.unpackb(per_stream.encode()) == {"Ok": [PER_STREAM_KEY, 5000, 7]}
    rust_form = msgpack.packb({"Ok": [PER_STREAM_KEY, 5000, 7, 0, 0]})
    assert AnchorAttachResponse.decode(rust_form) == per_stream
    handle = StreamAnchorHandle.pack(3, 9)
    no_offer = AnchorAttachRequest(handle, 1, (3, 2), [], None)
    assert len(msgpack.unpackb(no_offer.encode())) == 3  # Rust writes the empty list: 4
    rust_request = msgpack.packb([handle.to_wire(), 1, {"hi": 3, "lo": 2}, []])
    assert AnchorAttachRequest.decode(rust_request) == no_offer
