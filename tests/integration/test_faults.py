"""Streaming faults between real nodes: a stalled consumer, a retried attach, typed errors
for bad handles, and a node that closes under its streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic import (
    AttachRefused,
    ConfigurationError,
    InstanceId,
    NodeCredentials,
    Retired,
    StreamAnchorHandle,
    StreamingConfig,
    VelomuxError,
)
from velomux_quic.node import Node

ROOT = Path(__file__).resolve().parents[2]


async def pair(start_nodes: StartNode, **options: Any) -> tuple[Node, Node]:
    """(producer a, consumer b), a knowing b's address."""
    b = await start_nodes("b", **options)
    a = await start_nodes("a", **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


async def until(predicate: Any, timeout: float = 10.0) -> None:
    """Poll a condition no event announces (a snapshot value), bounded."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_a_stalled_consumer_costs_its_watchdog_a_few_wake_ups_per_window(
    start_nodes: StartNode,
) -> None:
    window = 0.25
    a, b = await pair(start_nodes, streaming=StreamingConfig(heartbeat_interval=window))
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    total = 200

    async def produce() -> None:
        for index in range(total):
            await sender.send(index)
        await sender.finalize()

    producing = asyncio.create_task(produce())
    try:
        # The consumer reads nothing: the sender spends its credit and waits.
        await until(lambda: sender.credit == 0)
        before = b.anchors.metrics.heartbeat_watchdog_checks
        stalled = 8 * window
        await asyncio.sleep(stalled)  # the stall being measured, not a synchronisation
        checks = b.anchors.metrics.heartbeat_watchdog_checks - before
        # About one wake-up per window; the spin this guards against made thousands.
        assert checks <= 2 * (stalled / window) + 2, checks
        exported = float(b.anchors.metrics.heartbeat_watchdog_checks)
        assert f"velo_streaming_heartbeat_watchdog_checks_total {exported}" in b.metrics_text()
        # The stalled stream is still whole: reading resumes and every item arrives.
        async with asyncio.timeout(30):
            assert [item async for item in anchor] == list(range(total))
        await producing
    finally:
        producing.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producing


class ConsumerProcess:
    """A reading consumer node in a child process (tests/procs/reading_consumer.py)."""

    def __init__(self, process: asyncio.subprocess.Process, hello: dict[str, Any]) -> None:
        self.process = process
        self.instance_id = InstanceId.parse(hello["instance"])
        self.address = (str(hello["host"]), int(hello["port"]))
        self.handles = [StreamAnchorHandle.from_wire(wire) for wire in hello["handles"]]

    async def ended(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next stream the consumer saw end: index, items, outcome, message."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        assert line, "the consumer process exited"
        result: dict[str, Any] = json.loads(line)
        return result


@contextlib.asynccontextmanager
async def consumer_process(
    make_credentials: Callable[..., NodeCredentials], directory: Path, anchors: int
) -> AsyncIterator[ConsumerProcess]:
    make_credentials("consumer").save(directory)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.procs.reading_consumer",
        "--credentials",
        str(directory),
        "--anchors",
        str(anchors),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        hello = json.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        yield ConsumerProcess(process, hello)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        await process.wait()


@pytest.mark.timeout(90)
async def test_an_attach_that_timed_out_can_be_retried(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    """The consumer answers the first attach too late (its process is stopped past the
    producer's attach timeout), so that attach binds after the producer gave up on it;
    the producer's retry replaces that bind and gets a working stream."""
    async with consumer_process(make_credentials, tmp_path / "consumer", 2) as consumer:
        producer = await start_nodes("producer", streaming=StreamingConfig(attach_timeout=1.0))
        producer.add_peer(consumer.instance_id, consumer.address)
        warm, target = consumer.handles
        # One stream first, so the connection is up: the late attach is then delivered.
        first = await producer.attach_anchor(warm)
        await first.send("warm")
        assert await first.finalize() is Retired.SENT
        assert (await consumer.ended())["items"] == ["warm"]

        consumer.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(AttachRefused, match="attach to"):
                await producer.attach_anchor(target)
        finally:
            consumer.process.send_signal(signal.SIGCONT)
        # The late request now binds on the consumer; the retry must not be refused.
        async with asyncio.timeout(30):
            sender = await producer.attach_anchor(target)
        for number in range(10):
            await sender.send(number)
        assert await sender.finalize() is Retired.SENT
        ended = await consumer.ended()
        assert ended["index"] == 1
        assert (ended["outcome"], ended["items"]) == ("finished", list(range(10))), ended


def exported(node: Node, name: str) -> float:
    """One unlabelled series of the node's metrics."""
    for line in node.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.timeout(60)
async def test_staged_singletons_are_not_counted_as_lost_batches(
    start_nodes: StartNode,
) -> None:
    """Items above the eager budget go alone through rendezvous, out of the lane's order;
    a clean path loses no batch, so the gap counter stays at zero."""
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    large = [bytes([number]) * (2 * 1024 * 1024) for number in range(3)]
    expected: list[object] = []
    for number, item in enumerate(large):
        for small in (f"before {number}", item, f"after {number}"):
            await sender.send(small)
            expected.append(small)
    retired = sender.finalize()
    async with asyncio.timeout(30):
        assert [item async for item in anchor] == expected
    assert await retired is Retired.SENT
    assert exported(a, 'velo_streaming_mux_singletons_total{path="staged"}') == 3
    assert exported(b, "velo_streaming_mux_batch_seq_gaps_total") == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["garbage", None, 12, b"\x00" * 16])
async def test_a_value_that_is_not_a_handle_is_a_typed_error_that_says_what_a_handle_is(
    start_nodes: StartNode, bad: object
) -> None:
    a, b = await pair(start_nodes)
    ticket = b.prebind_anchor(b.create_anchor().handle)
    calls = {
        "attach_anchor": lambda: a.attach_anchor(bad),  # type: ignore[arg-type]
        "attach_mpsc_anchor": lambda: a.attach_mpsc_anchor(bad),  # type: ignore[arg-type]
        "open_anchor_stream": lambda: a.open_anchor_stream(bad, ticket),  # type: ignore[arg-type]
    }
    for name, call in calls.items():
        with pytest.raises(ConfigurationError, match=f"{name} takes a StreamAnchorHandle"):
            await call()
    with pytest.raises(ConfigurationError, match="prebind_anchor takes a StreamAnchorHandle"):
        b.prebind_anchor(bad)  # type: ignore[arg-type]
    handle = b.create_anchor().handle
    with pytest.raises(ConfigurationError, match="takes the StreamOpenTicket"):
        await a.open_anchor_stream(handle, "not a ticket")  # type: ignore[arg-type]
    assert isinstance(ConfigurationError("x"), VelomuxError)
