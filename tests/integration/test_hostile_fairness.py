"""One member's flood of requests no longer takes the node from a legitimate peer.

The victim runs in a child process on each engine, the flooding member in another (so its
sending costs neither the victim nor the legitimate peer), and the legitimate peer in the
test's process: it streams 2,000 records to an anchor on the victim, timed (median of three
rounds) before the flood and during it. The victim serves each peer's lane data in turns
(``peer_turn_bytes`` per peer per turn of its loop), so the flood takes its share, not the
node: on aioquic the stream took 20-83x (56x here) its calm time before, 1.5-1.7x now with
other work on the machine, up to 3.7x on a busy one (docs/threat-model.md).

The design's target is 2x, a figure for a quiet machine: with three processes on two
cores here, the flooder's own CPU competes with the legitimate peer's, and a flood of small
requests costs the victim more CPU per byte than a stream's batches, which a share in
bytes does not see. This test guards a bound that holds on a shared two-core machine
(``SLOWDOWN_BOUND``); the figures are its printed ratios.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.conftest import StartNode
from tests.integration.test_hostile_memory import (
    ROOT,
    Victim,
    end_child,
    legitimate_stream,
    victim_process,
)
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials

# alone: each test asserts a ratio of wall-clock times (tests/run_alone.py).
pytestmark = [pytest.mark.timeout(240), pytest.mark.one_loop, pytest.mark.alone]

SLOWDOWN_BOUND = 8.0
"""What the flood may slow the legitimate stream by here (see the module docstring)."""
ROUNDS = 3
ITEMS = 2_000
_HANDLED = "velo_messenger_handler_requests_total{handler=echo,outcome=success,response_type=unary}"


@asynccontextmanager
async def flooder_process(credentials: Path, victim: Victim) -> AsyncIterator[None]:
    host, port = victim.address
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.procs.flooder",
        "--credentials",
        str(credentials),
        "--victim",
        str(victim.instance_id),
        "--host",
        host,
        "--port",
        str(port),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        assert line.strip() == b"flooding", line
        yield
    finally:
        await end_child(process)  # the flooder exits when its stdin closes


async def _median_stream_seconds(good: Node, victim: Victim) -> float:
    timings = []
    for _ in range(ROUNDS):
        began = time.perf_counter()
        await legitimate_stream(good, victim, ITEMS)
        timings.append(time.perf_counter() - began)
    return statistics.median(timings)


@pytest.mark.parametrize("engine", ["aioquic", "qh3"])
async def test_a_flooding_member_slows_a_legitimate_stream_by_a_bounded_factor(
    start_nodes: StartNode,
    make_credentials: Callable[..., NodeCredentials],
    tmp_path: Path,
    engine: str,
) -> None:
    make_credentials("victim").save(tmp_path / "victim")
    make_credentials("flooder").save(tmp_path / "flooder")
    async with victim_process(tmp_path / "victim", engine) as victim:
        good = await start_nodes("good")
        await legitimate_stream(good, victim, 100)  # connected both ways before timing
        calm = await _median_stream_seconds(good, victim)
        async with flooder_process(tmp_path / "flooder", victim):
            flooded_before = await victim.metric(_HANDLED)
            attacked = await _median_stream_seconds(good, victim)
            flooded = await victim.metric(_HANDLED) - flooded_before
    ratio = attacked / calm
    print(
        f"\nflooding member ({engine}): legitimate {ITEMS}-record stream {calm * 1000:.0f} ms"
        f" -> {attacked * 1000:.0f} ms ({ratio:.2f}x); {flooded:.0f} flood requests handled"
        " meanwhile"
    )
    assert flooded > 0
    assert ratio <= SLOWDOWN_BOUND, (calm, attacked)
