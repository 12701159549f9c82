"""Streaming between two real nodes through a lossy, delayed path (the demo's UDP proxy).

The producer knows the consumer only by the proxy's address, so its connection crosses
the proxy; the consumer learns the producer's address from that connection's source,
which is the proxy's upstream socket, so its own connection back (attach replies, mux
credit) crosses the proxy too. Both directions drop about 3% of datagrams and delay the
rest by a few milliseconds: QUIC has to retransmit, on both connections, and every stream
must still deliver each of its items exactly once, in order, on the mux and on the
per-stream path.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.programs.demo.proxy import Impairment, ImpairmentProxy
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.sender import Retired, StreamSender
from velomux_quic.transport.config import TransportConfig

IMPAIRMENT = Impairment(loss=0.03, delay=0.003, jitter=0.001, seed=1)
STREAMS = 16
ITEMS = 100
PAYLOAD = 700
"""Bytes of padding per item: enough datagrams (about 1,200 data packets) that a 3% loss
rate drops dozens of them, few enough for a run of a couple of seconds."""


@pytest.fixture(params=[MESSENGER_MUX_KEY, PER_STREAM_KEY])
def path(request: pytest.FixtureRequest) -> str:
    """The transport the producer's senders negotiate."""
    return str(request.param)


def _open_fds() -> set[str]:
    """This process's descriptors, except those on /dev/null (uvloop keeps one for the
    life of the process once anything spawned a subprocess: not a leak of this test)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != os.devnull:
                found.add(fd)
        except OSError:
            pass
    return found


def item(index: int, number: int) -> list[object]:
    return [index, number, bytes([number % 256]) * PAYLOAD]


async def produce(senders: list[StreamSender]) -> list[Retired]:
    """The forward-pass shape: one item per stream per pass, then finalize every stream."""
    for number in range(ITEMS):
        for index, sender in enumerate(senders):
            await sender.send(item(index, number))
    return list(await asyncio.gather(*(sender.finalize() for sender in senders)))


async def drain(anchor: StreamAnchor[Any]) -> list[object]:
    return [received async for received in anchor]


async def stream_through(a: Node, b: Node, path: str) -> None:
    """STREAMS x ITEMS from ``a`` to ``b``; each stream must arrive whole and in order."""
    anchors = [b.create_anchor() for _ in range(STREAMS)]
    senders = list(await asyncio.gather(*(a.attach_anchor(anchor.handle) for anchor in anchors)))
    assert {sender.negotiated_transport() for sender in senders} == {path}
    producer = asyncio.ensure_future(produce(senders))
    try:
        results = await asyncio.gather(*(drain(anchor) for anchor in anchors))
        retired = await producer
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
    for index, received in enumerate(results):
        # msgpack gives lists back; compare item by item for a readable failure
        assert len(received) == ITEMS, f"stream {index}: {len(received)} of {ITEMS} items"
        assert received == [item(index, n) for n in range(ITEMS)], f"stream {index} out of order"
    assert set(retired) == {Retired.SENT}
    assert all(anchor.finished for anchor in anchors)


@pytest.mark.timeout(60)
async def test_every_stream_arrives_exactly_once_in_order_through_loss_and_delay(
    start_nodes: StartNode, path: str
) -> None:
    fds_before, tasks_before = _open_fds(), asyncio.all_tasks()
    # The proxy stands for a network path: Ethernet-sized datagrams, as across hosts (to a
    # peer on this host, which the proxy's loopback address is, the transport uses 16 KiB).
    options: dict[str, object] = {"transport": TransportConfig(max_datagram_size=1452)}
    if path == PER_STREAM_KEY:
        options["mux"] = MuxConfig(enabled=False)  # a node without the mux speaks per-stream
    b = await start_nodes("consumer", **options)
    async with ImpairmentProxy(b.address, IMPAIRMENT) as proxy:
        a = await start_nodes("producer", **options)
        a.add_peer(b.instance_id, proxy.address)
        async with asyncio.timeout(45):
            await stream_through(a, b, path)
        # Both connections crossed the proxy: b dials a back at the proxy's upstream socket.
        assert b.messenger.transport.peer_address(a.instance_id) not in (None, a.address)
        assert proxy.clients == 1
        counters = proxy.counters
        for direction in (counters.client_to_server, counters.server_to_client):
            assert direction.forwarded > 0
            assert direction.dropped_overflow == direction.send_errors == 0
        assert counters.client_to_server.dropped_loss >= 10  # QUIC really had to recover
        assert counters.server_to_client.dropped_loss >= 1
        await a.close()
        await b.close()
    assert asyncio.all_tasks() - tasks_before == set()
    assert _open_fds() == fds_before
