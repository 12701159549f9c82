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

import pytest

from tests.conftest import StartNode
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.errors import SenderDropped
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.transport import TransportConfig

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def producer(
    credentials: Path, consumer: Node, anchors: list[StreamAnchor], lanes: int
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


async def read_some(anchors: list[StreamAnchor], count: int) -> None:
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

        async def dropped(anchor: StreamAnchor) -> float:
            with pytest.raises(SenderDropped):
                while True:
                    await anchor.next()
            return time.monotonic() - killed_at

        async with asyncio.timeout(30):
            elapsed = await asyncio.gather(*(dropped(anchor) for anchor in anchors))
    # The watchdog fires 3 to 4 windows after the last arrival (at most a window before
    # the kill); the slack covers a loaded machine.
    assert max(elapsed) <= 4 * window + 2.0, elapsed
    assert consumer.mux is not None
    assert consumer.mux.ingress.live_slots == 0

    # The same node again: a new process, a new epoch; new streams flow on every lane.
    fresh = [consumer.create_anchor() for _ in range(8)]
    async with producer(tmp_path / "producer", consumer, fresh, lanes):
        await read_some(fresh, 5)
    assert consumer.mux.ingress.drops["stale_epoch"] == 0
