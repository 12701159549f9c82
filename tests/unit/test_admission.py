"""The admission gate, sans-IO: a fake lane with a settable window stands in for QUIC."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from velomux_quic.errors import AdmissionCancelled, ChannelClosed
from velomux_quic.transport.admission import (
    ADMITTED,
    AdmissionState,
    LaneGate,
    SendAdmission,
)


class FakeLane:
    """A stream with a peer window: ``written`` grows, ``window`` is what the peer granted."""

    def __init__(self, window: int, send_buffer: int = 0) -> None:
        self.window = window
        self.send_buffer = send_buffer
        self.written: list[bytes] = []
        self.offset = 0

    def room(self) -> int:
        return self.window + self.send_buffer - self.offset

    def idle(self) -> bool:
        return self.offset <= self.window

    def write(self, frame: bytes) -> None:
        self.written.append(frame)
        self.offset += len(frame)

    def gate(self) -> LaneGate:
        return LaneGate(self.room, self.idle, self.write)


def test_fits_is_admitted_without_allocating_an_admission() -> None:
    lane = FakeLane(window=100)
    gate = lane.gate()
    assert gate.send(b"x" * 60) is ADMITTED
    assert lane.written == [b"x" * 60]


def test_full_lane_returns_pending_and_admits_in_fifo_order_as_room_opens() -> None:
    lane = FakeLane(window=10)
    gate = lane.gate()
    assert gate.send(b"a" * 15) is ADMITTED  # idle lane: admitted, now 5 bytes past the window
    pending = [gate.send(bytes([65 + i]) * 10) for i in range(3)]
    assert all(isinstance(p, SendAdmission) for p in pending)
    assert [p.state for p in pending] == [AdmissionState.PENDING] * 3  # type: ignore[union-attr]
    lane.window = 24  # room for one frame; after it the lane is past its window again
    assert gate.poll() == 1
    assert [p.state for p in pending] == [  # type: ignore[union-attr]
        AdmissionState.ADMITTED,
        AdmissionState.PENDING,
        AdmissionState.PENDING,
    ]
    lane.window = 1000
    assert gate.poll() == 2
    assert lane.written == [b"a" * 15, b"A" * 10, b"B" * 10, b"C" * 10]


def test_a_later_small_frame_never_overtakes_a_waiting_large_one() -> None:
    lane = FakeLane(window=10)
    gate = lane.gate()
    gate.send(b"a" * 11)
    big = gate.send(b"b" * 50)
    small = gate.send(b"c")  # would fit on its own
    assert isinstance(small, SendAdmission) and not small.done()
    lane.window = 61
    gate.poll()
    assert big.state is AdmissionState.ADMITTED  # type: ignore[union-attr]
    assert small.state is AdmissionState.ADMITTED
    assert lane.written[1:] == [b"b" * 50, b"c"]


def test_frame_larger_than_any_room_is_admitted_once_the_lane_is_idle() -> None:
    lane = FakeLane(window=10)
    gate = lane.gate()
    gate.send(b"a" * 15)
    huge = gate.send(b"h" * 1000)
    assert isinstance(huge, SendAdmission)
    gate.poll()
    assert not huge.done()  # 5 bytes still beyond the window
    lane.window = 15
    gate.poll()
    # idle: everything written is inside the window, so the huge frame goes
    assert huge.state is AdmissionState.ADMITTED
    assert gate.send(b"z") is not ADMITTED  # now far beyond the window


def test_close_refuses_every_waiting_frame_and_later_sends() -> None:
    lane = FakeLane(window=0)
    gate = lane.gate()
    gate.send(b"first")  # idle lane: admitted
    waiting = [gate.send(b"w") for _ in range(3)]
    seen: list[AdmissionState] = []
    waiting[0].on_resolved(lambda a: seen.append(a.state))  # type: ignore[union-attr]
    assert gate.close(ChannelClosed("gone")) == 3
    assert seen == [AdmissionState.FAILED]
    for admission in waiting:
        assert isinstance(admission, SendAdmission)
        assert isinstance(admission.error, ChannelClosed)
    late = gate.send(b"late")
    assert isinstance(late, SendAdmission) and isinstance(late.error, ChannelClosed)
    assert lane.written == [b"first"]


def test_cancelled_admission_is_skipped_and_never_written() -> None:
    lane = FakeLane(window=0)
    gate = lane.gate()
    gate.send(b"first")
    a = gate.send(b"a")
    b = gate.send(b"b")
    assert isinstance(a, SendAdmission) and isinstance(b, SendAdmission)
    assert a.cancel() is True
    assert a.cancel() is False
    assert isinstance(a.error, AdmissionCancelled)
    lane.window = 100
    gate.poll()
    assert lane.written == [b"first", b"b"]


async def test_awaiting_an_admission_resolves_or_raises() -> None:
    lane = FakeLane(window=0)
    gate = lane.gate()
    gate.send(b"x")
    ok = gate.send(b"ok")
    assert isinstance(ok, SendAdmission)
    waiter = asyncio.ensure_future(_await(ok))
    await asyncio.sleep(0)
    assert not waiter.done()
    lane.window = 100
    gate.poll()
    await asyncio.wait_for(waiter, 5)
    lane.window = 0
    gate.send(b"y" * 200)
    refused = gate.send(b"refused")
    assert isinstance(refused, SendAdmission)
    gate.close(ChannelClosed("closed"))
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(_await(refused), 5)


async def _await(admission: SendAdmission) -> None:
    await admission


@given(
    st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=40),
    st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=20),
)
def test_order_and_bounds_hold_for_any_schedule(sizes: list[int], grants: list[int]) -> None:
    """Whatever the frame sizes and window grants, frames are written in send order and
    the written bytes never exceed window + send_buffer, except one frame on an idle lane."""
    lane = FakeLane(window=20, send_buffer=5)
    gate = lane.gate()
    frames = [bytes([i % 256]) * size for i, size in enumerate(sizes)]
    for frame in frames:
        before_idle, before = lane.idle(), lane.offset
        gate.send(frame)
        # beyond window + send_buffer only by one frame written while the lane was idle
        assert (
            lane.offset == before
            or lane.offset <= lane.window + lane.send_buffer
            or (before_idle and lane.offset == before + len(frame))
        )
    for grant in grants:
        lane.window += grant
        gate.poll()
    lane.window += sum(sizes) + 1
    gate.poll()
    assert lane.written == frames
    assert gate.pending_count == 0
