"""Hostile peers over real authenticated QUIC: what they can make a node hold is bounded,
every refusal is counted, and legitimate peers keep working."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.conftest import NodeFactory
from tests.integration.hostile_peer import hostile_server
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport.endpoint import QuicTransport


def _partial_requests(transport: QuicTransport) -> int:
    return sum(c.partial_requests for c in transport.snapshot().connections)


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_request_stream_reset_halfway_is_freed(
    start_node: NodeFactory, make_credentials: Callable[..., NodeCredentials]
) -> None:
    hostile_credentials = make_credentials("hostile")
    victim, _ = await start_node("victim")
    async with hostile_server(hostile_credentials) as server:
        victim.register_peer(hostile_credentials.instance_id, server.address)
        await victim.connect(hostile_credentials.instance_id)
        peer = await server.first_connection()
        streams = [peer.open_request(b"half of a request") for _ in range(8)]
        await _until(lambda: _partial_requests(victim) == 8)
        for stream_id in streams:
            peer.reset(stream_id)
        await _until(lambda: _partial_requests(victim) == 0)
