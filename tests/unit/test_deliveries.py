"""The acknowledgement watchers of a connection's lanes, without a connection."""

from __future__ import annotations

import logging

import pytest

from velomux_quic.transport.deliveries import Deliveries


def test_callers_are_told_in_offset_order_as_the_acknowledgement_reaches_them() -> None:
    told: list[tuple[str, bool]] = []
    deliveries = Deliveries()
    deliveries.watch(0, 100, lambda ok: told.append(("a", ok)))
    deliveries.watch(0, 200, lambda ok: told.append(("b", ok)))
    deliveries.watch(1, 50, lambda ok: told.append(("c", ok)))
    acked = {0: 150, 1: 10}
    deliveries.check(acked.get)
    assert told == [("a", True)]
    acked = {0: 200, 1: 50}
    deliveries.check(acked.get)
    assert told == [("a", True), ("b", True), ("c", True)]
    assert deliveries.waiting == {}  # nothing left to check per datagram


def test_a_lane_that_ends_tells_its_callers_no() -> None:
    told: list[tuple[int, bool]] = []
    deliveries = Deliveries()
    for lane in (0, 1, 2):
        deliveries.watch(lane, 10, lambda ok, lane=lane: told.append((lane, ok)))
    deliveries.check({0: 0, 1: 0}.get)  # lane 2 is gone: reset
    assert told == [(2, False)]
    deliveries.fail(1)
    assert told == [(2, False), (1, False)]
    deliveries.fail()  # the connection ended
    assert told == [(2, False), (1, False), (0, False)]
    assert deliveries.waiting == {}


def test_a_callback_that_raises_is_logged_and_the_others_still_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    told: list[bool] = []

    def broken(ok: bool) -> None:
        raise RuntimeError("a watcher's bug")

    deliveries = Deliveries()
    deliveries.watch(0, 1, broken)
    deliveries.watch(0, 1, told.append)
    with caplog.at_level(logging.ERROR, logger="velomux_quic.transport.deliveries"):
        deliveries.check({0: 1}.get)
    assert told == [True]
    assert "delivery callback failed" in caplog.text
