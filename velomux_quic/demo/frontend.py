"""A demo frontend (a child process): requests out, every token checked, a report back.

It registers each of its requests the way a serving frontend would: it creates the
request's anchor, binds its mux slot (``prebind_anchor``) and sends the engine one
``GENERATE`` call carrying the handle and the zero-RTT ticket, so the engine's first
batch opens the stream with no attach round trip. One task per stream reads the tokens,
checks each is the next one of its own stream, and measures its latency against the
engine's stamp. A few times a second it tells the engine how far it got (the parent's
progress display); at the end it writes its latency samples to the file the engine
named and reports what arrived, its CPU, its counters and its live mux slots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ..errors import TicketError
from ..ids import InstanceId
from ..messenger import PeerRecord
from ..node import Node, open_node
from ..streaming.anchor import StreamAnchor
from ..transport.config import TransportConfig
from .measure import CpuWindow, counters_since, live_slots, read_counters
from .protocol import GENERATE, PROGRESS, REPORT, ArmPlan, Latencies, Request, write_latencies

__all__ = ["add_frontend_arguments", "frontend_main"]

PROGRESS_INTERVAL = 0.25
"""Seconds between two progress messages: often enough for a live display, rare enough
(a few dozen messages a run) not to show in the counters."""


class _StreamReader:
    """What one frontend's streams delivered, and how late."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.delivered = 0
        self.complete = 0
        """Streams that ended with every token, each the next of its own stream."""
        self.out_of_order = 0
        self.last_token_ns = 0
        """When the last token of any stream reached the consumer (``perf_counter_ns``)."""
        self.latencies = Latencies.empty()

    async def read(self, index: int, anchor: StreamAnchor[Any]) -> None:
        clock = time.perf_counter_ns
        first, later, gaps = self.latencies.first, self.latencies.later, self.latencies.gaps
        expected = 0
        in_order = True
        last = 0
        async for token in anchor:
            now = clock()
            stream, step, stamp = token
            if stream != index or step != expected:
                in_order = False
            if expected == 0:
                first.append(now - stamp)
            else:
                later.append(now - stamp)
                gaps.append(now - last)
            last = now
            expected += 1
            self.delivered += 1
        self.last_token_ns = max(self.last_token_ns, last)
        if in_order and expected == self.tokens:
            self.complete += 1
        elif not in_order:
            self.out_of_order += 1


async def _report_progress(node: Node, engine: InstanceId, reader: _StreamReader) -> None:
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL)
        await node.send_message(engine, PROGRESS, str(reader.delivered).encode())


async def _settled_live_slots(node: Node, timeout: float = 2.0) -> int:
    """The node's live mux slots, given the close records a moment to be processed: a
    slot's close is handled on the receive path just after the stream's last item."""
    deadline = time.monotonic() + timeout
    while (found := live_slots(node)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return found


async def frontend_main(args: argparse.Namespace) -> int:
    plan = ArmPlan(args.arm, args.requests, args.tokens, args.pace_ms, args.lanes, args.flush)
    engine = PeerRecord(
        instance_id=InstanceId.parse(args.engine_instance),
        address=(args.engine_host, args.engine_port),
    )
    peer = engine.instance_id
    transport = TransportConfig(lanes=plan.lanes)
    async with open_node(args.credentials, peers=[engine], transport=transport) as node:
        indices = plan.indices(args.index)
        anchors = [node.create_anchor() for _ in indices]
        reader = _StreamReader(plan.tokens)
        cpu = CpuWindow.open()
        before = read_counters(node)

        def request(index: int, anchor: StreamAnchor[Any]) -> bytes:
            ticket: bytes | None = None
            if plan.arm == "mux":
                try:
                    ticket = node.prebind_anchor(anchor.handle).encode()
                except TicketError:  # no mux on this node after all: the engine attaches
                    ticket = None
            return Request(index, anchor.handle.value, ticket).encode()

        readers = [
            asyncio.create_task(reader.read(index, anchor))
            for index, anchor in zip(indices, anchors, strict=True)
        ]
        progress = asyncio.create_task(_report_progress(node, peer, reader))
        try:
            await asyncio.gather(
                *(
                    node.call(peer, GENERATE, request(index, anchor), timeout=args.timeout)
                    for index, anchor in zip(indices, anchors, strict=True)
                )
            )
            streaming = args.timeout + plan.tokens * plan.pace_ms / 1e3 * 4
            async with asyncio.timeout(streaming):
                await asyncio.gather(*readers)
        finally:
            progress.cancel()
            for task in readers:
                task.cancel()
            await asyncio.gather(progress, *readers, return_exceptions=True)
        cpu_s = cpu.seconds()
        counters = counters_since(before, read_counters(node))
        write_latencies(args.latency_out, reader.latencies)
        report = {
            "frontend": args.index,
            "streams": len(indices),
            "tokens": reader.delivered,
            "complete": reader.complete,
            "out_of_order": reader.out_of_order,
            "cpu_s": cpu_s,
            "last_token_at": reader.last_token_ns / 1e9,
            "counters": counters,
            "live_slots": await _settled_live_slots(node),
        }
        await node.call(peer, REPORT, json.dumps(report).encode(), timeout=args.timeout)
    return 0


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden ``demo-frontend`` command's arguments (the engine passes them)."""
    parser.add_argument("--credentials", type=Path, required=True)
    parser.add_argument("--engine-instance", required=True)
    parser.add_argument("--engine-host", required=True)
    parser.add_argument("--engine-port", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--arm", choices=("mux", "per-stream"), required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--pace-ms", type=float, required=True)
    parser.add_argument("--lanes", type=int, required=True)
    parser.add_argument("--flush", choices=("auto", "manual"), required=True)
    parser.add_argument("--latency-out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, required=True)
