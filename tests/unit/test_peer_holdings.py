"""This node's own bounds per connection and per peer, sans IO: the unacknowledged-bytes
cap (InflightBound, PeerHoldings), the peer's turns of the loop, and their configuration."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from velomux_quic.errors import ConfigurationError
from velomux_quic.transport import TransportConfig
from velomux_quic.transport.admission import (
    CONTENTION_WINDOW,
    InflightBound,
    PeerHoldings,
    PeerLedger,
)

pytestmark = pytest.mark.timeout(10)


def test_the_room_is_the_smaller_of_the_connections_cap_and_its_peers() -> None:
    ledger = PeerLedger(peer_limit=150)
    first, second = InflightBound(100, now=0.0), InflightBound(100, now=0.0)
    first.holdings = ledger.join("peer", lambda: None)
    second.holdings = ledger.join("peer", lambda: None)
    first.written(60)
    assert first.room() == 40
    second.written(80)
    assert second.room() == 10  # the peer's 150, less 60 + 80
    assert first.room() == 10
    first.resync(0, now=1.0)  # acknowledged
    assert second.room() == 20 and first.room() == 70
    second.detach()
    assert first.room() == 100


def test_a_connection_is_stalled_from_when_it_last_held_at_most_half_its_cap() -> None:
    bound = InflightBound(100, now=0.0)
    bound.written(40)
    assert bound.stalled_for(5.0) == 0.0
    bound.written(30)
    assert bound.stalled_for(12.0) == 7.0  # calm last seen at 5.0
    bound.resync(70, now=20.0)  # nothing acknowledged
    assert bound.stalled_for(20.0) == 15.0
    bound.resync(50, now=21.0)  # back to half: calm again
    assert bound.stalled_for(21.0) == 0.0


def test_a_ledger_forgets_a_peer_with_its_last_connection() -> None:
    ledger = PeerLedger(peer_limit=10)
    wake_a: Callable[[], None] = lambda: None  # noqa: E731
    wake_b: Callable[[], None] = lambda: None  # noqa: E731
    holdings = ledger.join("peer", wake_a)
    assert ledger.join("peer", wake_b) is holdings
    ledger.leave("peer", holdings, wake_a)
    assert len(ledger) == 1
    ledger.leave("peer", holdings, wake_b)
    assert len(ledger) == 0


def test_room_opened_on_one_connection_wakes_the_peers_others() -> None:
    woken: list[str] = []
    holdings = PeerHoldings(peer_limit=10)
    first: Callable[[], None] = lambda: woken.append("first")  # noqa: E731
    holdings.join(first)
    holdings.join(lambda: woken.append("second"))
    holdings.wake_others(first)
    assert woken == ["second"]


def test_a_peers_turn_is_spent_then_refilled_after_what_the_loop_runs_now() -> None:
    scheduled: list[Callable[[], None]] = []
    holdings = PeerHoldings(peer_limit=10, turn_bytes=100, call_soon=scheduled.append)
    assert holdings.take_turn(60) == 60
    assert holdings.take_turn(60) == 40  # cut at the share: the caller keeps the rest
    assert holdings.take_turn(1) == 0
    resumed: list[int] = []
    holdings.defer(lambda: resumed.append(holdings.turn_left))
    assert len(scheduled) == 1  # one refill per turn
    scheduled.pop()()
    assert resumed == [100]
    assert holdings.take_turn(100) == 100


def test_a_peer_alone_on_the_loop_keeps_its_burst_whole() -> None:
    scheduled: list[Callable[[], None]] = []
    ledger = PeerLedger(10, turn_bytes=100, call_soon=scheduled.append, clock=lambda: 5.0)
    alone = ledger.join("alone", lambda: None)
    # Nobody else: shares renew on the spot, and a piece past the share is never cut.
    assert [alone.take_turn(60) for _ in range(10)] == [60] * 10
    assert alone.take_turn(65_000) == 65_000
    assert len(scheduled) == 1  # one refill, as for any turn


def test_shares_apply_while_another_peer_had_data_within_the_window() -> None:
    now = [10.0]
    ledger = PeerLedger(10, turn_bytes=100, call_soon=lambda _: None, clock=lambda: now[0])
    flooder = ledger.join("flooder", lambda: None)
    other = ledger.join("other", lambda: None)
    assert other.take_turn(10) == 10
    assert flooder.take_turn(65_000) == 100  # a whole burst in one piece: cut at the share
    assert flooder.take_turn(1) == 0  # the other peer is here
    now[0] += CONTENTION_WINDOW / 2
    assert flooder.take_turn(1) == 0  # ... and was lately
    now[0] += CONTENTION_WINDOW
    assert flooder.take_turn(100) == 100  # it has been quiet for a window: shares renew
    assert flooder.take_turn(65_000) == 65_000


def test_without_a_clock_every_share_holds() -> None:
    holdings = PeerLedger(10, turn_bytes=100).join("peer", lambda: None)
    assert holdings.take_turn(100) == 100
    assert holdings.take_turn(1) == 0


@pytest.mark.parametrize(
    "options",
    [
        {"peer_turn_bytes": 0},
        {"max_unacked_bytes": 0},
        {"max_unacked_bytes": 16 << 20, "max_unacked_bytes_per_peer": 8 << 20},
        {"unacked_timeout": 0.0},
    ],
)
def test_the_new_bounds_refuse_values_that_bound_nothing(options: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        TransportConfig(**options)  # type: ignore[arg-type]
