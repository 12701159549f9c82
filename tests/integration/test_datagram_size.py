"""Datagram sizes per path, between two real transports over loopback UDP.

A peer on this host gets the loopback size with no configuration, on both connections of
the pair (the one each node dialed); a pinned size is honoured, and bounded by what the
peer accepts. Path discovery runs through the impairment proxy with a size limit (a
narrow path): probes above the limit are lost, the size settles below it, and nothing
else is lost. Real QUIC, real TLS, real UDP; what the tests read comes from snapshots and
metrics.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from prometheus_client import generate_latest

from tests.conftest import NodeFactory, Recorder, needs_mtu_probes, wait_admitted
from velomux_quic.ids import InstanceId
from velomux_quic.programs.demo.proxy import Impairment, ImpairmentProxy
from velomux_quic.transport import QuicEndpoint
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.snapshot import ConnectionSnapshot

pytestmark = pytest.mark.timeout(60)


def body(index: int, size: int) -> bytes:
    """A frame whose content proves it arrived whole: its index, then a digest stream."""
    seed = hashlib.sha256(index.to_bytes(4, "big")).digest()
    return index.to_bytes(4, "big") + (seed * (size // len(seed) + 1))[: size - 4]


async def exchange(
    a: QuicEndpoint, b: QuicEndpoint, b_seen: Recorder, *, frames: int, size: int
) -> None:
    """``a`` sends ``frames`` frames of ``size`` bytes to ``b``; all arrive whole, in order."""
    a.register_peer(b.instance_id, b.address)
    await wait_admitted([a.send(b.instance_id, 0, body(i, size)) for i in range(frames)])
    await b_seen.wait_until(lambda: b_seen.count(a.instance_id) == frames)
    received = b_seen.frames[(a.instance_id, 0)]
    assert received == [body(i, size) for i in range(frames)]


def outbound(transport: QuicEndpoint, peer: InstanceId) -> ConnectionSnapshot:
    connection = transport.snapshot().to(peer)
    assert connection is not None
    return connection


def inbound(transport: QuicEndpoint, peer: InstanceId) -> ConnectionSnapshot:
    (connection,) = transport.snapshot().inbound_from(peer)
    return connection


async def test_a_peer_on_this_host_gets_the_loopback_size_both_ways_unconfigured(
    start_node: NodeFactory,
) -> None:
    """The engine's own loopback size ("auto"): 16 KiB on aioquic, 1,452 B on qh3."""
    b, b_seen = await start_node("b")
    a, a_seen = await start_node("a")
    await exchange(a, b, b_seen, frames=64, size=100_000)
    await exchange(b, a, a_seen, frames=8, size=50_000)  # b dials a: the other pair
    engine = a.snapshot().engine
    assert engine is not None
    size = engine.loopback_datagram_size
    assert size == {"aioquic": 16384, "qh3": 1452}[engine.name]
    for here, there in ((a, b), (b, a)):
        for connection in (outbound(here, there.instance_id), inbound(here, there.instance_id)):
            assert (connection.datagram_size, connection.datagram_mode) == (size, "loopback")
    text = generate_latest(a.registry).decode()
    below = 1200 if size == 1452 else 8972
    assert f'velo_transport_datagram_size_bytes_bucket{{le="{size}",transport="quic"}} 2.0' in text
    assert f'velo_transport_datagram_size_bytes_bucket{{le="{below}",transport="quic"}} 0.0' in text


async def test_a_loopback_size_set_applies_on_either_engine(start_node: NodeFactory) -> None:
    config = TransportConfig(loopback_datagram_size=4096)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    await exchange(a, b, b_seen, frames=16, size=60_000)
    assert (outbound(a, b.instance_id).datagram_size, outbound(a, b.instance_id).datagram_mode) == (
        4096,
        "loopback",
    )


async def test_a_pinned_size_is_used_and_bounds_what_the_peer_sends(
    start_node: NodeFactory,
) -> None:
    b, b_seen = await start_node("b", config=TransportConfig(loopback_datagram_size=16384))
    a, a_seen = await start_node("a", config=TransportConfig(max_datagram_size=4000))
    await exchange(a, b, b_seen, frames=32, size=60_000)
    await exchange(b, a, a_seen, frames=32, size=60_000)
    assert (outbound(a, b.instance_id).datagram_size, outbound(a, b.instance_id).datagram_mode) == (
        4000,
        "pinned",
    )
    # b's connection to a is bounded by a's max_udp_payload_size, the pinned size.
    assert (outbound(b, a.instance_id).datagram_size, outbound(b, a.instance_id).datagram_mode) == (
        4000,
        "loopback",
    )
    assert inbound(b, a.instance_id).datagram_size == 4000


async def test_the_base_size_when_both_are_pinned_to_it(start_node: NodeFactory) -> None:
    config = TransportConfig(max_datagram_size=1452)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    await exchange(a, b, b_seen, frames=16, size=20_000)
    assert outbound(a, b.instance_id).datagram_size == 1452
    assert inbound(b, a.instance_id).datagram_size == 1452


async def wait_for_search(transport: QuicEndpoint, peer: InstanceId) -> ConnectionSnapshot:
    """Until the search on the connection to ``peer`` ended. No event reports that to a
    test (only the snapshot shows it), so this is a bounded poll of the snapshot."""
    async with asyncio.timeout(20):
        while True:
            connection = outbound(transport, peer)
            if connection.datagram_mode == "complete":
                return connection
            await asyncio.sleep(0.05)


@needs_mtu_probes
@pytest.mark.parametrize(("limit", "settled"), [(1500, 1452), (9000, 8972), (5000, 4096)])
async def test_discovery_through_a_narrow_path_settles_below_its_limit(
    start_node: NodeFactory, limit: int, settled: int
) -> None:
    """``loopback_datagram_size=None`` makes a peer on this host one like any other, so the
    proxy's size limit is the path's MTU."""
    config = TransportConfig(loopback_datagram_size=None, pmtu_max=16384)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    async with ImpairmentProxy(b.address, Impairment(max_datagram=limit)) as proxy:
        a.register_peer(b.instance_id, proxy.address)
        await exchange_via(a, b, b_seen, frames=16, size=30_000)
        connection = await wait_for_search(a, b.instance_id)
        assert connection.datagram_size == settled
        # Data flows at the new size: probes were the only datagrams lost to the limit.
        await more(a, b, b_seen, frames=64, size=30_000)
        counters = proxy.counters.client_to_server
        stats = generate_latest(a.registry).decode()
        await a.close()  # while the proxy still carries its goodbye
    lost = metric(stats, 'velo_transport_pmtu_probes_total{outcome="lost",transport="quic"}')
    assert counters.dropped_too_big == lost > 0
    assert metric(stats, 'velo_transport_pmtu_probes_total{outcome="acked",transport="quic"}') >= (
        1 if settled > 1452 else 0
    )
    assert metric(stats, 'velo_transport_pmtu_black_holes_total{transport="quic"}') == 0


async def exchange_via(
    a: QuicEndpoint, b: QuicEndpoint, b_seen: Recorder, *, frames: int, size: int
) -> None:
    """As :func:`exchange`, to a peer already registered (through the proxy)."""
    await wait_admitted([a.send(b.instance_id, 0, body(i, size)) for i in range(frames)])
    await b_seen.wait_until(lambda: b_seen.count(a.instance_id) == frames)


async def more(
    a: QuicEndpoint, b: QuicEndpoint, b_seen: Recorder, *, frames: int, size: int
) -> None:
    before = b_seen.count(a.instance_id)
    await wait_admitted([a.send(b.instance_id, 0, body(i, size)) for i in range(frames)])
    await b_seen.wait_until(lambda: b_seen.count(a.instance_id) == before + frames)
    received = b_seen.frames[(a.instance_id, 0)][before:]
    assert received == [body(i, size) for i in range(frames)]


def metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not exported")


@needs_mtu_probes
async def test_a_path_that_narrows_after_the_raise_falls_back_and_streams_on(
    start_node: NodeFactory,
) -> None:
    """Black-hole detection end to end: settled at 8972 through the proxy, the path then
    drops everything above 1500 bytes. Full-size packets are lost, the confirmation probes
    too, the connection falls back to 1452 and every frame still arrives whole."""
    config = TransportConfig(loopback_datagram_size=None)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    async with ImpairmentProxy(b.address, Impairment(max_datagram=9000)) as proxy:
        a.register_peer(b.instance_id, proxy.address)
        await exchange_via(a, b, b_seen, frames=16, size=30_000)
        assert (await wait_for_search(a, b.instance_id)).datagram_size == 8972
        await more(a, b, b_seen, frames=16, size=30_000)  # at 8972
        proxy.narrow(1500)
        await more(a, b, b_seen, frames=64, size=30_000)
        connection = outbound(a, b.instance_id)
        stats = generate_latest(a.registry).decode()
        assert proxy.counters.client_to_server.dropped_too_big > 0
        await a.close()  # while the proxy still carries its goodbye
    assert (connection.datagram_size, connection.datagram_mode) == (1452, "black_hole")
    assert metric(stats, 'velo_transport_pmtu_black_holes_total{transport="quic"}') == 1
