"""Hostile peers over real authenticated QUIC: what they can make a node hold is bounded,
every refusal is counted, and legitimate peers keep working."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest

from tests.conftest import NodeFactory, wait_admitted
from tests.integration.hostile_peer import InitialFlood, hostile_server, real_initials
from tests.polling import poll_until
from velomux_quic.ids import InstanceId
from velomux_quic.messenger import Context, Messenger, MessengerConfig
from velomux_quic.messenger.envelope import Kind, StagedDescriptor, encode_envelope
from velomux_quic.messenger.messenger import REPLY_OVERHEAD
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import TransportConfig, TransportHandler
from velomux_quic.transport.endpoint import QuicEndpoint


def _partial_requests(transport: QuicEndpoint) -> int:
    return sum(c.partial_requests for c in transport.snapshot().connections)


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
        await poll_until(lambda: _partial_requests(victim) == 8)
        for stream_id in streams:
            peer.reset(stream_id)
        await poll_until(lambda: _partial_requests(victim) == 0)


class _StallingPeer(TransportHandler):
    """A hostile node's transport handler: it never answers a pull of what it 'staged'."""

    def __init__(self) -> None:
        self.pulls_seen = 0
        self.release = asyncio.Event()

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        self.pulls_seen += 1
        await self.release.wait()
        raise LookupError("nothing was ever staged")


def _counter(messenger: Messenger, name: str, **labels: str) -> float:
    return messenger.registry.get_sample_value(name, labels) or 0.0


async def test_a_flood_of_staged_descriptors_is_held_to_the_pull_bound(
    make_credentials: Callable[..., NodeCredentials], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="velomux_quic.messenger.rendezvous")
    bound = 32
    async with AsyncExitStack() as stack:
        victim = await Messenger.start(
            make_credentials("victim"), config=MessengerConfig(max_pulls_per_peer=bound)
        )
        stack.push_async_callback(victim.close)
        stalling = _StallingPeer()
        hostile = await QuicEndpoint.start(make_credentials("hostile"), handler=stalling)
        stack.push_async_callback(hostile.close)
        stack.callback(stalling.release.set)
        good = await Messenger.start(make_credentials("good"))
        stack.push_async_callback(good.close)
        victim.register("echo", lambda ctx: bytes(ctx.payload))
        victim.register("sink", lambda ctx: None)

        hostile.register_peer(victim.instance_id, victim.address)
        descriptors = 2_000
        outcomes = [
            hostile.send(
                victim.instance_id,
                0,
                encode_envelope(
                    Kind.MESSAGE,
                    handler="sink",
                    payload=StagedDescriptor(staged_id, 4096).encode(),
                    staged=True,
                ),
            )
            for staged_id in range(1, descriptors + 1)
        ]
        await wait_admitted(outcomes)
        refused = "velo_messenger_staged_pulls_refused_total"
        await poll_until(
            lambda: _counter(victim, refused, reason="count") == descriptors - bound, timeout=20
        )
        snapshot = victim.snapshot()
        assert snapshot.pulls_outstanding == bound
        assert snapshot.pull_bytes_outstanding == bound * 4096
        assert stalling.pulls_seen <= 1  # one lane's pulls run in turn: the first one stalls

        good.add_peer(victim.instance_id, victim.address)
        assert await good.unary(victim.instance_id, "echo", b"still served", timeout=10) == (
            b"still served"
        )
        assert victim.snapshot().pulls_outstanding == bound
        warnings = [r for r in caplog.records if r.name == "velomux_quic.messenger.rendezvous"]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not 1,968 times


async def test_replies_to_a_peer_that_stops_reading_are_bounded_then_dropped(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    bound = 64 * 1024
    async with AsyncExitStack() as stack:
        victim = await Messenger.start(
            make_credentials("victim"),
            config=MessengerConfig(max_pending_reply_bytes=bound),
            transport_config=TransportConfig(send_buffer=0),
        )
        stack.push_async_callback(victim.close)
        hostile = await QuicEndpoint.start(
            make_credentials("hostile"), config=TransportConfig(lane_window=64 * 1024)
        )
        stack.push_async_callback(hostile.close)
        good = await Messenger.start(make_credentials("good"))
        stack.push_async_callback(good.close)
        handled = 0

        def echo(ctx: Context) -> bytes:
            nonlocal handled
            handled += 1
            return bytes(ctx.payload)

        victim.register("echo", echo)
        hostile.pause_reading(victim.instance_id, 0)  # it asks, and never reads an answer
        hostile.register_peer(victim.instance_id, victim.address)
        requests = 1_000
        outcomes = [
            hostile.send(
                victim.instance_id,
                0,
                encode_envelope(Kind.REQUEST, handler="echo", message_id=i, payload=bytes(1024)),
            )
            for i in range(1, requests + 1)
        ]
        await wait_admitted(outcomes)
        await poll_until(lambda: handled == requests, timeout=20)
        dropped = _counter(
            victim, "velo_messenger_replies_dropped_total", reason="peer_not_reading"
        )
        assert dropped > requests // 2, dropped
        waiting = victim.snapshot().pending_reply_bytes
        assert 0 < waiting <= bound + 1024 + REPLY_OVERHEAD, waiting

        good.add_peer(victim.instance_id, victim.address)
        assert await good.unary(victim.instance_id, "echo", b"answered", timeout=10) == b"answered"


@pytest.mark.parametrize(
    ("config", "counted"),
    [
        (TransportConfig(max_half_open_per_source=8), "handshake_per_source"),
        (TransportConfig(retry_threshold=4), "handshake_retry"),
    ],
    ids=["per_source", "retry"],
)
async def test_a_real_peer_connects_through_a_handshake_flood(
    start_node: NodeFactory, config: TransportConfig, counted: str
) -> None:
    victim, _ = await start_node("victim", config=config)
    good, _ = await start_node("good")
    good.register_peer(victim.instance_id, victim.address)
    flood = InitialFlood(real_initials(300), "127.0.0.2", victim.address)
    flooding = asyncio.ensure_future(flood.run())
    try:
        # Every Initial of the pool sent once: more than the 256 half-open handshakes
        # that used to lock out every later dial.
        await poll_until(lambda: flood.sent >= 300)
        await good.connect(victim.instance_id)  # DialError(handshake_timeout) when locked out
    finally:
        flood.stop()
        await flooding
    assert victim.stats.rejections[counted] > 0
    inbound = victim.snapshot().inbound_from(good.instance_id)
    assert [c.state for c in inbound] == ["established"]


async def test_abandoned_inbound_handshakes_are_reaped_early(start_node: NodeFactory) -> None:
    config = TransportConfig(half_open_idle_timeout=0.2, handshake_timeout=30.0)
    victim, _ = await start_node("victim", config=config)
    flood = InitialFlood(real_initials(10), "127.0.0.2", victim.address)
    await flood.run_once()
    await poll_until(lambda: victim.stats.rejections["handshake_abandoned"] == 10)
    assert victim.snapshot().connections == ()  # gone long before the 30 s deadline
