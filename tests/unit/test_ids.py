"""Node identities and stream anchor handles: round trips, validation, stability."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velomux_quic.ids import (
    MPSC_BIT,
    InstanceId,
    StreamAnchorHandle,
    WorkerId,
    new_instance_id,
    worker_id_of,
)

U64_MAX = (1 << 64) - 1
U128_MAX = (1 << 128) - 1

u64s = st.integers(0, U64_MAX)
# Values just outside the u64 range, on both sides, plus far-out ones.
not_u64s = st.integers(max_value=-1) | st.integers(min_value=U64_MAX + 1)


# -- StreamAnchorHandle ---------------------------------------------------------


@given(u64s, u64s)
def test_pack_unpack_round_trip(worker_id: int, local_id: int) -> None:
    handle = StreamAnchorHandle.pack(worker_id, local_id)
    assert handle.value == (worker_id << 64) | local_id
    assert handle.unpack() == (worker_id, local_id)
    assert handle.worker_id == worker_id
    assert handle.local_id == local_id
    assert StreamAnchorHandle(handle.value) == handle


@given(st.integers(0, U128_MAX))
def test_wire_round_trip(value: int) -> None:
    handle = StreamAnchorHandle(value)
    wire = handle.to_wire()
    assert set(wire) == {"hi", "lo"}
    assert StreamAnchorHandle.from_wire(wire) == handle
    # Both wire encodings carry the map unchanged.
    assert StreamAnchorHandle.from_wire(json.loads(json.dumps(wire))) == handle
    assert StreamAnchorHandle.from_wire(msgpack.unpackb(msgpack.packb(wire))) == handle


@given(st.integers(0, U128_MAX))
def test_str_is_two_fixed_width_hex_halves(value: int) -> None:
    handle = StreamAnchorHandle(value)
    hi, lo = str(handle).split(":")
    assert len(hi) == len(lo) == 16
    assert (int(hi, 16), int(lo, 16)) == handle.unpack()


@given(u64s, not_u64s)
def test_pack_rejects_out_of_range_halves(good: int, bad: int) -> None:
    with pytest.raises(ValueError):
        StreamAnchorHandle.pack(bad, good)
    with pytest.raises(ValueError):
        StreamAnchorHandle.pack(good, bad)


@given(st.integers(max_value=-1) | st.integers(min_value=U128_MAX + 1))
def test_handle_value_must_be_u128(value: int) -> None:
    with pytest.raises(ValueError):
        StreamAnchorHandle(value)


def test_handle_range_edges() -> None:
    assert StreamAnchorHandle(0).unpack() == (0, 0)
    assert StreamAnchorHandle(U128_MAX).unpack() == (U64_MAX, U64_MAX)
    assert StreamAnchorHandle.pack(U64_MAX, U64_MAX).value == U128_MAX
    for value in (-1, U128_MAX + 1):
        with pytest.raises(ValueError):
            StreamAnchorHandle(value)
    for worker_id, local_id in ((U64_MAX + 1, 0), (0, U64_MAX + 1), (-1, 0), (0, -1)):
        with pytest.raises(ValueError):
            StreamAnchorHandle.pack(worker_id, local_id)


@given(u64s, st.integers(0, MPSC_BIT - 1))
def test_is_mpsc_is_bit_63_of_the_local_id(worker_id: int, local_low: int) -> None:
    assert MPSC_BIT == 1 << 63
    assert not StreamAnchorHandle.pack(worker_id, local_low).is_mpsc
    assert StreamAnchorHandle.pack(worker_id, local_low | MPSC_BIT).is_mpsc


def test_is_mpsc_ignores_the_worker_id() -> None:
    # Bit 63 of the worker id is bit 127 of the handle, not the MPSC marker.
    assert not StreamAnchorHandle.pack(MPSC_BIT, 1).is_mpsc
    assert StreamAnchorHandle.pack(0, MPSC_BIT).is_mpsc


# from_wire must refuse anything but exactly {"hi": u64, "lo": u64}.
MALFORMED_WIRE: list[Any] = [
    None,
    0,
    "0:0",
    [0, 0],
    (0, 0),
    {},
    {"hi": 0},
    {"lo": 0},
    {"hi": 0, "lo": 0, "x": 0},
    {"hi": 0, "lo": 0, "value": 0},
    {b"hi": 0, b"lo": 0},
    {"HI": 0, "LO": 0},
    {"hi": 0.0, "lo": 0},
    {"hi": 0, "lo": 1.0},
    {"hi": "0", "lo": 0},
    {"hi": 0, "lo": "1"},
    {"hi": None, "lo": 0},
    {"hi": 0, "lo": None},
    {"hi": [1], "lo": 0},
    {"hi": True, "lo": 0},
    {"hi": False, "lo": 0},
    {"hi": U64_MAX + 1, "lo": 0},
    {"hi": 0, "lo": U64_MAX + 1},
    {"hi": -1, "lo": 0},
    {"hi": 0, "lo": -1},
    {"hi": 1 << 128, "lo": 0},
]


@pytest.mark.parametrize("obj", MALFORMED_WIRE, ids=repr)
def test_from_wire_rejects_malformed(obj: Any) -> None:
    with pytest.raises(ValueError):
        StreamAnchorHandle.from_wire(obj)


@pytest.mark.parametrize("lo", [True, False])
def test_from_wire_rejects_bool_lo(lo: bool) -> None:
    with pytest.raises(ValueError):
        StreamAnchorHandle.from_wire({"hi": 0, "lo": lo})


@given(u64s, not_u64s)
def test_from_wire_rejects_any_out_of_range_half(good: int, bad: int) -> None:
    with pytest.raises(ValueError):
        StreamAnchorHandle.from_wire({"hi": bad, "lo": good})
    with pytest.raises(ValueError):
        StreamAnchorHandle.from_wire({"hi": good, "lo": bad})


@given(
    st.dictionaries(
        st.text(max_size=4) | st.integers() | st.binary(max_size=4),
        st.integers() | st.none() | st.text(max_size=4),
        max_size=4,
    )
)
def test_from_wire_accepts_only_the_exact_key_set(obj: dict[Any, Any]) -> None:
    well_formed = set(obj) == {"hi", "lo"} and all(
        type(obj[key]) is int and 0 <= obj[key] <= U64_MAX for key in ("hi", "lo")
    )
    if well_formed:
        assert StreamAnchorHandle.from_wire(obj).unpack() == (obj["hi"], obj["lo"])
    else:
        with pytest.raises(ValueError):
            StreamAnchorHandle.from_wire(obj)


# -- InstanceId and WorkerId ----------------------------------------------------

# Computed once from worker_id_of (BLAKE2b-64, person b"velomux-worker") and pinned:
# handles cross builds, so a change to this function must fail here.
GOLDEN_WORKER_IDS = [
    ("00000000-0000-0000-0000-000000000000", 0x219675D2F533F1E5),
    ("12345678-1234-5678-1234-567812345678", 0xDE439467EFF80676),
    ("f47ac10b-58cc-4372-a567-0e02b2c3d479", 0x48294A1F9F01DE7C),
]


@pytest.mark.parametrize(("text", "expected"), GOLDEN_WORKER_IDS)
def test_worker_id_is_pinned(text: str, expected: int) -> None:
    instance = InstanceId.parse(text)
    assert worker_id_of(instance) == WorkerId(expected)
    assert instance.worker_id == expected


@given(st.uuids())
def test_worker_id_is_a_stable_u64(value: uuid.UUID) -> None:
    instance = InstanceId(value)
    worker_id = worker_id_of(instance)
    assert 0 <= worker_id <= U64_MAX
    assert worker_id_of(InstanceId(uuid.UUID(bytes=value.bytes))) == worker_id
    assert instance.worker_id == worker_id
    # A WorkerId always fits the upper half of a handle.
    assert StreamAnchorHandle.pack(worker_id, 1).worker_id == worker_id


@given(st.uuids())
def test_instance_id_text_round_trip(value: uuid.UUID) -> None:
    instance = InstanceId(value)
    assert str(instance) == str(value)
    assert InstanceId.parse(str(instance)) == instance


def test_new_instance_id_is_random_v4() -> None:
    a, b = new_instance_id(), new_instance_id()
    assert a != b
    assert a.uuid.version == 4


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "not-a-uuid",
        "1234",
        "12345678-1234-5678-1234-56781234567",  # one digit short
        "12345678-1234-5678-1234-5678123456789",  # one digit long
        "12345678-1234-5678-1234-56781234567g",  # not hex
        " 12345678-1234-5678-1234-567812345678",
        "12345678-1234-5678-1234-567812345678\n",
        "spiffe://velomux/12345678-1234-5678-1234-567812345678",
    ],
)
def test_instance_id_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        InstanceId.parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "{12345678-1234-5678-1234-567812345678}",
        "urn:uuid:12345678-1234-5678-1234-567812345678",
        "12345678123456781234567812345678",
        "12345678-1234-5678-1234-5678-12345678",
    ],
)
def test_instance_id_parse_rejects_non_canonical_text(text: str) -> None:
    with pytest.raises(ValueError):
        InstanceId.parse(text)
