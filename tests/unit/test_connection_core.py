"""A connection's timers driven on a fake clock: no socket, no event loop.

Each test runs two :class:`PeerConnection`s on real engines (both engines when qh3 is
installed) over an in-memory path (``connection_pair.py``) and moves time from deadline
to deadline, so every timer the connection keeps is seen to fire at its deadline: the
engine's, the handshake deadline, the half-open reap, the keep-alive, the openings of the
peer's streams, the sweep for stalled frames, the path MTU search and the check for a
peer that holds the connection unacknowledged.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest

from velomux_quic.errors import DialError
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport.admission import ADMITTED
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.framing import frame_header
from velomux_quic.transport.lanes import FIRST_EXTRA_STREAM, stream_of_lane

from .connection_pair import Pair, connection_pair

ENGINES = [
    "aioquic",
    pytest.param(
        "qh3",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("qh3") is None, reason="the qh3 extra is not installed"
        ),
    ),
]

MakeCredentials = Callable[..., NodeCredentials]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def established(make_credentials: MakeCredentials, engine: str, **settings: object) -> Pair:
    config = TransportConfig(engine=engine, **settings)  # type: ignore[arg-type]
    pair = connection_pair(make_credentials, config)
    pair.wire.settle(1.0)
    assert pair.dialer.established and pair.acceptor.established
    assert pair.client.established == pair.server.established == 1
    return pair


def test_the_engine_timer_resends_what_was_lost(
    make_credentials: MakeCredentials, engine: str
) -> None:
    pair = established(make_credentials, engine)
    wire, dialer = pair.wire, pair.dialer
    wire.up = False
    assert dialer.send(0, b"x" * 100) is ADMITTED
    dialer.transmit()
    sent = pair.client.stats.datagrams_out
    assert dialer.next_deadline() is not None
    assert dialer.next_deadline() < wire.now + 1.0  # type: ignore[operator]  # the PTO, not the keep-alive
    wire.settle(2.0)
    assert pair.client.stats.datagrams_out > sent  # probes on the engine's timer alone
    wire.up = True
    wire.settle(2.0)
    assert dialer.snapshot().state == "established"


def test_the_keep_alive_holds_an_idle_connection_past_its_idle_timeout(
    make_credentials: MakeCredentials, engine: str
) -> None:
    pair = established(make_credentials, engine, idle_timeout=3.0, keep_alive_interval=1.0)
    pair.wire.settle(10.0)  # three idle timeouts with nothing to send but the PINGs
    assert pair.dialer.established and pair.acceptor.established
    assert pair.client.stats.datagrams_out >= 9


def test_without_its_peer_the_idle_timeout_ends_it(
    make_credentials: MakeCredentials, engine: str
) -> None:
    pair = established(make_credentials, engine, idle_timeout=3.0, keep_alive_interval=1.0)
    pair.wire.up = False
    pair.wire.settle(10.0)
    assert pair.dialer.closed.is_set() and pair.acceptor.closed.is_set()
    assert pair.dialer.next_deadline() is None  # nothing left to wake it


def test_a_dial_that_hears_nothing_fails_at_its_handshake_deadline(
    make_credentials: MakeCredentials, engine: str
) -> None:
    config = TransportConfig(engine=engine, handshake_timeout=2.0)  # type: ignore[arg-type]
    pair = connection_pair(make_credentials, config)
    pair.wire.up = False
    start = pair.wire.now
    assert pair.dialer.next_deadline() is not None
    pair.wire.run_until(start + 1.9)
    assert pair.dialer.snapshot().state == "handshaking"
    pair.wire.run_until(start + 2.1)
    assert pair.dialer.snapshot().state in ("closing", "closed")
    with pytest.raises(DialError) as failed:
        pair.dialer.wait_established().send(None)  # set already: no loop needed to await it
    assert failed.value.reason == "handshake_timeout"


def test_an_inbound_handshake_gone_silent_is_reaped(
    make_credentials: MakeCredentials, engine: str
) -> None:
    config = TransportConfig(  # type: ignore[arg-type]
        engine=engine, half_open_idle_timeout=0.5, handshake_timeout=30.0
    )
    pair = connection_pair(make_credentials, config)
    pair.server.sendto = lambda data, addr: None  # type: ignore[method-assign]  # the dialer hears nothing back
    pair.wire.run_until(pair.wire.now + 0.2)
    acceptor = pair.acceptor
    assert acceptor.snapshot().state == "handshaking"
    pair.wire.up = False  # and says nothing more
    pair.wire.run_until(pair.wire.now + 1.0)
    assert acceptor.closed.is_set()
    assert pair.server.stats.rejections["handshake_abandoned"] == 1
    assert pair.server.closed == 1


def test_an_opening_never_finished_is_refused_at_its_deadline(
    make_credentials: MakeCredentials, engine: str
) -> None:
    pair = established(make_credentials, engine, stream_opening_timeout=2.0)
    quic = pair.dialer.quic
    quic.send_stream_data(FIRST_EXTRA_STREAM, frame_header(64) + b"only part")
    pair.dialer.transmit()
    pair.wire.settle(1.0)
    assert pair.acceptor.snapshot().stream_openings == 1
    pair.wire.settle(1.5)
    assert pair.acceptor.snapshot().stream_openings == 0
    assert pair.server.stats.rejections["stream_opening_timeout"] == 1
    assert set(pair.server.handler.resets) == {FIRST_EXTRA_STREAM}  # type: ignore[attr-defined]
    assert pair.acceptor.established  # the stream is refused, not the connection


def test_a_stalled_frame_on_a_lane_closes_the_connection_at_the_sweep(
    make_credentials: MakeCredentials, engine: str
) -> None:
    pair = established(make_credentials, engine, partial_frame_timeout=2.0, keep_alive_interval=1.0)
    pair.dialer.quic.send_stream_data(stream_of_lane(0), frame_header(64) + b"only part")
    pair.dialer.transmit()
    pair.wire.settle(0.5)
    assert pair.acceptor.snapshot().partial_frame_bytes > 0
    pair.wire.settle(1.0)
    assert pair.acceptor.established  # a sweep that saw bytes move leaves it
    pair.wire.settle(3.0)  # the next sweep sees nothing moved
    assert not pair.acceptor.established
    assert pair.server.stats.rejections["partial_frame_timeout"] == 1


def test_the_path_mtu_search_probes_up_on_its_own_timer(
    make_credentials: MakeCredentials, engine: str
) -> None:
    config = TransportConfig(  # type: ignore[arg-type]
        engine=engine, loopback_datagram_size=None, pmtu_max=8972
    )
    pair = connection_pair(make_credentials, config)
    pair.wire.max_size = 5000  # probes above it are lost: only their deadlines tell
    pair.wire.settle(1.0)
    assert pair.dialer.established
    stats = pair.client.stats
    if not pair.dialer.quic.features.mtu_probes:
        assert pair.dialer.snapshot().datagram_mode == "base"  # the engine keeps its size
        assert stats.pmtu_probes["sent"] == 0
        return
    pair.wire.settle(30.0)
    snapshot = pair.dialer.snapshot()
    assert stats.pmtu_probes["lost"] >= 3  # declared lost at their deadlines
    assert stats.pmtu_probes["acked"] > 0
    assert snapshot.datagram_size == 4096  # the largest step the path carries
    assert snapshot.datagram_mode == "complete"


def test_a_peer_that_acknowledges_nothing_is_closed_at_the_stall_check(
    make_credentials: MakeCredentials, engine: str
) -> None:
    pair = established(
        make_credentials,
        engine,
        idle_timeout=60.0,
        max_unacked_bytes=64 * 1024,
        unacked_timeout=2.0,
    )
    pair.wire.up = False  # from here on the dialer hears no acknowledgement
    assert pair.dialer.send(0, b"x" * 48 * 1024) is ADMITTED
    pair.wire.settle(1.0)
    assert pair.dialer.established
    assert pair.dialer.snapshot().unacked_bytes > 32 * 1024
    pair.wire.settle(3.0)  # past unacked_timeout above half the cap
    assert not pair.dialer.established
    assert pair.client.stats.rejections["unacked_stall"] == 1
