"""Streaming faults between real nodes: a stalled consumer, a retried attach, typed errors
for bad handles, and a node that closes under its streams."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic import StreamingConfig
from velomux_quic.node import Node


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
