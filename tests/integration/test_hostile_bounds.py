"""What a node holds for one peer is bounded by the node, not by what the peer grants.

The victim runs in a child process on each engine (aioquic, qh3) and reports its VmRSS and
counters; every attacker holds a certificate of the victim's CA and speaks real QUIC:

1. a member that grants the victim's return dial huge windows (1 GiB per stream, 4 GiB
   per connection) then acknowledges nothing (or one datagram a second), while it sends
   requests as fast as the victim takes them: what the victim admits unacknowledged is
   capped (``max_unacked_bytes``), the replies past the cap are charged and dropped by
   ``max_pending_reply_bytes``, both counted, and (in the slow variant) the connection is
   closed after ``unacked_timeout`` (``unacked_stall``);
2. an honest peer's burst of 50,000 small requests before the victim's return dial to it
   completes: every reply arrives, none dropped;
3. unfinished frames spread over several connections of one peer: bounded per peer;
4. the per-stream path's writes to a member that acknowledges nothing: held to the same
   cap as the lanes, then the connection closed.

Each prints its figures (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_admitted
from tests.integration.hostile_peer import Deafness, hostile_client, hostile_server
from tests.integration.test_hostile_memory import MiB, victim_process
from velomux_quic.ids import InstanceId
from velomux_quic.messenger.envelope import Kind, encode_envelope
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import TransportConfig, TransportHandler
from velomux_quic.transport.admission import AdmissionState, SendAdmission
from velomux_quic.transport.endpoint import QuicEndpoint

pytestmark = [pytest.mark.timeout(180), pytest.mark.one_loop]

ENGINES = ["aioquic", "qh3"]
RSS_BOUND = 16 * MiB
"""What each attack may add to the victim's resident memory."""
UNACKED_CAP = 4 * MiB
"""The victim's ``max_unacked_bytes`` (the default)."""
PAYLOAD = bytes(1000)
_HANDLED = "velo_messenger_handler_requests_total{handler=echo,outcome=success,response_type=unary}"
_DROPPED = "velo_messenger_replies_dropped_total{reason=peer_not_reading}"
_CAPPED = "velo_transport_unacked_cap_reached_total{transport=quic}"


def _rejections(reason: str) -> str:
    return f"velo_transport_rejections_total{{reason={reason},transport=quic}}"


def _request(message_id: int, payload: bytes = PAYLOAD) -> bytes:
    return encode_envelope(Kind.REQUEST, handler="echo", message_id=message_id, payload=payload)


async def _flood(sender: QuicEndpoint, victim: InstanceId, seconds: float) -> int:
    """Requests of 1 KB as fast as the victim takes them, for ``seconds``; returns the count."""
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        outcomes: list[object] = [sender.send(victim, 0, _request(sent + i)) for i in range(1, 501)]
        sent += len(outcomes)
        await wait_admitted(outcomes, timeout=60)
    return sent


async def _unacknowledging_member(
    make_credentials: Callable[..., NodeCredentials],
    tmp_path: Path,
    engine: str,
    deaf: Deafness,
    seconds: float,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    make_credentials("victim").save(tmp_path / "victim")
    hostile = make_credentials("hostile")
    async with (
        victim_process(tmp_path / "victim", engine) as victim,
        hostile_server(hostile, max_stream_data=1 << 30, max_data=4 << 30, deaf=deaf) as server,
        AsyncExitStack() as stack,
    ):
        before = await victim.ask("report")
        host, port = server.address
        # The victim answers on the connection it dialed to the member's listening
        # address; the member's handshake completes, then it stops acknowledging.
        await victim.ask(f"dial {hostile.instance_id} {host} {port}")
        await server.first_connection()
        sender = await QuicEndpoint.start(hostile)
        stack.push_async_callback(sender.close)
        sender.register_peer(victim.instance_id, victim.address)
        sent = await _flood(sender, victim.instance_id, seconds)
        # Every request handled: what the victim holds is what it kept of the replies.
        await victim.until(_HANDLED, sent, timeout=120)
        after = await victim.ask("report")
    return before, after, sent


def _check_bounded(name: str, before: dict[str, Any], after: dict[str, Any], sent: int) -> None:
    grown = (after["rss_kib"] - before["rss_kib"]) * 1024
    metrics = after["metrics"]
    print(
        f"\n{name}: {sent} requests; victim VmRSS {before['rss_kib']} -> {after['rss_kib']} KiB"
        f" (+{grown / MiB:.1f} MiB); unacknowledged {after['unacked_bytes']} B; replies"
        f" waiting {after['pending_reply_bytes']} B, dropped {metrics.get(_DROPPED, 0):.0f};"
        f" cap reached {metrics.get(_CAPPED, 0):.0f}x;"
        f" stalls closed {metrics.get(_rejections('unacked_stall'), 0):.0f}"
    )
    assert metrics[_CAPPED] >= 1
    assert metrics[_DROPPED] >= 1
    assert after["unacked_bytes"] <= UNACKED_CAP + 64 * 1024
    assert after["pending_reply_bytes"] <= 4 * MiB + len(PAYLOAD) + 512
    assert grown < RSS_BOUND, (before["rss_kib"], after["rss_kib"])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "deaf", [Deafness(), Deafness(trickle=1.0)], ids=["never_acks", "acks_a_datagram_a_second"]
)
async def test_a_member_that_grants_huge_windows_and_does_not_acknowledge_is_held_to_the_cap(
    make_credentials: Callable[..., NodeCredentials], tmp_path: Path, engine: str, deaf: Deafness
) -> None:
    before, after, sent = await _unacknowledging_member(
        make_credentials, tmp_path, engine, deaf, seconds=6.0
    )
    _check_bounded(f"unacknowledging member ({engine})", before, after, sent)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "deaf", [Deafness(), Deafness(trickle=1.0)], ids=["never_acks", "acks_a_datagram_a_second"]
)
async def test_a_member_that_does_not_acknowledge_for_40_s_is_bounded_then_closed(
    make_credentials: Callable[..., NodeCredentials], tmp_path: Path, engine: str, deaf: Deafness
) -> None:
    before, after, sent = await _unacknowledging_member(
        make_credentials, tmp_path, engine, deaf, seconds=40.0
    )
    _check_bounded(f"unacknowledging member, 40 s ({engine})", before, after, sent)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_connection_held_at_the_cap_past_unacked_timeout_is_closed_and_counted(
    make_credentials: Callable[..., NodeCredentials], engine: str
) -> None:
    """The close, on a victim in this process with a short ``unacked_timeout``: the member
    keeps the connection alive with a PING a second and never acknowledges."""
    config = TransportConfig(engine=engine, unacked_timeout=2.0)  # type: ignore[arg-type]
    victim = await Node.start(make_credentials("victim"), transport=config)
    victim.register_handler("echo", lambda ctx: bytes(ctx.payload))
    hostile = make_credentials("hostile")
    try:
        async with (
            hostile_server(
                hostile, max_stream_data=1 << 30, max_data=4 << 30, deaf=Deafness()
            ) as server,
            AsyncExitStack() as stack,
        ):
            victim.add_peer(hostile.instance_id, server.address)
            await victim.messenger.transport.connect(hostile.instance_id)
            dialed = victim.messenger.transport.outbound_connection(hostile.instance_id)
            assert dialed is not None
            await server.first_connection()
            sender = await QuicEndpoint.start(hostile)
            stack.push_async_callback(sender.close)
            sender.register_peer(victim.instance_id, victim.address)
            flood = asyncio.ensure_future(_flood(sender, victim.instance_id, 60.0))
            try:
                async with asyncio.timeout(30):
                    await dialed.closed.wait()
            finally:
                flood.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flood
        stats = victim.messenger.transport.stats
        assert stats.rejections["unacked_stall"] >= 1
        assert stats.unacked_cap_reached >= 1
    finally:
        await victim.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_per_stream_writes_to_a_member_that_does_not_acknowledge_are_held_to_the_cap(
    make_credentials: Callable[..., NodeCredentials], engine: str
) -> None:
    """The per-stream path's streams count towards the connection's cap as the lanes do: a
    member granting huge windows and acknowledging nothing holds at most
    ``max_unacked_bytes`` of them (set below the congestion window here, which alone would
    let more go), the sends past it wait, and when ``unacked_timeout`` closes the
    connection they are refused, not left waiting."""
    cap = 8 * 1024
    config = TransportConfig(  # type: ignore[arg-type]
        engine=engine, unacked_timeout=2.0, max_unacked_bytes=cap
    )
    victim = await Node.start(make_credentials("victim"), transport=config)
    hostile = make_credentials("hostile")
    try:
        async with hostile_server(
            hostile, max_stream_data=1 << 30, max_data=4 << 30, deaf=Deafness()
        ) as server:
            victim.add_peer(hostile.instance_id, server.address)
            await victim.messenger.transport.connect(hostile.instance_id)
            dialed = victim.messenger.transport.outbound_connection(hostile.instance_id)
            assert dialed is not None
            await server.first_connection()
            streams = [dialed.open_stream(1 << 20) for _ in range(8)]
            outcomes = [stream.send(bytes(1000)) for _ in range(16) for stream in streams]
            waiting = [o for o in outcomes if isinstance(o, SendAdmission) and not o.done()]
            assert waiting and dialed.snapshot().unacked_bytes <= cap + 1004
            async with asyncio.timeout(30):
                await dialed.closed.wait()
            late = [o for o in waiting if o.state is AdmissionState.ADMITTED]
            admitted = len(outcomes) - len(waiting) + len(late)
            assert 0 < admitted * 1004 <= cap + 1004, admitted  # the cap, plus one frame
            assert all(o.state is AdmissionState.FAILED for o in waiting if o not in late)
        stats = victim.messenger.transport.stats
        assert stats.unacked_cap_reached >= 1
        assert stats.rejections["unacked_stall"] >= 1
    finally:
        await victim.close()


class _Answers(TransportHandler):
    """An honest peer's transport handler: it counts the answers to its requests."""

    def __init__(self, expected: int) -> None:
        self.count = 0
        self.expected = expected
        self.all_in = asyncio.Event()

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        self.count += 1
        if self.count >= self.expected:
            self.all_in.set()


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_honest_burst_before_the_return_dial_completes_loses_no_reply(
    make_credentials: Callable[..., NodeCredentials], tmp_path: Path, engine: str
) -> None:
    make_credentials("victim").save(tmp_path / "victim")
    requests = 50_000
    answers = _Answers(requests)
    async with victim_process(tmp_path / "victim", engine) as victim, AsyncExitStack() as stack:
        peer = await QuicEndpoint.start(make_credentials("honest"), handler=answers)
        stack.push_async_callback(peer.close)
        peer.register_peer(victim.instance_id, victim.address)
        # All at once: the victim has no connection to this peer yet, so it dials back
        # while the requests pour in, and answers them before that dial completes.
        outcomes: list[object] = [
            peer.send(victim.instance_id, 0, _request(i, b"")) for i in range(1, requests + 1)
        ]
        await wait_admitted(outcomes, timeout=60)
        async with asyncio.timeout(90):
            await answers.all_in.wait()
        after = await victim.ask("report")
    print(f"\nhonest burst ({engine}): {answers.count} of {requests} replies")
    assert answers.count == requests
    assert after["metrics"].get(_DROPPED, 0) == 0


async def test_unfinished_frames_are_bounded_per_peer_across_its_connections(
    make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    """Three connections of one peer, each with two 16 MiB frames 5.6 MB begun (11.2 MB
    each, under the 32 MiB bound of one connection): the third passes the peer's."""
    make_credentials("victim").save(tmp_path / "victim")
    hostile = make_credentials("hostile")
    header = (16 * MiB).to_bytes(4, "big")
    async with victim_process(tmp_path / "victim") as victim, AsyncExitStack() as stack:
        for _ in range(3):
            peer = await stack.enter_async_context(hostile_client(hostile, victim.address))
            for lane in range(2):
                peer.write(4 * lane + 2, header + bytes(5_600_000))
        report = await victim.until(_rejections("partial_frame_bytes"), 1, timeout=60)
    assert report["metrics"][_rejections("partial_frame_bytes")] == 1
    assert report["partial_frame_bytes"] <= 32 * MiB + 64 * 1024  # closed past it: one frame more
