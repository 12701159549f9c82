"""What one authenticated peer can make a node hold on its connections: how many it keeps
open, the unfinished frames of its lanes, and the openings of the streams it opens. Each
hostile peer holds a certificate of the victim's CA and dials over real QUIC."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

from tests.conftest import NodeFactory, StartNode, wait_admitted
from tests.integration.hostile_peer import hostile_client
from tests.polling import poll_until
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import TransportConfig
from velomux_quic.transport.endpoint import QuicEndpoint

_HEADER = struct.Struct(">I")
_FIRST_STREAM = 66
"""The first client-initiated unidirectional stream that is not a lane."""


def _rejected(node: Node, reason: str) -> float:
    value = node.registry.get_sample_value(
        "velo_transport_rejections_total", {"transport": "quic", "reason": reason}
    )
    return value or 0.0


async def _stream_intact(consumer: Node, producer: Node, items: int = 200) -> None:
    """A legitimate stream from ``producer`` through ``consumer``, every item in order."""
    producer.add_peer(consumer.instance_id, consumer.address)
    anchor = consumer.create_anchor()

    async def produce() -> None:
        sender = await producer.attach_anchor(anchor.handle)
        for number in range(items):
            await sender.send({"n": number})
        await sender.finalize()

    async def consume() -> list[object]:
        return [item async for item in anchor]

    async with asyncio.timeout(20):
        _, received = await asyncio.gather(produce(), consume())
    assert received == [{"n": n} for n in range(items)]


async def test_a_peer_holds_at_most_its_connection_bound_and_the_newest_one_works(
    start_node: NodeFactory, make_credentials: Callable[..., NodeCredentials]
) -> None:
    victim, seen = await start_node("victim", config=TransportConfig(max_connections_per_peer=2))
    credentials = make_credentials("hostile")
    dialers: list[QuicEndpoint] = []
    for number in range(5):  # one certificate, five endpoints, each dialing the victim
        dialer, _ = await start_node(credentials=credentials)
        dialer.register_peer(victim.instance_id, victim.address)
        await wait_admitted([dialer.send(victim.instance_id, 0, b"hello %d" % number)])
        dialers.append(dialer)
        await seen.wait_until(lambda n=number: seen.count() == n + 1)  # type: ignore[misc]
    assert victim.stats.rejections["connections_per_peer"] == 3

    def established() -> list[str]:
        inbound = victim.snapshot().inbound_from(credentials.instance_id)
        return [c.state for c in inbound if c.state == "established"]

    await poll_until(lambda: len(established()) == 2)
    await wait_admitted([dialers[-1].send(victim.instance_id, 0, b"the newest still works")])
    await seen.wait_until(lambda: seen.count() == 6)
    assert seen.frames[(credentials.instance_id, 0)][-1] == b"the newest still works"


async def test_unfinished_frames_on_every_lane_close_the_connection_past_their_bound(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials]
) -> None:
    config = TransportConfig(max_partial_frame_bytes=16 << 20)  # = max_message_size
    victim = await start_nodes("victim", transport=config)
    hostile = make_credentials("hostile")
    piece = 5_600_000  # of a frame announcing 16 MiB, on each lane: three lanes are too many
    announced = _HEADER.pack(16 << 20)
    async with hostile_client(hostile, victim.address) as peer:

        def partial() -> int:
            return sum(
                c.partial_frame_bytes
                for c in victim.snapshot().transport.inbound_from(hostile.instance_id)
            )

        peer.write(2, announced + bytes(piece))
        await poll_until(lambda: partial() == piece + 4)
        assert _rejected(victim, "partial_frame_bytes") == 0
        for lane in (1, 2):
            peer.write(4 * lane + 2, announced + bytes(piece))
        await poll_until(lambda: _rejected(victim, "partial_frame_bytes") == 1)
        await poll_until(lambda: partial() == 0)
    await _stream_intact(victim, await start_nodes("good"))


async def test_a_frame_begun_and_abandoned_closes_its_connection_after_the_timeout(
    start_node: NodeFactory, make_credentials: Callable[..., NodeCredentials]
) -> None:
    victim, seen = await start_node("victim", config=TransportConfig(partial_frame_timeout=0.2))
    hostile = make_credentials("hostile")
    async with hostile_client(hostile, victim.address) as peer:
        peer.write(2, _HEADER.pack(5) + b"whole" + _HEADER.pack(1000) + b"begun, never ended")
        await seen.wait_until(lambda: seen.count() == 1)
        await poll_until(lambda: victim.stats.rejections["partial_frame_timeout"] == 1)
        await poll_until(lambda: not victim.snapshot().inbound_from(hostile.instance_id))
    # A lane that keeps sending, frame after frame, is never taken for a stalled one.
    good, _ = await start_node("good")
    good.register_peer(victim.instance_id, victim.address)
    for number in range(10):
        await wait_admitted([good.send(victim.instance_id, 0, bytes(100_000))])
        await seen.wait_until(lambda n=number: seen.count() == n + 2)  # type: ignore[misc]
    assert victim.stats.rejections["partial_frame_timeout"] == 1


async def test_stream_openings_are_bounded_in_count_size_and_time(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials]
) -> None:
    config = TransportConfig(max_stream_openings=16, stream_opening_timeout=1.0)
    victim = await start_nodes("victim", transport=config)
    hostile = make_credentials("hostile")

    def openings() -> int:
        inbound = victim.snapshot().transport.inbound_from(hostile.instance_id)
        return sum(c.stream_openings for c in inbound)

    def receivers() -> int:
        per_stream = victim.snapshot().streaming.per_stream
        assert per_stream is not None
        return per_stream.receivers

    async with hostile_client(hostile, victim.address) as peer:
        # 40 streams, each announcing its 16-byte opening and sending 2 bytes of it.
        for index in range(40):
            peer.write(_FIRST_STREAM + 4 * index, _HEADER.pack(16) + b"\x00\x01")
        await poll_until(lambda: _rejected(victim, "stream_openings") == 24)
        await poll_until(lambda: openings() == 16)
        assert receivers() == 16
        # None finishes: each is refused at its deadline, and its receiver freed.
        await poll_until(lambda: _rejected(victim, "stream_opening_timeout") == 16)
        assert openings() == 0 and receivers() == 0
        # A first frame announcing more than an opening can be.
        peer.write(_FIRST_STREAM + 4 * 40, _HEADER.pack(4096) + bytes(100))
        await poll_until(lambda: _rejected(victim, "stream_opening_size") == 1)
        assert openings() == 0 and receivers() == 0
        await _stream_intact(victim, await start_nodes("good"))
