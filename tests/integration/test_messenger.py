"""The messenger between real nodes over loopback QUIC with mutual TLS."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
from prometheus_client import generate_latest

from velomux_quic.errors import (
    ConfigurationError,
    HandlerExists,
    HandlerFailed,
    PeerGone,
    RemoteRefused,
    SendTimeout,
    UnaryTimeout,
    UnknownHandler,
)
from velomux_quic.ids import InstanceId
from velomux_quic.messenger import Context, HeaderCodec, Messenger, MessengerConfig, StagedRefusal
from velomux_quic.messenger.envelope import Kind, StagedDescriptor, encode_envelope
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import SendAdmission, TransportConfig

MiB = 1024 * 1024
Start = Callable[..., Awaitable[Messenger]]


@pytest.fixture
async def start(make_credentials: Callable[..., NodeCredentials]) -> AsyncIterator[Start]:
    async with AsyncExitStack() as stack:

        async def start_messenger(
            name: str = "node",
            *,
            config: MessengerConfig | None = None,
            transport_config: TransportConfig | None = None,
            cls: type[Messenger] = Messenger,
        ) -> Messenger:
            messenger = await cls.start(
                make_credentials(name), config=config, transport_config=transport_config
            )
            stack.push_async_callback(messenger.close)
            return messenger

        yield start_messenger


class Waiter:
    """Collects values and wakes a test when a condition holds: an event, never a sleep."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self._event = asyncio.Event()

    def add(self, item: object) -> None:
        self.items.append(item)
        self._event.set()

    async def until(self, predicate: Callable[[list[object]], bool], timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self.items):
                self._event.clear()
                await self._event.wait()


def value(ctx: Context) -> int:
    return int.from_bytes(bytes(ctx.payload[:4]), "big")


async def test_every_kind_of_call_works_and_replies_find_their_way_back(start: Start) -> None:
    b = await start("b", transport_config=TransportConfig(lanes=4))
    a = await start("a", transport_config=TransportConfig(lanes=4))
    a.add_peer(b.instance_id, b.address)  # b never learns a's address explicitly
    fired = Waiter()

    def record(ctx: Context) -> None:
        fired.add((ctx.sender, ctx.lane, bytes(ctx.payload)))

    async def echo(ctx: Context) -> bytes:
        return bytes(ctx.payload)[::-1] + b"@%d" % ctx.lane

    b.register("record", record)
    b.register("echo", echo)
    await a.am_send(b.instance_id, "record", b"fire", lane=2)
    await fired.until(lambda items: len(items) == 1)
    assert fired.items == [(a.instance_id, 2, b"fire")]  # sender from the certificate
    await a.am_sync(b.instance_id, "record", b"sync", timeout=10)
    assert fired.items[-1] == (a.instance_id, 0, b"sync")  # handled before the ack
    assert await a.unary(b.instance_id, "echo", b"abc", lane=3, timeout=10) == b"cba@3"
    assert (await a.hello(b.instance_id))["version"] == 1
    await a.check_health(b.instance_id)  # within MessengerConfig.health_check_timeout
    served = await a.list_handlers(b.instance_id)
    assert {"echo", "record", "_health", "_hello", "_list_handlers"} <= set(served)
    assert tuple(served) == b.snapshot().handlers
    assert not any(name.startswith("_stream_batch") for name in served)  # no mux here


async def test_handlers_come_and_go_and_reserved_names_stay_reserved(start: Start) -> None:
    b = await start("b")
    a = await start("a")
    a.add_peer(b.instance_id, b.address)
    b.register("echo", lambda ctx: bytes(ctx.payload))
    assert await a.unary(b.instance_id, "echo", b"x", timeout=10) == b"x"
    b.unregister("echo")
    assert "echo" not in b.snapshot().handlers
    with pytest.raises(UnknownHandler):
        await a.unary(b.instance_id, "echo", b"x", timeout=10)
    with pytest.raises(ConfigurationError, match="no handler named 'echo'"):
        b.unregister("echo")
    with pytest.raises(HandlerExists, match="reserved"):
        b.register("_mine", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="use register"):
        b.register_system("mine", lambda ctx: None)
    b.register_system("_mine", lambda ctx: b"system")
    with pytest.raises(HandlerExists, match="already registered"):
        b.register_system("_mine", lambda ctx: None)
    assert await a.unary(b.instance_id, "_mine", timeout=10) == b"system"

    async def coroutine(ctx: Context) -> None:
        return None

    with pytest.raises(ConfigurationError, match="cannot run inline"):
        b.register("inline", coroutine, dispatch="inline")
    with pytest.raises(ConfigurationError, match="1 to 255 bytes"):
        b.register("x" * 256, lambda ctx: None)


async def test_a_reserved_header_travels_only_once_a_layer_registered_its_codec(
    start: Start,
) -> None:
    b = await start("b")
    a = await start("a")
    a.add_peer(b.instance_id, b.address)
    got = Waiter()
    b.register("sink", lambda ctx: got.add(ROUTE.read(ctx.headers)))
    with pytest.raises(ConfigurationError, match="register_header"):
        await a.am_send(b.instance_id, "sink", b"", headers=ROUTE.write(7))
    a.register_header(ROUTE)
    with pytest.raises(ConfigurationError, match="registered already"):
        a.register_header(ROUTE)
    assert a.snapshot().reserved_headers == ("_route",)
    await a.am_send(b.instance_id, "sink", b"", headers=ROUTE.write(7))
    await a.am_send(b.instance_id, "sink", b"", headers={"plain": "any"})  # not reserved
    await got.until(lambda items: items == [7, None])


ROUTE = HeaderCodec("_route", str, int)
"""A layer's own header, as the mux registers ``_mux_slot``."""


def test_messenger_waits_come_from_its_configuration() -> None:
    assert MessengerConfig().health_check_timeout == 5.0
    assert MessengerConfig().release_timeout == 10.0
    for field in ("health_check_timeout", "release_timeout", "default_timeout"):
        with pytest.raises(ConfigurationError, match=field):
            MessengerConfig(**{field: 0})


async def test_ordered_handler_keeps_order_and_a_slow_lane_holds_up_nobody_else(
    start: Start,
) -> None:
    b = await start("b", transport_config=TransportConfig(lanes=2))
    a = await start("a", transport_config=TransportConfig(lanes=2))
    c = await start("c")
    for sender in (a, c):
        sender.add_peer(b.instance_id, b.address)
    seen: dict[tuple[InstanceId, int], list[int]] = {}
    progress = Waiter()
    release = asyncio.Event()

    async def ordered(ctx: Context) -> None:
        number = value(ctx)
        if ctx.sender == a.instance_id and ctx.lane == 0 and number == 0:
            await release.wait()  # the deliberately slow message at the head of (a, 0)
        seen.setdefault((ctx.sender, ctx.lane), []).append(number)
        progress.add(None)

    b.register("ordered", ordered)
    total = 10_000
    outcomes = [
        a.send_message_on_lane(b.instance_id, 0, "ordered", i.to_bytes(4, "big"))
        for i in range(total)
    ]
    others = [
        a.send_message_on_lane(b.instance_id, 1, "ordered", i.to_bytes(4, "big"))
        for i in range(100)
    ]
    others += [
        c.send_message_on_lane(b.instance_id, 0, "ordered", i.to_bytes(4, "big"))
        for i in range(100)
    ]
    for outcome in others:
        if isinstance(outcome, SendAdmission):
            await outcome
    await progress.until(
        lambda _: (
            len(seen.get((a.instance_id, 1), [])) == 100
            and len(seen.get((c.instance_id, 0), [])) == 100
        )
    )
    assert (a.instance_id, 0) not in seen  # still held by its slow head
    release.set()
    for outcome in outcomes:
        if isinstance(outcome, SendAdmission):
            await outcome
    await progress.until(lambda _: len(seen.get((a.instance_id, 0), [])) == total, timeout=60)
    assert seen[(a.instance_id, 0)] == list(range(total))
    assert seen[(a.instance_id, 1)] == list(range(100))
    assert seen[(c.instance_id, 0)] == list(range(100))
    text = generate_latest(b.registry).decode()
    assert 'velo_messenger_ordered_lane_wait_seconds_count{handler="ordered"} 10200.0' in text


async def test_a_full_ordered_backlog_pushes_back_on_the_sender_instead_of_growing(
    start: Start,
) -> None:
    b = await start(
        "b",
        config=MessengerConfig(max_ordered_backlog=50),
        transport_config=TransportConfig(lane_window=16 * 1024, send_buffer=16 * 1024),
    )
    a = await start("a")
    a.add_peer(b.instance_id, b.address)
    release = asyncio.Event()
    seen: list[int] = []
    done = Waiter()

    async def slow(ctx: Context) -> None:
        await release.wait()
        seen.append(value(ctx))
        done.add(None)

    b.register("slow", slow)
    outcomes = []
    pending: SendAdmission | None = None
    for i in range(20_000):  # bounded; the backlog, window and buffer hold far fewer
        outcome = a.send_message_on_lane(
            b.instance_id, 0, "slow", i.to_bytes(4, "big") + bytes(200)
        )
        outcomes.append(outcome)
        if isinstance(outcome, SendAdmission):
            pending = outcome
            break
        if i % 100 == 99:
            await asyncio.sleep(0)  # let the network move between bursts
    # Without backpressure the loop would have sent all 20,000 without a Pending.
    assert pending is not None, "the receiver's backlog never pushed back"
    # Nothing drains while the handler is held: once the window is shut, a send with a
    # timeout gives up, and the message is withdrawn (never delivered).
    sent = len(outcomes)
    with pytest.raises(SendTimeout, match="withdrawn"):
        for i in range(sent, 20_000):  # bounded: far more than window and buffer hold
            await a.am_send(b.instance_id, "slow", i.to_bytes(4, "big") + bytes(200), timeout=0.2)
            sent += 1
    release.set()
    await pending
    await done.until(lambda items: len(items) == sent, timeout=60)
    assert seen == list(range(sent))


async def test_unary_failures_are_typed_and_arrive_within_the_timeout(start: Start) -> None:
    b = await start("b")
    a = await start("a", transport_config=TransportConfig(handshake_timeout=1.0))
    a.add_peer(b.instance_id, b.address)

    def broken(ctx: Context) -> bytes:
        raise RuntimeError("the handler broke")

    async def never(ctx: Context) -> bytes:
        await asyncio.Event().wait()
        return b""

    b.register("broken", broken)
    b.register("never", never, dispatch="spawn")
    with pytest.raises(UnknownHandler):
        await a.unary(b.instance_id, "nope", b"", timeout=10)
    with pytest.raises(HandlerFailed) as failed:
        await a.unary(b.instance_id, "broken", b"", timeout=10)
    assert "the handler broke" in failed.value.remote_message
    with pytest.raises(UnaryTimeout):
        await a.unary(b.instance_id, "never", b"", timeout=0.3)
    with pytest.raises(HandlerExists):
        b.register("broken", broken)

    await b.close()  # the peer goes away
    after = b.snapshot()
    assert after.closed and after.pending_calls == 0 and after.pulls_outstanding == 0
    async with asyncio.timeout(8):
        with pytest.raises(PeerGone):
            await a.unary(b.instance_id, "broken", b"", timeout=5)


async def test_a_call_outlives_a_connection_the_peer_dialed_while_the_one_it_went_on_stays(
    start: Start,
) -> None:
    """An old process of the peer's identity closing (it restarted elsewhere) looks, to
    this node, like the peer closing a connection it dialed: calls that went out on this
    node's own connection, which stays, must not fail with it."""
    b = await start("b")
    a = await start("a")
    a.add_peer(b.instance_id, b.address)
    b.add_peer(a.instance_id, a.address)
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(ctx: Context) -> bytes:
        started.set()
        await release.wait()
        return b"done"

    b.register("slow", slow, dispatch="spawn")
    a.register("ping", lambda ctx: b"pong")
    assert await b.unary(a.instance_id, "ping", b"", timeout=10) == b"pong"  # b dials a
    call = asyncio.create_task(a.unary(b.instance_id, "slow", b"", timeout=20))
    await started.wait()
    assert a.transport.snapshot().inbound_from(b.instance_id)
    b.transport.disconnect(a.instance_id, outbound=True, inbound=False)
    async with asyncio.timeout(10):  # the close reaches a: no event for it, a bounded poll
        while a.transport.snapshot().inbound_from(b.instance_id):
            await asyncio.sleep(0.01)
    assert not call.done()
    release.set()
    assert await call == b"done"


async def test_a_large_payload_does_not_delay_the_small_messages_behind_it(start: Start) -> None:
    pull_gate = asyncio.Event()

    class SlowPulls(Messenger):
        async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
            await pull_gate.wait()
            return await super().serve_request(peer, request)

    b = await start("b")
    a = await start("a", cls=SlowPulls)
    a.add_peer(b.instance_id, b.address)
    arrivals = Waiter()
    b.register("sink", lambda ctx: arrivals.add(bytes(ctx.payload)))
    big = bytes(range(256)) * (16 * MiB // 256)
    for i in range(50):
        await a.am_send(b.instance_id, "sink", b"small %d" % i)
    await a.am_send(b.instance_id, "sink", big)
    for i in range(50, 100):
        await a.am_send(b.instance_id, "sink", b"small %d" % i)
    await arrivals.until(lambda items: len(items) == 100)
    assert arrivals.items == [b"small %d" % i for i in range(100)]  # none waited for the pull
    assert (a.snapshot().staged_count, a.snapshot().staged_bytes) == (1, len(big))
    assert (b.snapshot().pulls_outstanding, b.snapshot().pull_bytes_outstanding) == (1, len(big))
    pull_gate.set()
    await arrivals.until(lambda items: len(items) == 101, timeout=60)
    assert hashlib.sha256(arrivals.items[-1]).digest() == hashlib.sha256(big).digest()  # type: ignore[arg-type]
    assert a.snapshot().staged_bytes == 0
    assert b.snapshot().pulls_outstanding == 0


async def test_staged_payload_over_the_limit_is_refused_unread_and_released(start: Start) -> None:
    b = await start("b", config=MessengerConfig(staged_payload_max=1 * MiB))
    a = await start("a")
    a.add_peer(b.instance_id, b.address)
    a.register_header(ROUTE)
    refusals: list[StagedRefusal] = []
    b.add_staged_refusal_hook(refusals.append)
    released = Waiter()
    a.add_staging_listener(lambda reason, size: released.add((reason, size)))
    handled = Waiter()
    b.register("sink", lambda ctx: handled.add(len(ctx.payload)))

    await a.am_send(b.instance_id, "sink", bytes(4 * MiB), headers=ROUTE.write(42))
    await released.until(lambda items: ("refused", 4 * MiB) in items)
    assert a.snapshot().staged_bytes == 0
    assert len(refusals) == 1
    assert (refusals[0].size, refusals[0].limit) == (4 * MiB, 1 * MiB)
    assert ROUTE.read(refusals[0].headers) == 42  # carried, never read by the messenger
    assert b.snapshot().pulls_outstanding == 0  # refused unread: nothing to pull
    with pytest.raises(RemoteRefused) as refused:
        await a.unary(b.instance_id, "sink", bytes(2 * MiB), timeout=10)
    assert str(2 * MiB) in str(refused.value) and str(1 * MiB) in str(refused.value)
    await a.am_send(b.instance_id, "sink", bytes(512 * 1024))  # under the limit: pulled
    await handled.until(lambda items: items == [512 * 1024])
    await released.until(lambda items: a.snapshot().staged_bytes == 0 and len(items) == 3)
    assert (
        'velo_rendezvous_refusals_total{reason="too_large"} 2.0'
        in generate_latest(b.registry).decode()
    )


async def test_staged_payloads_of_one_lane_are_pulled_in_turn_and_delivered_in_order(
    start: Start,
) -> None:
    """A lane's second staged payload is not pulled while its first is in flight, so a
    small one staged after a large one cannot overtake it."""
    b = await start("b")
    served = Waiter()
    release_first = asyncio.Event()

    class FirstPullHeld(Messenger):
        async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
            served.add(request)
            if len(served.items) == 1:
                await release_first.wait()  # the first payload stays in flight until released
            return await super().serve_request(peer, request)

    a = await start("a", cls=FirstPullHeld)
    a.add_peer(b.instance_id, b.address)
    got = Waiter()
    b.register("sink", lambda ctx: got.add(len(ctx.payload)))
    markers = Waiter()
    b.register("marker", lambda ctx: markers.add(bytes(ctx.payload)))
    await a.am_send(b.instance_id, "sink", bytes(3 * MiB))
    await a.am_send(b.instance_id, "sink", bytes(300 * 1024))  # staged too (over 256 KiB)
    # An inline message on the same lane is handled after both descriptors were read.
    await a.am_send(b.instance_id, "marker", b"after both")
    await markers.until(lambda items: items == [b"after both"])
    assert (b.snapshot().pulls_outstanding, b.snapshot().pull_bytes_outstanding) == (
        2,
        3 * MiB + 300 * 1024,
    )  # b knows of both
    await served.until(lambda items: len(items) == 1)
    # A negative check, so bounded: an out-of-turn pull of the second would be served
    # within milliseconds of its descriptor; none comes while the first is held.
    with pytest.raises(TimeoutError):
        await served.until(lambda items: len(items) == 2, timeout=1.0)
    assert got.items == []
    release_first.set()
    await got.until(lambda items: len(items) == 2)
    assert got.items == [3 * MiB, 300 * 1024]
    assert len(served.items) == 2


async def test_a_failing_staging_listener_costs_nothing_else(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    b = await start("b")
    a = await start("a")
    a.add_peer(b.instance_id, b.address)

    def broken(reason: str, size: int) -> None:
        raise RuntimeError("listener bug")

    released = Waiter()
    a.add_staging_listener(broken)
    a.add_staging_listener(lambda reason, size: released.add((reason, size)))
    got = Waiter()
    b.register("sink", lambda ctx: got.add(len(ctx.payload)))
    await a.am_send(b.instance_id, "sink", bytes(1 * MiB))
    await got.until(lambda items: items == [1 * MiB])
    await released.until(lambda items: items == [("pulled", 1 * MiB)])
    assert a.snapshot().staged_bytes == 0
    assert "staging listener failed" in caplog.text


async def test_bad_input_costs_only_that_message(start: Start) -> None:
    b = await start("b")
    a = await start("a")
    a.add_peer(b.instance_id, b.address)
    got = Waiter()
    b.register("sink", lambda ctx: got.add(bytes(ctx.payload)))
    truncated_descriptor = encode_envelope(
        Kind.MESSAGE, handler="sink", payload=StagedDescriptor(1, 100).encode()[:10]
    )
    flags_at = 2
    truncated_descriptor = (
        truncated_descriptor[:flags_at]
        + bytes([truncated_descriptor[flags_at] | 0x02])
        + truncated_descriptor[flags_at + 1 :]
    )
    bad_frames = [
        b"\x07not an envelope",  # wrong version
        b"\x01",  # shorter than a header
        truncated_descriptor,
    ]
    await a.am_send(b.instance_id, "sink", b"before")
    for frame in bad_frames:
        a.transport.send(b.instance_id, 0, frame)
    await a.am_send(b.instance_id, "nobody-home", b"lost")  # unknown fire-and-forget handler
    await a.am_send(b.instance_id, "sink", b"after")
    await got.until(lambda items: items == [b"before", b"after"])
    text = generate_latest(b.registry).decode()
    assert (
        'velo_messenger_dispatch_failures_total{reason="active_message",stage="decode"} 3.0' in text
    )
    assert (
        'velo_messenger_dispatch_failures_total{reason="unknown_handler",stage="dispatch"} 1.0'
        in text
    )
    assert await a.unary(b.instance_id, "_health", timeout=10) == b"ok"


async def test_nodes_find_each_other_through_a_peer_directory(
    make_credentials: Callable[..., NodeCredentials], tmp_path: object
) -> None:
    from pathlib import Path

    from velomux_quic.discovery import DirectoryPeers

    directory = Path(str(tmp_path)) / "peers"
    async with (
        await Messenger.start(
            make_credentials("b"), discovery=DirectoryPeers(directory), name="b"
        ) as b,
        await Messenger.start(
            make_credentials("a"), discovery=DirectoryPeers(directory), name="a"
        ) as a,
    ):
        b.register("who", lambda ctx: str(ctx.sender).encode())
        # a started after b: b's record was in the directory; nothing registered by hand
        assert await a.unary(b.instance_id, "who", timeout=10) == str(a.instance_id).encode()
        assert (directory / f"{a.instance_id}.json").exists()
    assert not (directory / f"{a.instance_id}.json").exists()  # withdrawn on close
