"""Lane placement: the fixed key hash, keyed lanes, and least-loaded choice."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from velomux_quic.mux.lanes import lane_for_key, least_loaded, splitmix64
from velomux_quic.mux.protocol import MAX_LANES

GAMMA = 0x9E3779B97F4A7C15
U64 = 2**64 - 1


def test_splitmix64_golden_values() -> None:
    # The first three outputs of a SplitMix64 generator seeded with 0: state k*GAMMA
    # is incremented by GAMMA and mixed, which is exactly one splitmix64 call.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(GAMMA) == 0x6E789E6AA1B965F4
    assert splitmix64(2 * GAMMA & U64) == 0x06C45D188009454F
    # Pinned from this implementation, so a lane index never moves between builds.
    assert splitmix64(1) == 0x910A2DEC89025CC1
    assert splitmix64(U64) == 0xE4D971771B652C20


@given(st.integers(0, U64))
def test_splitmix64_is_a_u64_function_of_the_key_mod_2_64(key: int) -> None:
    value = splitmix64(key)
    assert 0 <= value <= U64
    assert splitmix64(key + 2**64) == value
    assert splitmix64(key - 2**64) == value


def test_lane_for_key_pinned() -> None:
    # A keyed stream lands on the same lane in every build and on every receiver
    # with the same lane count; these pin that.
    assert [lane_for_key(k, 8) for k in range(16)] == [
        7,
        1,
        6,
        5,
        2,
        2,
        0,
        7,
        6,
        4,
        2,
        5,
        3,
        7,
        6,
        5,
    ]
    assert [lane_for_key(k, 16) for k in (0, 1, 2, 3, 0xDEADBEEF, U64)] == [15, 1, 14, 13, 11, 0]


@given(st.integers(0, U64), st.integers(1, MAX_LANES))
def test_lane_for_key_is_hash_mod_lanes(key: int, lanes: int) -> None:
    lane = lane_for_key(key, lanes)
    assert lane == splitmix64(key) % lanes
    assert 0 <= lane < lanes


def test_one_lane_always_lane_zero() -> None:
    assert {lane_for_key(k, 1) for k in range(1000)} == {0}


@pytest.mark.parametrize("lanes", [0, -1, MAX_LANES + 1, 64])
def test_lane_for_key_refuses_a_lane_count_out_of_range(lanes: int) -> None:
    with pytest.raises(ValueError):
        lane_for_key(1, lanes)


def test_lane_for_key_spreads_sequential_keys() -> None:
    # Sequential keys (request counters) are the common case; each of 8 lanes
    # must get between 10% and 15% of them, against an even 12.5%.
    counts = Counter(lane_for_key(k, 8) for k in range(10_000))
    assert set(counts) == set(range(8))
    for lane, count in counts.items():
        assert 1_000 <= count <= 1_500, (lane, count)


def test_least_loaded_picks_the_smallest_load() -> None:
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([5]) == 0
    assert least_loaded((9, 8, 7, 0)) == 3


def test_least_loaded_ties_go_to_the_lowest_lane() -> None:
    # All lanes empty: lane 0, as before lanes existed.
    assert least_loaded([0] * 16) == 0
    assert least_loaded([3, 1, 1, 2]) == 1
    assert least_loaded([5, 4, 3, 3]) == 2
    assert least_loaded([2, 2, 2, 1, 1]) == 3


@given(st.lists(st.integers(0, 1_000), min_size=1, max_size=MAX_LANES))
def test_least_loaded_is_first_minimum(loads: list[int]) -> None:
    assert least_loaded(loads) == loads.index(min(loads))


def test_least_loaded_needs_a_lane() -> None:
    with pytest.raises(ValueError):
        least_loaded([])
