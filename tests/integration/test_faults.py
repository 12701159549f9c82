"""Streaming faults between real nodes: a stalled consumer, a retried attach, typed errors
for bad handles, and a node that closes under its streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode
from tests.polling import poll_until
from velomux_quic import (
    AttachRefused,
    ChannelClosed,
    ConfigurationError,
    InstanceId,
    MuxConfig,
    NodeCredentials,
    Retired,
    SenderDropped,
    StreamAnchorHandle,
    StreamingConfig,
    TransportConfig,
    VelomuxError,
)
from velomux_quic.node import Node
from velomux_quic.streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY

ROOT = Path(__file__).resolve().parents[2]


async def pair(start_nodes: StartNode, **options: Any) -> tuple[Node, Node]:
    """(producer a, consumer b), a knowing b's address."""
    b = await start_nodes("b", **options)
    a = await start_nodes("a", **options)
    a.add_peer(b.instance_id, b.address)
    return a, b


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
        await poll_until(lambda: sender.credit == 0)
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
    make_credentials: Callable[..., NodeCredentials],
    directory: Path,
    anchors: int,
    heartbeat: float = 5.0,
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
        "--heartbeat",
        str(heartbeat),
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
    calls: dict[str, Callable[[], Awaitable[object]]] = {
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [MESSENGER_MUX_KEY, PER_STREAM_KEY])
async def test_a_closing_producer_flushes_finalized_streams_and_ends_open_ones_at_once(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], path: str
) -> None:
    """The consumer's watchdog would take 3.5 windows (35 s here): the open streams must
    end long before that, with an error that says the producer shut down, and the streams
    finalized just before the close must arrive whole."""
    options: dict[str, Any] = {"streaming": StreamingConfig(heartbeat_interval=10.0)}
    if path == PER_STREAM_KEY:
        options["mux"] = MuxConfig(enabled=False)  # a node without the mux speaks per-stream
    b = await start_nodes("b", **options)
    a = await Node.start(make_credentials("a"), **options)
    try:
        a.add_peer(b.instance_id, b.address)
        finished = [b.create_anchor() for _ in range(4)]
        open_ = [b.create_anchor() for _ in range(4)]
        senders = [await a.attach_anchor(anchor.handle) for anchor in finished + open_]
        assert {sender.negotiated_transport() for sender in senders} == {path}
        for sender in senders[len(finished) :]:
            await sender.send("first")
        for anchor in open_:  # the open streams are live on the consumer
            assert await anchor.next(timeout=10) == "first"
        retired = []
        for sender in senders[: len(finished)]:
            for number in range(20):
                await sender.send(number)
            retired.append(sender.finalize())  # queued, not on the wire yet
    finally:
        await a.close()
    closed = asyncio.get_running_loop().time()
    assert [r.result() for r in retired] == [Retired.SENT] * len(finished)
    for sender in senders[len(finished) :]:  # an open sender learns its stream is over
        assert sender.is_cancelled and sender.state == "dropped"
        assert await sender.retired() is Retired.DISCARDED
    async with asyncio.timeout(10):
        for anchor in finished:
            assert [item async for item in anchor] == list(range(20))
        for anchor in open_:
            with pytest.raises(SenderDropped, match="shut down"):
                await anchor.next()
    assert asyncio.get_running_loop().time() - closed < 2.0
    assert b.anchors.metrics.heartbeat_watchdog_firings == 0


@pytest.mark.timeout(60)
async def test_drain_waits_for_open_streams_to_finish(start_nodes: StartNode) -> None:
    a, b = await pair(start_nodes)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    assert not await a.drain(0.05)  # the stream is open: drain gives up

    async def finish_later() -> None:
        for number in range(10):
            await sender.send(number)
        await sender.finalize()

    finishing = asyncio.create_task(finish_later())
    assert await a.drain(10)
    await finishing
    async with asyncio.timeout(10):
        assert [item async for item in anchor] == list(range(10))


@pytest.mark.timeout(60)
async def test_an_idle_per_stream_producer_learns_its_consumer_process_died(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    """The consumer's process is killed while its producer sends nothing: the connection
    closes at the (short) idle timeout, and the idle sender must learn it: its
    cancellation fires and its retirement resolves."""
    window = 0.5
    async with consumer_process(
        make_credentials, tmp_path / "consumer", 1, heartbeat=window
    ) as consumer:
        producer = await start_nodes(
            "producer",
            mux=MuxConfig(enabled=False),
            transport=TransportConfig(idle_timeout=1.0, keep_alive_interval=0.3),
        )
        producer.add_peer(consumer.instance_id, consumer.address)
        sender = await producer.attach_anchor(consumer.handles[0])
        assert sender.negotiated_transport() == PER_STREAM_KEY
        await sender.send("only")
        consumer.process.send_signal(signal.SIGKILL)
        await consumer.process.wait()
        async with asyncio.timeout(15):  # idle timeout (1 s) + a heartbeat interval
            await sender.wait_cancelled()
            assert await sender.retired() is Retired.DISCARDED
        assert sender.state == "cancelled"
        assert producer.anchors.metrics.senders_lost == 1
        with pytest.raises(ChannelClosed):
            await sender.send("after")
