"""Path MTU discovery's state machine (sans-IO) and the per-path plan, without a network.

:class:`PathMtuSearch` is driven here the way a connection drives it: ask for a probe,
say it was sent, report its acknowledgement or loss (or let its deadline pass).
"""

from __future__ import annotations

import pytest

from velomux_quic.errors import ConfigurationError
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.engine_choice import engine_features
from velomux_quic.transport.pmtu import (
    BLACK_HOLE_HOLD,
    MAX_PROBES,
    RAISE_INTERVAL,
    DatagramMode,
    PathMtuSearch,
    is_same_host,
    plan_path,
)

TIMEOUT = 0.1


class Path:
    """A path that carries datagrams up to ``mtu`` bytes (UDP payload), instantly."""

    def __init__(self, mtu: int) -> None:
        self.mtu = mtu
        self.now = 0.0
        self.probes: list[int] = []

    def run(self, search: PathMtuSearch, *, steps: int = 100) -> None:
        """Answer every probe the search sends until it sends none."""
        for _ in range(steps):
            size = search.next_probe(self.now)
            if size is None:
                return
            self.probes.append(size)
            search.probe_sent(size, self.now, TIMEOUT)
            if size <= self.mtu:
                search.probe_acked(size)
            else:  # lost: nothing comes back, the deadline passes
                self.now += TIMEOUT
                assert search.expire(self.now) == size
        raise AssertionError(f"still probing after {steps} probes: {self.probes}")


def test_a_jumbo_path_settles_at_its_largest_step() -> None:
    search = PathMtuSearch(1452, 16384)
    path = Path(9000 - 28)  # IPv4 under a 9000-byte MTU
    path.run(search)
    assert search.size == 8972
    assert search.mode is DatagramMode.COMPLETE
    # Steps up while acknowledged, then the next step fails MAX_PROBES times in a row.
    assert path.probes == [4096, 8952, 8972, *[16384] * MAX_PROBES]


def test_an_ipv6_jumbo_path_stops_at_8952() -> None:
    search = PathMtuSearch(1452, 16384)
    Path(9000 - 48).run(search)
    assert search.size == 8952


def test_an_ethernet_path_stays_at_the_base() -> None:
    search = PathMtuSearch(1452, 8972)
    path = Path(1500 - 28)
    path.run(search)
    assert search.size == 1452
    assert path.probes == [4096] * MAX_PROBES
    assert search.mode is DatagramMode.COMPLETE


def test_the_maximum_is_never_exceeded_and_is_probed_itself() -> None:
    search = PathMtuSearch(1452, 6000)
    path = Path(65000)
    path.run(search)
    assert path.probes == [4096, 6000]
    assert search.size == 6000


def test_a_maximum_at_the_base_sends_no_probe() -> None:
    search = PathMtuSearch(1452, 1452)
    assert search.next_probe(0.0) is None
    assert search.mode is DatagramMode.COMPLETE


def test_the_size_is_raised_only_by_an_acknowledgement() -> None:
    search = PathMtuSearch(1452, 8972)
    assert search.next_probe(0.0) == 4096
    search.probe_sent(4096, 0.0, TIMEOUT)
    assert search.size == 1452  # sent is not enough
    assert search.next_probe(0.0) is None  # one probe at a time
    assert search.probe_acked(4096)
    assert search.size == 4096


def test_one_lost_probe_is_retried_and_a_later_ack_raises() -> None:
    search = PathMtuSearch(1452, 8972)
    search.probe_sent(search.next_probe(0.0) or 0, 0.0, TIMEOUT)
    assert search.probe_lost(4096, 0.05)  # congestion, say
    assert search.next_probe(0.05) == 4096  # the same size again, not "too big" yet
    search.probe_sent(4096, 0.05, TIMEOUT)
    search.probe_acked(4096)
    assert search.size == 4096
    assert search.next_probe(0.1) == 8952


def test_a_loss_reported_twice_counts_once() -> None:
    search = PathMtuSearch(1452, 8972)
    search.probe_sent(4096, 0.0, TIMEOUT)
    assert search.expire(TIMEOUT) == 4096
    assert not search.probe_lost(4096, TIMEOUT)  # QUIC's loss detection, later
    for _ in range(MAX_PROBES - 1):
        search.probe_sent(search.next_probe(1.0) or 0, 1.0, TIMEOUT)
        search.probe_lost(4096, 1.0)
    assert search.next_probe(1.0) is None  # exactly MAX_PROBES losses made 4096 too big
    assert search.size == 1452


def test_a_late_acknowledgement_of_a_given_up_probe_still_raises() -> None:
    search = PathMtuSearch(1452, 8972)
    search.probe_sent(4096, 0.0, TIMEOUT)
    search.expire(TIMEOUT)
    assert search.probe_acked(4096)
    assert search.size == 4096


def test_the_deadline_is_the_probes_and_expire_waits_for_it() -> None:
    search = PathMtuSearch(1452, 8972)
    assert search.deadline is None
    search.probe_sent(4096, 1.0, TIMEOUT)
    assert search.deadline == pytest.approx(1.0 + TIMEOUT)
    assert search.expire(1.05) is None
    assert search.probing == 4096


def test_a_black_hole_falls_back_to_the_base_and_searches_again_later() -> None:
    search = PathMtuSearch(1452, 8972)
    path = Path(8972)
    path.run(search)
    assert search.size == 8972
    # Full-size packets start being lost: the path no longer carries 8972.
    path.mtu = 1472
    search.large_packets_lost(2)
    assert search.next_probe(path.now) is None  # a couple of losses may be congestion
    search.large_packets_lost(1)
    assert search.next_probe(path.now) == 8972  # confirm the size in use
    for _ in range(MAX_PROBES):
        size = search.next_probe(path.now)
        assert size == 8972
        search.probe_sent(size, path.now, TIMEOUT)
        path.now += TIMEOUT
        search.expire(path.now)
    assert search.size == 1452
    assert search.mode is DatagramMode.BLACK_HOLE
    assert search.black_holes == 1
    assert search.next_probe(path.now) is None  # held at the base for a while
    assert search.deadline == pytest.approx(path.now + BLACK_HOLE_HOLD)
    path.now += BLACK_HOLE_HOLD
    path.probes.clear()
    path.run(search)
    assert search.size == 1452  # the narrow path again: stays at the base
    assert path.probes == [4096] * MAX_PROBES


def test_a_confirmed_size_survives_ordinary_losses() -> None:
    search = PathMtuSearch(1452, 8972)
    path = Path(8972)
    path.run(search)
    search.large_packets_lost(5)
    assert search.next_probe(path.now) == 8972
    search.probe_sent(8972, path.now, TIMEOUT)
    search.probe_acked(8972)  # the path still carries it: the losses were congestion
    assert search.size == 8972
    assert search.next_probe(path.now) is None
    assert search.black_holes == 0


def test_losses_at_the_base_size_are_not_a_black_hole() -> None:
    search = PathMtuSearch(1452, 8972)
    Path(1472).run(search)
    search.large_packets_lost(100)
    assert search.next_probe(1.0) is None
    assert search.size == 1452


def test_a_finished_search_tries_again_after_the_raise_interval() -> None:
    search = PathMtuSearch(1452, 8972)
    path = Path(1472)
    path.run(search)
    assert search.deadline == pytest.approx(path.now + RAISE_INTERVAL)
    path.mtu = 9000 - 28  # the path changed: jumbo frames now
    path.now += RAISE_INTERVAL
    path.run(search)
    assert search.size == 8972


# -- the per-path plan -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local", "remote", "same"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("0.0.0.0", "127.0.0.5", True),
        ("::", "::1", True),
        ("::", "::ffff:127.0.0.1", True),
        ("10.0.0.1", "10.0.0.1", True),
        ("::ffff:10.0.0.1", "10.0.0.1", True),
        ("10.0.0.1", "10.0.0.2", False),
        ("0.0.0.0", "10.0.0.2", False),
        ("0.0.0.0", "0.0.0.0", False),
        ("10.0.0.1", "not an address", False),
    ],
)
def test_same_host_is_loopback_or_our_own_bound_address(
    local: str, remote: str, same: bool
) -> None:
    assert is_same_host(local, remote) is same


JUMBO = 16384
"""The engine's own loopback size these plans are given (aioquic's)."""


def test_the_plan_per_path() -> None:
    default = TransportConfig()
    assert plan_path(default, "127.0.0.1", "127.0.0.1", JUMBO).mode is DatagramMode.LOOPBACK
    assert plan_path(default, "127.0.0.1", "127.0.0.1", JUMBO).size == 16384
    across = plan_path(default, "10.0.0.1", "10.0.0.2", JUMBO)
    assert (across.mode, across.size, across.search_max) == (DatagramMode.SEARCHING, 1452, 8972)
    pinned = plan_path(TransportConfig(max_datagram_size=9000), "127.0.0.1", "127.0.0.1", JUMBO)
    assert (pinned.mode, pinned.size, pinned.search_max) == (DatagramMode.PINNED, 9000, None)
    off = plan_path(TransportConfig(pmtu_discovery=False), "10.0.0.1", "10.0.0.2", JUMBO)
    assert (off.mode, off.size) == (DatagramMode.BASE, 1452)
    anywhere = plan_path(
        TransportConfig(loopback_datagram_size=None), "127.0.0.1", "127.0.0.1", JUMBO
    )
    assert anywhere.mode is DatagramMode.SEARCHING


@pytest.mark.parametrize("engine", ["aioquic", "qh3"])
def test_auto_takes_each_engines_own_loopback_size_and_a_size_set_applies_on_either(
    engine: str,
) -> None:
    """Each engine's own size to a peer on this host (aioquic jumbo, qh3 the base size); a
    size the user sets is never second-guessed."""
    if engine == "qh3":
        pytest.importorskip("qh3")
    features = engine_features(engine)  # type: ignore[arg-type]
    own = plan_path(TransportConfig(), "127.0.0.1", "127.0.0.1", features.loopback_datagram_size)
    assert own.mode is DatagramMode.LOOPBACK
    assert own.size == features.loopback_datagram_size == {"aioquic": 16384, "qh3": 1452}[engine]
    chosen = TransportConfig(loopback_datagram_size=4096)
    set_size = plan_path(chosen, "127.0.0.1", "127.0.0.1", features.loopback_datagram_size)
    assert (set_size.mode, set_size.size) == (DatagramMode.LOOPBACK, 4096)


def test_the_sizes_the_config_derives() -> None:
    assert TransportConfig().base_datagram_size == 1452
    assert TransportConfig().accepted_datagram_size == 16384
    assert TransportConfig(pmtu_max=32768).accepted_datagram_size == 32768
    pinned = TransportConfig(max_datagram_size=4000)
    assert (pinned.base_datagram_size, pinned.accepted_datagram_size) == (4000, 4000)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"max_datagram_size": 1000}, "max_datagram_size must be 1200 to 65000"),
        ({"max_datagram_size": 70000}, "max_datagram_size must be 1200 to 65000"),
        ({"pmtu_max": 1300}, "pmtu_max must be at least 1452"),
        ({"pmtu_max": 65001}, "pmtu_max must be 1200 to 65000"),
        ({"loopback_datagram_size": 800}, "loopback_datagram_size must be 1200 to 65000"),
        (
            {"loopback_datagram_size": "big"},
            'loopback_datagram_size must be a size in bytes, "auto"',
        ),
    ],
)
def test_bad_sizes_are_refused_naming_the_key_and_the_reason(
    options: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named):
        TransportConfig(**options)  # type: ignore[arg-type]
