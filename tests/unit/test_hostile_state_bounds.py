"""The state a hostile peer's choices create, bounded: the mux's record of refused slots,
and the openings of streams a peer opens toward us (both sans-IO, on an explicit clock)."""

from __future__ import annotations

import struct

import pytest

from tests.unit.test_mux_ingress import Harness, data, drops, opening
from velomux_quic.errors import ConfigurationError
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.protocol import slot_id
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.openings import (
    DROP,
    REFUSED_COUNT,
    REFUSED_SIZE,
    StreamOpenings,
)

# -- the mux's refused slots ----------------------------------------------------------------


def test_refused_slot_ids_are_bounded_and_the_oldest_forgotten() -> None:
    h = Harness(max_refused_slots=100)
    refused = 10_000
    h.send([opening(slot_id(index, 0), 7, index) for index in range(refused)])
    assert h.stats.refused_slots == 100
    assert h.stats.refusals_forgotten == refused - 100
    # A remembered refusal still answers its slot's records as unknown_slot; a forgotten
    # one is dropped all the same, as closed_slot: nothing reaches a consumer either way.
    h.send([data(slot_id(refused - 1, 0), 1), data(slot_id(0, 0), 1)])
    assert drops(h.stats) == {"unknown_slot": 1, "closed_slot": 1}
    assert h.stats.live_slots == 0


def test_a_slot_refused_twice_is_remembered_once() -> None:
    h = Harness(max_refused_slots=4)
    sid = slot_id(3, 0)
    h.send([opening(sid, 7, 1)])
    h.send([opening(sid, 7, 1)])
    assert h.stats.refused_slots == 1 and h.stats.refusals_forgotten == 0


def test_opening_a_refused_index_for_real_frees_its_refusal() -> None:
    h = Harness(max_refused_slots=4)
    h.send([opening(slot_id(5, 0), 7, 1)])
    assert h.stats.refused_slots == 1
    h.open(5, 1)
    assert h.stats.refused_slots == 0 and h.stats.live_slots == 1


def test_retiring_the_table_forgets_its_refusals() -> None:
    h = Harness(max_refused_slots=8)
    h.send([opening(slot_id(index, 0), 7, index) for index in range(20)])
    h.table.retire_all()
    assert h.stats.refused_slots == 0


def test_the_refusal_bound_must_bound_something() -> None:
    with pytest.raises(ConfigurationError, match="max_refused_slots"):
        MuxConfig(max_refused_slots=0)


# -- stream openings ------------------------------------------------------------------------

_HEADER = struct.Struct(">I")


def _first_frame(length: int, body: bytes = b"") -> bytes:
    return _HEADER.pack(length) + body


def test_an_opening_in_one_piece_passes_and_its_stream_is_then_left_alone() -> None:
    openings = StreamOpenings(limit=2, max_size=64, timeout=1.0)
    assert openings.admit(66, _first_frame(16, bytes(16)) + b"records", now=0.0) is None
    assert openings.pending == 0 and 66 in openings.opened
    assert openings.admit(66, b"x" * 100_000, now=5.0) is None


def test_an_opening_in_pieces_passes_once_whole() -> None:
    openings = StreamOpenings(limit=2, max_size=64, timeout=1.0)
    frame = _first_frame(16, bytes(16))
    for index in range(len(frame)):
        assert openings.admit(70, frame[index : index + 1], now=0.0) is None
        assert (70 in openings.opened) is (index == len(frame) - 1)
    assert openings.pending == 0


def test_unfinished_openings_past_the_count_are_refused_and_then_dropped() -> None:
    openings = StreamOpenings(limit=2, max_size=64, timeout=1.0)
    assert openings.admit(66, b"\x00", now=0.0) is None
    assert openings.admit(70, b"\x00", now=0.0) is None
    assert openings.admit(74, b"\x00", now=0.0) == REFUSED_COUNT
    assert openings.admit(74, b"more", now=0.0) == DROP
    openings.ended(74)  # the peer reset it
    assert openings.pending == 2


def test_a_first_frame_announcing_too_much_is_refused() -> None:
    openings = StreamOpenings(limit=2, max_size=64, timeout=1.0)
    assert openings.admit(66, _first_frame(0xFFFF_FFFF)[:2], now=0.0) is None
    assert openings.admit(66, _first_frame(0xFFFF_FFFF)[2:], now=0.0) == REFUSED_SIZE
    assert openings.pending == 0


def test_openings_that_do_not_finish_in_time_expire_oldest_first() -> None:
    openings = StreamOpenings(limit=8, max_size=64, timeout=1.0)
    openings.admit(66, b"\x00", now=0.0)
    openings.admit(70, b"\x00", now=0.5)
    assert openings.next_deadline() == 1.0
    assert openings.expire(now=0.9) == []
    assert openings.expire(now=1.0) == [66]
    assert openings.next_deadline() == 1.5
    assert openings.admit(66, b"late", now=1.1) == DROP
    assert openings.expire(now=2.0) == [70] and openings.next_deadline() is None


@pytest.mark.parametrize(
    "options",
    [
        {"max_connections_per_peer": 0},
        {"max_stream_openings": 0},
        {"max_stream_opening_size": 15},
        {"stream_opening_timeout": 0},
        {"partial_frame_timeout": 0},
        {"max_partial_frame_bytes": 1024, "max_message_size": 4096},
    ],
)
def test_transport_refuses_bounds_that_bound_nothing(options: dict[str, int]) -> None:
    with pytest.raises(ConfigurationError):
        TransportConfig(**options)


def test_the_partial_frame_bound_follows_the_message_size_by_default() -> None:
    assert TransportConfig().partial_frame_limit == 2 * TransportConfig().max_message_size
    assert TransportConfig(max_message_size=1 << 20).partial_frame_limit == 2 << 20
    assert TransportConfig(max_partial_frame_bytes=40 << 20).partial_frame_limit == 40 << 20
