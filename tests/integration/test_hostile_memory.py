"""A victim node's resident memory under hostile peers, measured in its own process.

The victim runs in a child process (``tests/procs/victim.py``) and reports its VmRSS and its
counters before and after the attacks; every attacker holds a certificate of the victim's
CA and attacks over real authenticated QUIC, with the project's own codec: tens of
thousands of OpenSlots for slots nobody bound, a frame announcing 4 GiB, thousands of QUIC
streams whose opening never finishes, a flood of STAGED descriptors whose pulls stall, and
(in the slow variant) unfinished frames on several lanes and more connections than one
certificate may hold. Through all of it, a legitimate peer's stream through the same
victim must finish intact, and the victim's memory must stay within the stated bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartNode, wait_admitted
from tests.integration.hostile_peer import hostile_client
from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.messenger.envelope import Kind, StagedDescriptor, encode_envelope
from velomux_quic.mux.protocol import (
    BATCH_HANDLER,
    BatchHeader,
    EncodableRecord,
    RecordType,
    encode_batch,
    open_slot_body,
    slot_id,
)
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import TransportHandler
from velomux_quic.transport.endpoint import QuicEndpoint

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
_HEADER = struct.Struct(">I")
_FIRST_STREAM = 66

RSS_BOUND = 64 * MiB
"""What the attacks of the default test may add to the victim's resident memory."""
RSS_BOUND_SLOW = 96 * MiB
"""The slow variant's: its unfinished frames alone may hold 32 MiB for a while."""


@dataclass
class Victim:
    process: asyncio.subprocess.Process
    instance_id: InstanceId
    address: tuple[str, int]

    async def ask(self, command: str, timeout: float = 30.0) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command.encode() + b"\n")
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        assert line, "the victim process died"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def metric(self, name: str) -> float:
        return float((await self.ask("report"))["metrics"].get(name, 0.0))

    async def until(self, name: str, at_least: float, timeout: float = 20.0) -> dict[str, Any]:
        """Poll the victim's report until series ``name`` reaches ``at_least``."""
        async with asyncio.timeout(timeout):
            while True:
                report = await self.ask("report")
                if report["metrics"].get(name, 0.0) >= at_least:
                    return report
                await asyncio.sleep(0.1)  # the victim is another process: nothing to await


@asynccontextmanager
async def victim_process(credentials: Path, engine: str | None = None) -> AsyncIterator[Victim]:
    """The victim node in a child process, on ``engine`` (None: this run's engine)."""
    environment = None if engine is None else {**os.environ, "VELOMUX_QUIC_ENGINE": engine}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.procs.victim",
        "--credentials",
        str(credentials),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=environment,
    )
    try:
        assert process.stdout is not None
        hello = json.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        yield Victim(process, InstanceId.parse(hello["instance"]), (hello["host"], hello["port"]))
    finally:
        await end_child(process)  # the victim exits when its stdin closes


async def end_child(process: asyncio.subprocess.Process) -> None:
    """End a child that exits when its standard input closes: close it, wait, and kill the
    child if it has not exited within 15 s, so no test leaves it running."""
    if process.stdin is not None:
        process.stdin.close()
    try:
        await asyncio.wait_for(process.wait(), 15)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


def _rejections(reason: str) -> str:
    return f"velo_transport_rejections_total{{reason={reason},transport=quic}}"


# -- the attacks ----------------------------------------------------------------------------


async def open_slots_nobody_bound(hostile: Node, victim: Victim, lanes: int, per_lane: int) -> None:
    """OpenSlots for every index of ``lanes`` tables, naming binds that do not exist."""
    hostile.add_peer(victim.instance_id, victim.address)
    outcomes: list[object] = []
    for lane in range(lanes):
        handler = BATCH_HANDLER if lane == 0 else f"{BATCH_HANDLER}.{lane}"
        for batch_seq, first in enumerate(range(0, per_lane, 1024)):
            records: list[EncodableRecord] = [
                (RecordType.OPEN_SLOT, slot_id(index, 0), 0, open_slot_body(7, index))
                for index in range(first, min(first + 1024, per_lane))
            ]
            header = BatchHeader(lane, len(records), 1 << 40, batch_seq)
            batch = encode_batch(header, records)
            outcomes.append(
                hostile.messenger.send_message_on_lane(victim.instance_id, 0, handler, batch)
            )
    await wait_admitted(outcomes)


async def announce_4_gib(credentials: NodeCredentials, victim: Victim) -> None:
    async with hostile_client(credentials, victim.address) as peer:
        peer.write(2, _HEADER.pack(0xFFFF_FFFF) + bytes(1000))
        await victim.until(_rejections("oversized_frame"), 1)


async def unfinished_frames(credentials: NodeCredentials, victim: Victim) -> None:
    """A 16 MiB frame begun on six lanes, 5.6 MB of each sent: past the default 32 MiB of
    unfinished frames a connection may hold with the sixth."""
    async with hostile_client(credentials, victim.address) as peer:
        for lane in range(6):
            peer.write(4 * lane + 2, _HEADER.pack(16 * MiB) + bytes(5_600_000))
        await victim.until(_rejections("partial_frame_bytes"), 1)


class _StallingPeer(TransportHandler):
    """A hostile node's handler: it never answers a pull of what it 'staged'."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        await self.release.wait()
        raise LookupError("nothing was ever staged")


async def staged_descriptors(hostile: QuicEndpoint, victim: Victim, count: int) -> None:
    hostile.register_peer(victim.instance_id, victim.address)
    outcomes: list[object] = [
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
        for staged_id in range(1, count + 1)
    ]
    await wait_admitted(outcomes)


async def legitimate_stream(good: Node, victim: Victim, items: int = 200) -> None:
    """A good peer streams ``items`` to an anchor on the victim; the victim reads them all."""
    good.add_peer(victim.instance_id, victim.address)
    handle = StreamAnchorHandle.from_wire((await victim.ask("anchor"))["handle"])
    async with asyncio.timeout(30):
        sender = await good.attach_anchor(handle)
        for number in range(items):
            await sender.send({"n": number})
        await sender.finalize()
    assert (await victim.ask("result"))["items"] == [{"n": n} for n in range(items)]


# -- the tests ------------------------------------------------------------------------------


async def _attack(
    start_nodes: StartNode,
    make_credentials: Callable[..., NodeCredentials],
    tmp_path: Path,
    *,
    lanes: int,
    streams: int,
    descriptors: int,
    slow: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    make_credentials("victim").save(tmp_path / "victim")
    async with victim_process(tmp_path / "victim") as victim, AsyncExitStack() as stack:
        before = await victim.ask("report")
        hostile = make_credentials("hostile")
        hostile_node = await start_nodes("hostile-mux")
        await open_slots_nobody_bound(hostile_node, victim, lanes, 65_536)
        forgotten = 65_536 * lanes - 4_096 * lanes
        await victim.until("velo_streaming_mux_refusals_forgotten_total", forgotten, timeout=60)
        await announce_4_gib(hostile, victim)
        async with hostile_client(hostile, victim.address) as peer:
            # each announces its opening and sends 1 byte of it
            peer.write_many(
                [
                    (_FIRST_STREAM + 4 * index, _HEADER.pack(16) + b"\x00")
                    for index in range(streams)
                ]
            )
            await victim.until(_rejections("stream_openings"), streams - 256, timeout=60)
        stalling = _StallingPeer()
        stalling_transport = await QuicEndpoint.start(
            make_credentials("hostile-pulls"), handler=stalling
        )
        stack.push_async_callback(stalling_transport.close)
        stack.callback(stalling.release.set)
        await staged_descriptors(stalling_transport, victim, descriptors)
        await victim.until(
            "velo_messenger_staged_pulls_refused_total{reason=count}", descriptors - 1024, 60
        )
        if slow:
            await unfinished_frames(make_credentials("hostile-frames"), victim)
        await legitimate_stream(await start_nodes("good"), victim)
        after = await victim.ask("report")
    return before, after


async def test_a_victim_process_stays_within_its_memory_bound_under_attack(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    before, after = await _attack(
        start_nodes,
        make_credentials,
        tmp_path,
        lanes=1,
        streams=2_000,
        descriptors=5_000,
        slow=False,
    )
    grown = (after["rss_kib"] - before["rss_kib"]) * 1024
    print(
        f"victim VmRSS {before['rss_kib']} KiB -> {after['rss_kib']} KiB (+{grown / MiB:.1f} MiB)"
    )
    assert grown <= RSS_BOUND, (before["rss_kib"], after["rss_kib"])
    metrics = after["metrics"]
    assert metrics["velo_streaming_mux_refused_slots"] == 4_096
    assert metrics["velo_streaming_mux_refusals_forgotten_total"] == 65_536 - 4_096
    assert metrics[_rejections("oversized_frame")] == 1
    assert metrics[_rejections("stream_openings")] >= 2_000 - 256
    assert after["pulls_outstanding"] <= 1_024
    assert after["mux_live_ingress_slots"] == 0  # the legitimate stream ended, nothing else lives


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_victim_process_stays_within_its_memory_bound_under_a_long_attack(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials], tmp_path: Path
) -> None:
    before, after = await _attack(
        start_nodes,
        make_credentials,
        tmp_path,
        lanes=4,
        streams=4_000,
        descriptors=20_000,
        slow=True,
    )
    grown = (after["rss_kib"] - before["rss_kib"]) * 1024
    print(
        f"victim VmRSS {before['rss_kib']} KiB -> {after['rss_kib']} KiB (+{grown / MiB:.1f} MiB)"
    )
    assert grown <= RSS_BOUND_SLOW, (before["rss_kib"], after["rss_kib"])
    metrics = after["metrics"]
    assert metrics["velo_streaming_mux_refused_slots"] == 4 * 4_096
    assert metrics[_rejections("partial_frame_bytes")] == 1
    assert after["pulls_outstanding"] <= 1_024
