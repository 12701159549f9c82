"""Many short stream lifetimes through one pair of nodes on loopback, then a leak check.

Slots run concurrently, each looping attach, send, finalize, read to the end; once every
lifetime is over, nothing a stream owned may remain: no anchor, no sender, no bind or
receiver of the per-stream transport, no outbound QUIC stream record, no pending attach
call, no task, no file descriptor; on the mux, no bind, live slot, or staged, withheld or
held record. The baseline is taken after one warm-up lifetime, so the connection between
the nodes (and whatever each node keeps for its life, such as the mux's batcher) is part
of it. Both transports are soaked: the messenger mux (``messenger-mux-v2``, the default)
and the per-stream QUIC path (``quic-stream-v1``, with the mux disabled).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from velomux_quic.errors import StreamError
from velomux_quic.mux.config import DISABLE_ENVS, MuxConfig
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.streaming.sender import Retired

SLOTS = 64
TOKENS = 8
HEARTBEAT = 1.0
"""The consumer's heartbeat window: the producer's heartbeat task, which ends at its first
wake-up once no sender is left, is done within about a window after the last lifetime.
(Detection is three windows of silence; both nodes share one loop here, so a window much
shorter than this can end a live stream on a busy machine.)"""


@pytest.fixture(params=[MESSENGER_MUX_KEY, PER_STREAM_KEY])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport both nodes negotiate (chosen by the test alone, not the environment)."""
    for name in DISABLE_ENVS:
        monkeypatch.delenv(name, raising=False)
    return str(request.param)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def periodic_tasks_running(node: Node) -> bool:
    """Whether a task that ends by itself once no stream is left still runs: the producer's
    heartbeat task, or a mux health check of a peer."""
    snapshot = node.snapshot()
    checks = snapshot.mux.health_checks_running if snapshot.mux is not None else 0
    return snapshot.streaming.heartbeat_task_running or checks > 0


async def heartbeats_settled(node: Node) -> None:
    """Wait for the producer's periodic tasks to end: each does at its first wake-up with
    no sender (or live slot) left, within one interval; the snapshot is polled, the tasks
    are not public. Both intervals are HEARTBEAT here (see ``soak``)."""
    async with asyncio.timeout(5 * HEARTBEAT):
        while periodic_tasks_running(node):
            await asyncio.sleep(HEARTBEAT / 20)


async def lifetimes(producer: Node, consumer: Node, transport: str, numbers: Iterator[int]) -> None:
    """One slot: a stream per number drawn from the shared iterator, one after another."""
    loop = asyncio.get_running_loop()
    for n in numbers:
        anchor = consumer.create_anchor()
        started = loop.time()
        sender = await producer.attach_anchor(anchor.handle)
        assert sender.negotiated_transport() == transport
        for t in range(TOKENS):
            await sender.send([n, t])
        retired = sender.finalize()
        items: list[Any] = []
        try:
            async with asyncio.timeout(20):
                async for item in anchor:
                    items.append(item)
        except StreamError as exc:
            elapsed = loop.time() - started
            firings = consumer.anchors.metrics.heartbeat_watchdog_firings
            raise AssertionError(
                f"stream {n} ended with {exc!r} after {items}, {elapsed:.3f} s after its "
                f"attach began; watchdog firings so far: {firings}"
            ) from exc
        assert items == [[n, t] for t in range(TOKENS)], n
        assert await asyncio.wait_for(retired, 20) is Retired.SENT
        assert anchor.finished


def metric(node: Node, name: str) -> float:
    """The sum of a metric's samples over all its label values."""
    values = [
        float(line.rpartition(" ")[2])
        for line in node.metrics_text().splitlines()
        if line.partition("{")[0].partition(" ")[0] == name
    ]
    assert values, f"{name} is not exported"
    return sum(values)


def stream_state(producer: Node, consumer: Node, transport: str) -> dict[str, Any]:
    """What the nodes keep per stream or per attach call (all empty once they are over),
    read from their snapshots."""
    produced, consumed = producer.snapshot(), consumer.snapshot()
    (connection,) = [c for c in produced.transport.connections if c.outbound]
    assert connection.peer == consumer.instance_id
    state: dict[str, Any] = {
        "consumer anchors": consumed.streaming.anchors,
        "consumer bound senders": consumed.streaming.bound_senders,
        "producer senders": produced.streaming.senders,
        "consumer senders": consumed.streaming.senders,
        "pending attaches": produced.streaming.pending_attaches,
        "pending requests": connection.pending_requests,
        "producer calls": produced.messenger.pending_calls,
        "consumer calls": consumed.messenger.pending_calls,
        "producer pulls": produced.messenger.pulls_outstanding,
        "consumer pulls": consumed.messenger.pulls_outstanding,
        "active anchors": metric(consumer, "velo_streaming_active_anchors"),
    }
    if transport == PER_STREAM_KEY:
        per_stream = consumed.streaming.per_stream
        assert per_stream is not None
        state["binds"] = per_stream.binds
        state["receivers"] = per_stream.receivers
        state["buffered bytes"] = per_stream.buffered_bytes
        state["outbound streams"] = connection.extra_streams
        state["blocked streams"] = connection.blocked_streams
        state["refused streams"] = metric(consumer, "velo_streaming_refused_streams_total")
    else:
        assert consumed.mux is not None
        state["mux binds"] = consumed.mux.pending_binds
        state["mux unclaimed pre-binds"] = consumed.mux.unclaimed_prebinds
        for name, node in (("producer", producer), ("consumer", consumer)):
            for gauge in (
                "live_slots",
                "staged_records",
                "withheld_records",
                "held_records",
                "reader_stall_total",
                "credit_lost_total",
                "records_dropped_total",
            ):
                state[f"{name} {gauge}"] = metric(node, f"velo_streaming_mux_{gauge}")
    return state


async def soak(
    make_credentials: Callable[..., NodeCredentials], transport: str, total: int
) -> None:
    fds_before_nodes = open_fds()
    options: dict[str, Any] = {
        "streaming": StreamingConfig(heartbeat_interval=HEARTBEAT),
        # The mux's peer health check, like the heartbeat task, ends one interval after the
        # last stream: the same short interval lets the leak check wait for both.
        "mux": MuxConfig(health_check_interval=HEARTBEAT),
    }
    if transport == PER_STREAM_KEY:
        options["mux"] = MuxConfig(enabled=False)
    nodes: list[Node] = []
    try:
        consumer = await Node.start(make_credentials("consumer"), **options)
        nodes.append(consumer)
        producer = await Node.start(make_credentials("producer"), **options)
        nodes.append(producer)
        producer.add_peer(consumer.instance_id, consumer.address)
        await lifetimes(producer, consumer, transport, iter(range(1)))  # warm-up: connect
        await heartbeats_settled(producer)
        tasks, fds = asyncio.all_tasks(), open_fds()

        numbers = iter(range(1, total + 1))
        await asyncio.gather(
            *(lifetimes(producer, consumer, transport, numbers) for _ in range(SLOTS))
        )
        assert next(numbers, None) is None

        await heartbeats_settled(producer)
        state = stream_state(producer, consumer, transport)
        assert not {name: value for name, value in state.items() if value}
        assert asyncio.all_tasks() - tasks == set()
        assert open_fds() == fds
    finally:
        for node in reversed(nodes):
            await node.close()
    assert open_fds() == fds_before_nodes


async def test_five_hundred_stream_lifetimes_leave_nothing_behind(
    make_credentials: Callable[..., NodeCredentials], transport: str
) -> None:
    await soak(make_credentials, transport, 500)


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_twenty_thousand_stream_lifetimes_leave_nothing_behind(
    make_credentials: Callable[..., NodeCredentials], transport: str
) -> None:
    await soak(make_credentials, transport, 20_000)
