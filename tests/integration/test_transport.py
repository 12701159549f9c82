"""The QUIC transport between two real nodes over loopback UDP with mutual TLS."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import pytest
from prometheus_client import generate_latest

from tests.conftest import NodeFactory, Recorder, needs_stream_backpressure, wait_admitted
from velomux_quic.errors import (
    ChannelClosed,
    ConfigurationError,
    DialError,
    LaneError,
    MessageTooLarge,
    PeerNotRegistered,
    TransportClosed,
)
from velomux_quic.ids import new_instance_id
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import (
    CloseCode,
    PeerLink,
    QuicEndpoint,
    StreamData,
    StreamReset,
    StreamStopped,
)
from velomux_quic.transport.admission import ADMITTED, AdmissionState, SendAdmission
from velomux_quic.transport.config import TransportConfig


def seq(n: int, size: int = 32) -> bytes:
    return n.to_bytes(4, "big") + bytes(size - 4)


async def test_frames_on_several_lanes_arrive_in_order_per_lane(start_node: NodeFactory) -> None:
    config = TransportConfig(lanes=4)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    a.register_peer(b.instance_id, b.address)
    per_lane = 1500
    outcomes = [a.send(b.instance_id, i % 4, seq(i // 4)) for i in range(4 * per_lane)]
    await wait_admitted(outcomes)
    await b_seen.wait_until(lambda: b_seen.count() == 4 * per_lane)
    for lane in range(4):
        got = [int.from_bytes(f[:4], "big") for f in b_seen.frames[(a.instance_id, lane)]]
        assert got == list(range(per_lane)), f"lane {lane} out of order"
    assert b_seen.connected == [(a.instance_id, False)]  # identity from the certificate


@needs_stream_backpressure
async def test_stopped_reader_drives_its_lane_to_pending_while_another_lane_flows(
    start_node: NodeFactory,
) -> None:
    config = TransportConfig(lanes=2, lane_window=64 * 1024, send_buffer=64 * 1024)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    a.register_peer(b.instance_id, b.address)
    await a.connect(b.instance_id)
    b.pause_reading(a.instance_id, 1)

    frame = bytes(1024)
    sent_on_1: list[object] = []
    pending: SendAdmission | None = None
    for _ in range(10_000):  # bounded: the window plus send buffer is ~128 frames
        outcome = a.send(b.instance_id, 1, frame)
        sent_on_1.append(outcome)
        if isinstance(outcome, SendAdmission):
            pending = outcome
            break
    assert pending is not None, "lane 1 never pushed back"
    assert len(sent_on_1) < 1000

    lane0 = [a.send(b.instance_id, 0, seq(i)) for i in range(2000)]
    await wait_admitted(lane0)
    await b_seen.wait_until(lambda: len(b_seen.frames[(a.instance_id, 0)]) == 2000)
    assert pending.state is AdmissionState.PENDING
    assert len(b_seen.frames[(a.instance_id, 1)]) < len(sent_on_1)
    held = a.snapshot().to(b.instance_id)
    assert held is not None and held.state == "established" and held.open_lanes == (0, 1)
    # Lane 1 waits on b's window, which nothing a transmits can open.
    assert held.blocked_streams == 1 and held.held_by_peer_window == 1
    (inbound,) = b.snapshot().inbound_from(a.instance_id)
    assert not inbound.outbound and inbound.open_lanes == (0, 1)

    b.resume_reading(a.instance_id, 1)
    await asyncio.wait_for(_await(pending), 20)
    await b_seen.wait_until(lambda: len(b_seen.frames[(a.instance_id, 1)]) == len(sent_on_1))
    released = a.snapshot().to(b.instance_id)
    assert released is not None and released.blocked_streams == 0


async def _await(admission: SendAdmission) -> None:
    await admission


async def test_killed_connection_refuses_pending_admissions_and_next_send_redials(
    start_node: NodeFactory,
) -> None:
    config = TransportConfig(lane_window=16 * 1024, send_buffer=16 * 1024)
    b, b_seen = await start_node("b", config=config)
    a, a_events = await start_node("a", config=config)
    a.register_peer(b.instance_id, b.address)
    await a.connect(b.instance_id)
    b.pause_reading(a.instance_id, 0)
    waiting: list[SendAdmission] = []
    for i in range(5000):
        outcome = a.send(b.instance_id, 0, seq(i, 512))
        if isinstance(outcome, SendAdmission):
            waiting.append(outcome)
            if len(waiting) == 10:
                break
    assert len(waiting) == 10

    b.disconnect(a.instance_id)  # the receiver cuts the connection mid-stream
    for admission in waiting:
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(_await(admission), 20)
    await a_events.wait_until(lambda: (b.instance_id, True) in a_events.disconnected)
    # Admitted but never acknowledged: reported to the node's error handler, not lost silently.
    assert a_events.failures and a_events.failures[0][1] == 0

    b.resume_reading(a.instance_id, 0)
    before = b_seen.count()
    assert a.send(b.instance_id, 0, b"after") is not None
    await b_seen.wait_until(lambda: b_seen.frames[(a.instance_id, 0)][-1:] == [b"after"])
    assert a.stats.dials == 2
    assert b_seen.count() > before


async def test_oversized_inbound_frame_closes_only_that_connection(start_node: NodeFactory) -> None:
    b, b_seen = await start_node("b", config=TransportConfig(max_message_size=1024))
    a, a_events = await start_node("a")  # allows larger frames than b accepts
    c, _ = await start_node("c")
    a.register_peer(b.instance_id, b.address)
    c.register_peer(b.instance_id, b.address)
    await wait_admitted([c.send(b.instance_id, 0, b"c-before")])
    a.send(b.instance_id, 0, b"ok")
    a.send(b.instance_id, 0, bytes(4096))
    await b_seen.wait_until(lambda: b.stats.rejections["oversized_frame"] == 1)
    assert b_seen.frames[(a.instance_id, 0)] == [b"ok"]
    # the good peer is untouched and a's next send re-dials
    c.send(b.instance_id, 0, b"c-after")
    await b_seen.wait_until(lambda: b_seen.frames[(c.instance_id, 0)] == [b"c-before", b"c-after"])
    await a_events.wait_until(lambda: (b.instance_id, True) in a_events.disconnected)
    assert a.outbound_connection(b.instance_id) is None
    a.send(b.instance_id, 0, b"again")
    await b_seen.wait_until(lambda: b_seen.frames[(a.instance_id, 0)] == [b"ok", b"again"])


async def test_local_send_errors_are_typed(start_node: NodeFactory) -> None:
    a, _ = await start_node("a", config=TransportConfig(max_message_size=100, lanes=2))
    b, _ = await start_node("b")
    with pytest.raises(PeerNotRegistered):
        a.send(new_instance_id(), 0, b"x")
    a.register_peer(b.instance_id, b.address)
    with pytest.raises(MessageTooLarge):
        a.send(b.instance_id, 0, bytes(101))
    with pytest.raises(LaneError):
        a.send(b.instance_id, 16, b"x")
    assert a.lanes(b.instance_id) == 2
    await a.close()
    with pytest.raises(TransportClosed):
        a.send(b.instance_id, 0, b"x")


async def test_health_check_answers_for_a_live_peer_and_fails_for_a_dead_one(
    start_node: NodeFactory,
) -> None:
    b, _ = await start_node("b")
    a, _ = await start_node("a", config=TransportConfig(handshake_timeout=1.0))
    a.register_peer(b.instance_id, b.address)
    await a.check_health(b.instance_id, timeout=5)
    await b.close()
    # The dead peer's connection closed, so the check dials again and that dial fails.
    with pytest.raises((ChannelClosed, DialError, TimeoutError)):
        await a.check_health(b.instance_id, timeout=1.5)


async def test_health_check_waits_as_long_as_the_configuration_says(
    start_node: NodeFactory,
) -> None:
    with pytest.raises(ConfigurationError, match="health_check_timeout"):
        TransportConfig(health_check_timeout=0)
    config = TransportConfig(handshake_timeout=30.0, health_check_timeout=0.5)
    a, _ = await start_node("a", config=config)
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    try:
        silent.bind(("127.0.0.1", 0))
        peer = new_instance_id()
        a.register_peer(peer, silent.getsockname())
        async with asyncio.timeout(4) as outer:  # the old fixed default was 5 s
            with pytest.raises(TimeoutError):
                await a.check_health(peer)
        assert not outer.expired()
    finally:
        silent.close()


async def test_lane_reset_reaches_the_receiver_and_other_lanes_continue(
    start_node: NodeFactory,
) -> None:
    config = TransportConfig(lanes=2)
    b, b_seen = await start_node("b", config=config)
    a, _ = await start_node("a", config=config)
    a.register_peer(b.instance_id, b.address)
    await wait_admitted([a.send(b.instance_id, lane, b"hello") for lane in (0, 1)])
    await b_seen.wait_until(lambda: b_seen.count() == 2)
    with pytest.raises(LaneError):
        a.reset_lane(b.instance_id, 16)
    a.reset_lane(b.instance_id, 1)
    await b_seen.wait_until(lambda: b_seen.resets == [(a.instance_id, 1)])
    await wait_admitted([a.send(b.instance_id, 0, b"still here")])
    await b_seen.wait_until(lambda: b_seen.frames[(a.instance_id, 0)][-1] == b"still here")


async def test_metrics_are_exported_from_the_node_registry(start_node: NodeFactory) -> None:
    b, b_seen = await start_node("b")
    a, _ = await start_node("a")
    a.register_peer(b.instance_id, b.address)
    assert a.send(b.instance_id, 0, b"x") is not ADMITTED  # still dialing: waits in the gate
    await b_seen.wait_until(lambda: b_seen.count() == 1)
    text = generate_latest(a.registry).decode()
    assert 'velo_transport_frames_total{direction="outbound",message_type="message"' in text
    assert 'velo_transport_send_backpressure_total{transport="quic"} 1.0' in text
    assert 'velo_transport_active_connections{transport="quic"} 1.0' in text


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to count sockets")
async def test_closed_transports_leave_no_task_timer_or_socket(
    make_credentials: object,
) -> None:
    from velomux_quic.transport.endpoint import QuicEndpoint

    creds = make_credentials  # fixture factory
    assert callable(creds)
    fds_before = _open_fds()
    tasks_before = asyncio.all_tasks()
    b = await QuicEndpoint.start(creds("b"))
    a = await QuicEndpoint.start(creds("a"), config=TransportConfig(lanes=3))
    a.register_peer(b.instance_id, b.address)
    await wait_admitted([a.send(b.instance_id, lane, b"x" * 100) for lane in range(3)])
    await a.check_health(b.instance_id)
    assert len(_open_fds() - fds_before) == 2
    await asyncio.gather(a.close(), b.close())
    assert a.closed and b.closed
    assert a.connection_count() == 0 and b.connection_count() == 0
    assert _open_fds() - fds_before == set()
    assert asyncio.all_tasks() == tasks_before
    for transport in (a, b):
        assert transport.snapshot().connections == ()  # nothing left to hold timers


class Server(Recorder):
    """Answers request streams with the request reversed, or waits on a gate first."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.served = 0

    async def serve_request(self, peer: object, request: bytes) -> bytes:
        if self.gate is not None:
            await self.gate.wait()
        if request == b"refuse":
            raise ValueError("no")
        self.served += 1
        return request[::-1] * (1 if not request.startswith(b"big") else 100_000)


async def test_request_stream_pulls_from_the_dialer_without_touching_lanes(
    start_node: NodeFactory, make_credentials: object
) -> None:
    from velomux_quic.errors import RequestRefused, ResponseTooLarge
    from velomux_quic.transport.endpoint import QuicEndpoint

    b, b_seen = await start_node("b")
    server = Server()
    a = await QuicEndpoint.start(make_credentials("a"), handler=server)  # type: ignore[operator]
    try:
        a.register_peer(b.instance_id, b.address)
        with pytest.raises(ChannelClosed):  # a has not dialed b yet: nothing to ask on
            await b.request(a.instance_id, b"x", max_response=10, timeout=5)
        await wait_admitted([a.send(b.instance_id, 0, b"hello")])
        await b_seen.wait_until(lambda: b_seen.count() == 1)

        assert await b.request(a.instance_id, b"abc", max_response=10, timeout=5) == b"cba"
        big = await b.request(a.instance_id, b"big!", max_response=1 << 20, timeout=10)
        assert len(big) == 400_000
        with pytest.raises(ResponseTooLarge):
            await b.request(a.instance_id, b"big!", max_response=1000, timeout=10)
        with pytest.raises(RequestRefused):
            await b.request(a.instance_id, b"refuse", max_response=10, timeout=5)

        # a slow answer does not hold the lane: frames keep arriving meanwhile
        server.gate = asyncio.Event()
        slow = asyncio.ensure_future(b.request(a.instance_id, b"slow", max_response=10, timeout=10))
        await wait_admitted([a.send(b.instance_id, 0, b"during")])
        await b_seen.wait_until(lambda: b_seen.count() == 2)
        assert not slow.done()
        server.gate.set()
        assert await slow == b"wols"
        with pytest.raises(TimeoutError):
            server.gate = asyncio.Event()
            await b.request(a.instance_id, b"never", max_response=10, timeout=0.2)
        server.gate.set()
    finally:
        await a.close()


class StreamRecorder(Recorder):
    """Claims every non-lane stream and records its events with the link they came on."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[PeerLink, StreamData | StreamReset | StreamStopped | None]] = []

    def _note(self, link: PeerLink, event: StreamData | StreamReset | StreamStopped | None) -> None:
        self.events.append((link, event))
        self.changed()

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        self._note(link, event)
        return True

    def stream_reset(self, link: PeerLink, event: StreamReset) -> None:
        self._note(link, event)

    def stream_stopped(self, link: PeerLink, event: StreamStopped) -> None:
        self._note(link, event)

    def connection_lost(self, link: PeerLink) -> None:
        self._note(link, None)


async def test_non_lane_streams_reach_the_handler_as_transport_events_with_one_link(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    b_seen = StreamRecorder()
    b = await QuicEndpoint.start(make_credentials("b"), handler=b_seen)
    a_seen = StreamRecorder()
    a = await QuicEndpoint.start(make_credentials("a"), handler=a_seen)
    try:
        a.register_peer(b.instance_id, b.address)
        first, second = a.open_stream(b.instance_id), a.open_stream(b.instance_id)
        await wait_admitted([first.send(b"one"), second.send(b"two")])
        await b_seen.wait_until(lambda: len(b_seen.events) >= 2)
        link = b_seen.events[0][0]
        assert link.peer == a.instance_id and not link.outbound
        assert {link for link, _ in b_seen.events} == {link}  # one link per connection
        data = {e.stream_id: e.data for _, e in b_seen.events if isinstance(e, StreamData)}
        assert data == {first.stream_id: b"\0\0\0\x03one", second.stream_id: b"\0\0\0\x03two"}

        first.abort()  # RESET_STREAM: the receiver hears it as the transport's event
        await b_seen.wait_until(lambda: isinstance(b_seen.events[-1][1], StreamReset))
        assert b_seen.events[-1] == (link, StreamReset(first.stream_id, CloseCode.SHUTDOWN))

        link.stop_receiving(second.stream_id)  # STOP_SENDING: the writer's stream is reset
        await a_seen.wait_until(lambda: bool(a_seen.events))
        (a_link, stopped) = a_seen.events[0]
        assert a_link.peer == b.instance_id and a_link.outbound
        assert stopped == StreamStopped(second.stream_id)
        assert second.gate.closed

        a.disconnect(b.instance_id)
        await b_seen.wait_until(lambda: b_seen.events[-1] == (link, None))
    finally:
        await a.close()
        await b.close()
