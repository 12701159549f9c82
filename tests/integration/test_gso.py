"""Batched datagrams (UDP GSO out, GRO in) between two real transports over loopback UDP.

A pair streams the same frames, whole and in order, with batching on, off, and on one side
only, under each engine, at the 1452-byte base datagram size that a path across hosts
uses (pinned here: on loopback a connection would use the larger loopback size). What
the tests read comes from snapshots and metrics; the kernel's refusal of a train cannot
be caused on loopback, so the fallback is tested with a test double socket in
tests/unit/test_batched_udp.py.
"""

from __future__ import annotations

import importlib.util

import pytest
from prometheus_client import generate_latest

from tests.conftest import NodeFactory
from tests.integration.test_datagram_size import exchange, inbound, outbound
from velomux_quic import runtime_info
from velomux_quic.transport import QuicEndpoint
from velomux_quic.transport.batched_udp import batching_available
from velomux_quic.transport.config import TransportConfig

pytestmark = pytest.mark.timeout(60)

ENGINES = [
    "aioquic",
    pytest.param(
        "qh3",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("qh3") is None, reason="qh3 is not installed"
        ),
    ),
]

KERNEL_BATCHES = batching_available() == (True, True)


def counter(transport: QuicEndpoint, name: str) -> float:
    text = generate_latest(transport.registry).decode()
    prefix = f'velo_transport_{name}_total{{transport="quic"}} '
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line[len(prefix) :])


def config(engine: str, gso: bool) -> TransportConfig:
    return TransportConfig(engine=engine, gso=gso, max_datagram_size=1452)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("a_gso", "b_gso"), [(True, True), (False, False), (True, False)])
async def test_a_pair_streams_whole_with_batching_on_off_and_mixed(
    start_node: NodeFactory, engine: str, a_gso: bool, b_gso: bool
) -> None:
    b, b_seen = await start_node("b", config=config(engine, b_gso))
    a, a_seen = await start_node("a", config=config(engine, a_gso))
    await exchange(a, b, b_seen, frames=64, size=60_000)
    await exchange(b, a, a_seen, frames=16, size=30_000)
    assert outbound(a, b.instance_id).datagram_size == 1452
    assert inbound(b, a.instance_id).datagram_size == 1452
    for node, wanted in ((a, a_gso), (b, b_gso)):
        udp = node.snapshot().udp
        assert udp is not None
        assert (udp.gso, udp.gro) == ((wanted and KERNEL_BATCHES),) * 2
        assert udp.refused_paths == 0
        assert counter(node, "gso_fallbacks") == 0
    # Trains leave only from a batching sender; whole trains arrive only at a GRO socket.
    assert (counter(a, "gso_trains") > 0) == (a_gso and KERNEL_BATCHES)
    assert (counter(b, "gro_buffers") > 0) == (a_gso and b_gso and KERNEL_BATCHES)
    if not a_gso:
        assert counter(a, "gso_trains") == 0
    if not b_gso:
        assert counter(b, "gro_buffers") == 0


async def test_the_environment_turns_batching_off(
    start_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VELOMUX_UDP_GSO", "0")
    b, b_seen = await start_node("b", config=TransportConfig(max_datagram_size=1452))
    a, _ = await start_node("a", config=TransportConfig(max_datagram_size=1452))
    await exchange(a, b, b_seen, frames=16, size=60_000)
    for node in (a, b):
        udp = node.snapshot().udp
        assert udp is not None and (udp.gso, udp.gro) == (False, False)
    assert counter(a, "gso_trains") == 0
    info = runtime_info()
    assert (info.udp_gso, info.udp_gro, info.udp_batching_off) == (False, False, True)
    assert "UDP GSO/GRO: off (VELOMUX_UDP_GSO=0)" in info.describe()


def test_the_runtime_info_says_what_the_kernel_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VELOMUX_UDP_GSO", raising=False)
    info = runtime_info()
    assert (info.udp_gso, info.udp_gro) == batching_available()
    assert info.udp_batching_off is False
    yes_no = ("yes" if info.udp_gso else "no", "yes" if info.udp_gro else "no")
    assert f"UDP GSO: {yes_no[0]}, GRO: {yes_no[1]}" in info.describe()
