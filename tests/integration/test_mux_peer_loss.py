"""Peer loss with real processes: a producer node killed with SIGKILL mid-stream ends every
consumer's stream with SenderDropped within the watchdog bound, and the same node (same
certificate, so the same InstanceId) restarted opens new streams that work."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.errors import SenderDropped
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.transport import ADMITTED, TransportConfig

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def producer(
    credentials: Path, consumer: Node, anchors: list[StreamAnchor[Any]], lanes: int
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A producer process attached to every anchor; killed (and reaped) on the way out."""
    arguments = ["--credentials", str(credentials), "--lanes", str(lanes), "--interval", "0.02"]
    arguments += ["--peer", f"{consumer.instance_id}@{consumer.address[0]}:{consumer.address[1]}"]
    for anchor in anchors:
        wire = anchor.handle.to_wire()
        arguments += ["--handle", f"{wire['hi']}:{wire['lo']}"]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.procs.producer", *arguments,
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        assert line.strip() == b"attached"
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def read_some(anchors: list[StreamAnchor[Any]], count: int) -> None:
    async with asyncio.timeout(20):
        for anchor in anchors:
            for _ in range(count):
                await anchor.next()


@pytest.mark.timeout(120)
async def test_a_killed_producer_node_drops_every_stream_and_a_restart_streams_again(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    window, lanes = 0.5, 4
    consumer = await start_nodes(
        "consumer",
        streaming=StreamingConfig(heartbeat_interval=window),
        transport=TransportConfig(lanes=lanes),
    )
    make_credentials("producer").save(tmp_path / "producer")
    anchors = [consumer.create_anchor() for _ in range(16)]
    async with producer(tmp_path / "producer", consumer, anchors, lanes) as process:
        await read_some(anchors, 5)
        process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        async def dropped(anchor: StreamAnchor[Any]) -> float:
            with pytest.raises(SenderDropped):
                while True:
                    await anchor.next()
            return time.monotonic() - killed_at

        async with asyncio.timeout(30):
            elapsed = await asyncio.gather(*(dropped(anchor) for anchor in anchors))
    # The watchdog fires 3 to 4 windows after the last arrival (at most a window before
    # the kill); the slack covers a loaded machine.
    assert max(elapsed) <= 4 * window + 3.0, elapsed
    assert consumer.mux is not None
    # An ended stream's slot is freed on the table's next visit (the doorbell its reader's
    # last take rang, rate-limited, or the sweep tick), which may come just after the
    # reader saw the ending; the table has no event to await, so poll it, bounded.
    ingress = consumer.mux.ingress
    async with asyncio.timeout(5):
        while ingress.live_slots:
            await asyncio.sleep(0.02)

    # The same node again: a new process, a new epoch; new streams flow on every lane.
    fresh = [consumer.create_anchor() for _ in range(8)]
    async with producer(tmp_path / "producer", consumer, fresh, lanes):
        await read_some(fresh, 5)
    assert consumer.mux.ingress.drops["stale_epoch"] == 0


async def test_a_batch_lost_after_admission_is_a_gap_the_watchdog_ends(
    start_nodes: StartNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that dies after the transport admitted a batch is not epoch death: the
    producer keeps its epoch, and the slots that batch carried have a frame_seq gap that can
    never close. Their watchdogs end them; the streams that lost nothing go on."""
    window = 0.5
    consumer = await start_nodes("b", streaming=StreamingConfig(heartbeat_interval=window))
    producer_node = await start_nodes("a", streaming=StreamingConfig(heartbeat_interval=window))
    producer_node.add_peer(consumer.instance_id, consumer.address)
    anchors = [consumer.create_anchor() for _ in range(8)]
    senders = [await producer_node.attach_anchor(anchor.handle) for anchor in anchors]
    for index, sender in enumerate(senders):
        await sender.send(["first", index])
    await read_some(anchors, 1)

    messenger = producer_node.messenger
    real_send = messenger.send_message_on_lane
    lost = asyncio.Event()

    def lose_one_batch(peer: object, lane: int, handler: str, payload: object, **kw: object):
        if handler.startswith("_stream_batch") and not lost.is_set():
            lost.set()
            return ADMITTED  # admitted, then lost with its connection
        return real_send(peer, lane, handler, payload, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(messenger, "send_message_on_lane", lose_one_batch)
    for sender in senders[:4]:
        await sender.send("lost")
    async with asyncio.timeout(10):
        await lost.wait()
    for index, sender in enumerate(senders):
        await sender.send(["after", index])
        sender.finalize()

    async def outcome(anchor: StreamAnchor[Any]) -> object:
        try:
            return [item async for item in anchor]
        except SenderDropped:
            return SenderDropped

    async with asyncio.timeout(30):
        results = await asyncio.gather(*(outcome(anchor) for anchor in anchors))
    assert results[:4] == [SenderDropped] * 4
    assert results[4:] == [[["after", i]] for i in range(4, 8)]
    assert consumer.mux is not None and consumer.mux.ingress.batch_seq_gaps >= 1
    assert "velo_streaming_heartbeat_watchdog_firings_total 4.0" in consumer.metrics_text()
