"""The four resource holes a peer could open, rerun against a victim node in its own process.

Each attack comes over real UDP from a holder of a certificate of the victim's CA (or, for
the handshake flood, from anyone), and each test asserts what the victim's memory grew by
(its VmRSS, read by the victim itself), that the bound's counter counted the refusals, and
that a legitimate peer working through the same victim meanwhile is at most twice as slow
as before the attack (medians of a few rounds, measured side by side in the same test):

1. descriptors of staged payloads past ``staged_payload_max``: the release requests they
   cause are bounded per peer (``max_releases_per_peer``);
2. a flood of unvalidated Initials from the dialer's own address: fresh dials still all
   connect (address validation first, then per-source slots);
3. request streams toward a dialer dribbled in 2-byte STREAM frames: charged what they
   hold, a connection's together bounded (``request_bytes``);
4. requests whose replies the peer never reads: replies charged what they hold
   (``max_pending_reply_bytes``).

Each prints its figures (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode, wait_admitted
from tests.integration.hostile_peer import (
    HostileServerProtocol,
    InitialFlood,
    hostile_server,
    real_initials,
)
from tests.integration.test_hostile_memory import MiB, Victim, victim_process
from velomux_quic.ids import InstanceId
from velomux_quic.messenger.envelope import Kind, StagedDescriptor, encode_envelope
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import TransportConfig, TransportHandler
from velomux_quic.transport.endpoint import QuicEndpoint

# alone: each test asserts a ratio of wall-clock times (tests/run_alone.py).
pytestmark = [pytest.mark.timeout(180), pytest.mark.one_loop, pytest.mark.alone]

RSS_BOUND = 16 * MiB
"""What each attack may add to the victim's resident memory."""
SLOWDOWN_BOUND = 2.0
"""How much slower a legitimate peer may be while the victim is under attack."""
ROUNDS = 5
REPLY = bytes(100)
"""The payload each unread request asks to have echoed."""


def _rejections(reason: str) -> str:
    return f"velo_transport_rejections_total{{reason={reason},transport=quic}}"


async def _median_seconds(operation: Callable[[], Awaitable[None]], rounds: int = ROUNDS) -> float:
    timings = []
    for _ in range(rounds):
        began = time.perf_counter()
        await operation()
        timings.append(time.perf_counter() - began)
    return statistics.median(timings)


def _calls(good: Node, victim: Victim, count: int = 20) -> Callable[[], Awaitable[None]]:
    """A legitimate peer's work: ``count`` calls of 1 KiB answered by the victim."""

    async def work() -> None:
        for number in range(count):
            payload = number.to_bytes(4, "big") * 256
            assert await good.call(victim.instance_id, "echo", payload, timeout=20) == payload

    return work


async def _good_peer(start_nodes: StartNode, victim: Victim) -> Node:
    good = await start_nodes("good")
    good.add_peer(victim.instance_id, victim.address)
    await _calls(good, victim, 5)()  # connected both ways before anything is timed
    return good


def _report(
    name: str, before: dict[str, Any], after: dict[str, Any], calm: float, attacked: float
) -> tuple[int, float]:
    grown = (after["rss_kib"] - before["rss_kib"]) * 1024
    ratio = attacked / calm
    print(
        f"\n{name}: victim VmRSS {before['rss_kib']} -> {after['rss_kib']} KiB"
        f" (+{grown / MiB:.1f} MiB); legitimate peer {calm * 1000:.1f} ms ->"
        f" {attacked * 1000:.1f} ms ({ratio:.2f}x)"
    )
    return grown, ratio


class _SilentPeer(TransportHandler):
    """A hostile node's handler: it never answers a request stream (pull or release)."""

    def __init__(self) -> None:
        self.requests = 0
        self.release = asyncio.Event()

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        self.requests += 1
        await self.release.wait()
        raise LookupError("nothing was ever staged")


async def test_oversized_staged_descriptors_cost_a_bounded_number_of_releases(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    make_credentials("victim").save(tmp_path / "victim")
    descriptors = 20_000
    oversized = 65 * MiB  # past the default staged_payload_max of 64 MiB
    async with victim_process(tmp_path / "victim") as victim, AsyncExitStack() as stack:
        good = await _good_peer(start_nodes, victim)
        calm = await _median_seconds(_calls(good, victim))
        before = await victim.ask("report")
        silent = _SilentPeer()
        hostile = await QuicEndpoint.start(make_credentials("hostile"), handler=silent)
        stack.push_async_callback(hostile.close)
        stack.callback(silent.release.set)
        hostile.register_peer(victim.instance_id, victim.address)
        outcomes: list[object] = [
            hostile.send(
                victim.instance_id,
                0,
                encode_envelope(
                    Kind.MESSAGE,
                    handler="sink",
                    payload=StagedDescriptor(staged_id, oversized).encode(),
                    staged=True,
                ),
            )
            for staged_id in range(1, descriptors + 1)
        ]
        await wait_admitted(outcomes)
        refused = "velo_rendezvous_refusals_total{reason=too_large}"
        await victim.until(refused, descriptors, timeout=60)
        # Within the release_timeout (10 s) in which the old code held a task and a
        # request stream per descriptor.
        attacked = await _median_seconds(_calls(good, victim))
        after = await victim.ask("report")
    grown, ratio = _report("oversized descriptors", before, after, calm, attacked)
    metrics = after["metrics"]
    assert metrics["velo_messenger_staged_releases_skipped_total"] == descriptors - 16
    assert after["releases_outstanding"] <= 16
    assert silent.requests <= 16
    assert grown < RSS_BOUND, (before["rss_kib"], after["rss_kib"])
    assert ratio <= SLOWDOWN_BOUND, (calm, attacked)


async def _dial_once(credentials: NodeCredentials, victim: Victim) -> float | None:
    """A fresh node dials the victim; seconds to an established connection, None if not."""
    dialer = await QuicEndpoint.start(credentials)
    try:
        dialer.register_peer(victim.instance_id, victim.address)
        began = time.perf_counter()
        try:
            await dialer.connect(victim.instance_id)
        except Exception:
            return None
        return time.perf_counter() - began
    finally:
        await dialer.close()


async def test_a_flood_of_initials_from_the_dialers_address_blocks_no_fresh_dial(
    make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    make_credentials("victim").save(tmp_path / "victim")
    dials = 5
    async with victim_process(tmp_path / "victim") as victim:
        calm_dials = [await _dial_once(make_credentials(f"calm-{n}"), victim) for n in range(dials)]
        assert None not in calm_dials
        before = await victim.ask("report")
        # 127.0.0.1: the address every dialer of this test sends from.
        flood = InitialFlood(real_initials(300), "127.0.0.1", victim.address)
        flooding = asyncio.ensure_future(flood.run())
        try:
            async with asyncio.timeout(10):
                while flood.sent < 600:  # every Initial of the pool sent twice
                    await asyncio.sleep(0.01)  # pacing of the flood's own loop, no event
            flooded_dials = [
                await _dial_once(make_credentials(f"fresh-{n}"), victim) for n in range(dials)
            ]
            after = await victim.ask("report")
        finally:
            flood.stop()
            await flooding
    blocked = flooded_dials.count(None)
    calm = statistics.median(t for t in calm_dials if t is not None)
    attacked = statistics.median(t if t is not None else 5.0 for t in flooded_dials)
    grown, ratio = _report(
        f"Initial flood ({flood.sent} Initials), {blocked} of {dials} dials blocked",
        before,
        after,
        calm,
        attacked,
    )
    assert blocked == 0
    metrics = after["metrics"]
    retried = metrics.get(_rejections("handshake_retry"), 0) + metrics.get(
        _rejections("handshake_per_source"), 0
    )
    assert retried > 0
    assert grown < RSS_BOUND, (before["rss_kib"], after["rss_kib"])
    assert ratio <= SLOWDOWN_BOUND, (calm_dials, flooded_dials)


async def _dribble(peer: HostileServerProtocol, streams: int, rounds: int) -> None:
    """``rounds`` 2-byte STREAM frames on each of ``streams`` request streams, none ended.

    Every round writes one frame to each stream and then transmits, so the frames of one
    round share packets but no two frames of one stream are coalesced."""
    quic = peer.connection
    ids = []
    for _ in range(streams):  # a stream's id is taken by its first write
        stream_id = quic.get_next_available_stream_id(is_unidirectional=False)
        quic.send_stream_data(stream_id, b"ab")
        ids.append(stream_id)
    peer.transmit()
    for _ in range(rounds - 1):
        for stream_id in ids:
            with contextlib.suppress(Exception):  # a stream the victim refused
                quic.send_stream_data(stream_id, b"ab")
        peer.transmit()
        await asyncio.sleep(0)  # let the socket drain between rounds


async def test_request_streams_dribbled_in_tiny_frames_are_charged_what_they_hold(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    make_credentials("victim").save(tmp_path / "victim")
    hostile = make_credentials("hostile")
    async with victim_process(tmp_path / "victim") as victim, hostile_server(hostile) as server:
        good = await _good_peer(start_nodes, victim)
        calm = await _median_seconds(_calls(good, victim))
        before = await victim.ask("report")
        host, port = server.address
        await victim.ask(f"dial {hostile.instance_id} {host} {port}")
        peer = await server.first_connection()
        await _dribble(peer, streams=2_000, rounds=200)
        # A PING is answered once every datagram before it was read: the legitimate peer
        # is timed against the victim's memory, not against its backlog of frames.
        async with asyncio.timeout(60):
            await peer.ping()
        await victim.until(_rejections("request_bytes"), 1, timeout=60)
        attacked = await _median_seconds(_calls(good, victim))
        after = await victim.ask("report")
    grown, ratio = _report("2-byte request frames", before, after, calm, attacked)
    assert after["metrics"][_rejections("request_bytes")] >= 1
    assert after["partial_requests"] <= 1024 * 1024 // 2048
    assert grown < RSS_BOUND, (before["rss_kib"], after["rss_kib"])
    assert ratio <= SLOWDOWN_BOUND, (calm, attacked)


@pytest.mark.parametrize("engine", ["aioquic", "qh3"])
async def test_replies_a_peer_never_reads_are_charged_what_they_hold(
    start_nodes: StartNode,
    make_credentials: Callable[..., NodeCredentials],
    tmp_path: Path,
    engine: str,
) -> None:
    make_credentials("victim").save(tmp_path / "victim")
    async with victim_process(tmp_path / "victim", engine) as victim, AsyncExitStack() as stack:
        good = await _good_peer(start_nodes, victim)
        calm = await _median_seconds(_calls(good, victim))
        before = await victim.ask("report")
        hostile = await QuicEndpoint.start(
            make_credentials("hostile"), config=TransportConfig(lane_window=64 * 1024)
        )
        stack.push_async_callback(hostile.close)
        hostile.pause_reading(victim.instance_id, 0)  # it asks, and never reads an answer
        hostile.register_peer(victim.instance_id, victim.address)
        # Replies of 100 bytes: 60,000 of them (7.8 MB) are far more than the paused
        # lane's window plus the victim's send_buffer, on either engine, so most wait.
        requests = 60_000
        outcomes: list[object] = [
            hostile.send(
                victim.instance_id,
                0,
                encode_envelope(Kind.REQUEST, handler="echo", message_id=i, payload=REPLY),
            )
            for i in range(1, requests + 1)
        ]
        await wait_admitted(outcomes, timeout=60)
        dropped = "velo_messenger_replies_dropped_total{reason=peer_not_reading}"
        handled = (
            "velo_messenger_handler_requests_total"
            "{handler=echo,outcome=success,response_type=unary}"
        )
        # Every request handled: the legitimate peer is timed against what the victim
        # holds, not against its backlog of requests to run.
        await victim.until(handled, requests + 5 + ROUNDS * 20, timeout=60)
        assert (await victim.ask("report"))["metrics"][dropped] >= 1
        attacked = await _median_seconds(_calls(good, victim))
        after = await victim.ask("report")
    grown, ratio = _report("unread replies", before, after, calm, attacked)
    assert after["metrics"][dropped] >= 1
    assert after["pending_reply_bytes"] <= 4 * MiB + 512 + len(REPLY)
    assert grown < RSS_BOUND, (before["rss_kib"], after["rss_kib"])
    assert ratio <= SLOWDOWN_BOUND, (calm, attacked)
