"""A demo frontend (a child process): requests out, every token checked, a report back.

The engine starts each frontend as ``python -m velomux_quic.programs.demo.frontend`` with the
arguments of :func:`build_parser`; it is no command of its own.

On a QUIC arm it registers each of its requests the way a serving frontend would: it
creates the request's anchor, binds its mux slot (``prebind_anchor``) and sends the engine
one ``GENERATE`` call carrying the handle and the zero-RTT ticket, so the engine's first
batch opens the stream with no attach round trip. On the gRPC arm it opens one
server-streaming RPC per request on one channel (:mod:`.grpc_tokens`). Either way one task
per stream reads the tokens, checks each is the next one of its own stream, and measures
its latency against the engine's stamp. A few times a second it tells the engine how far
it got (the parent's progress display); at the end it writes its latency samples to the
file the engine named and reports what arrived and its CPU (on a QUIC arm also its
counters and its live mux slots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from msgpack import unpackb  # type: ignore[import-untyped]

from ... import (
    InstanceId,
    Node,
    PeerRecord,
    StreamAnchor,
    TicketError,
    TransportConfig,
    open_node,
)
from ..runtime import run
from .measure import CpuWindow, counters_since, live_slots, read_counters
from .protocol import (
    ARMS,
    GENERATE,
    PROGRESS,
    REPORT,
    ArmPlan,
    Latencies,
    Request,
    write_latencies,
)

__all__ = ["build_parser", "frontend_main", "grpc_frontend_main", "main"]

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

    async def read(self, index: int, anchor: AsyncIterable[Any]) -> None:
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
    if args.engine_instance is None:
        raise SystemExit("--engine-instance is needed on a QUIC arm")
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


async def _decoded(call: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """An RPC's responses as the tokens they carry."""
    async for message in call:
        yield unpackb(message)


async def _print_progress(reader: _StreamReader) -> None:
    """Tokens read so far, one number a line on stdout, for the engine's display."""
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL)
        print(reader.delivered, flush=True)


async def grpc_frontend_main(args: argparse.Namespace) -> int:
    """The gRPC arm's frontend: one RPC per request, its tokens checked as on QUIC."""
    from .grpc_tokens import TokenClient

    plan = ArmPlan(args.arm, args.requests, args.tokens, args.pace_ms, args.lanes, args.flush)
    indices = plan.indices(args.index)
    reader = _StreamReader(plan.tokens)
    cpu = CpuWindow.open()
    client = await TokenClient.open(args.engine_port, args.credentials, args.timeout)
    readers = [
        asyncio.create_task(reader.read(index, _decoded(client.call(index)))) for index in indices
    ]
    progress = asyncio.create_task(_print_progress(reader))
    try:
        async with asyncio.timeout(args.timeout + plan.tokens * plan.pace_ms / 1e3 * 4):
            await asyncio.gather(*readers)
    finally:
        progress.cancel()
        for task in readers:
            task.cancel()
        await asyncio.gather(progress, *readers, return_exceptions=True)
        await client.close()
    write_latencies(args.latency_out, reader.latencies)
    report = {
        "frontend": args.index,
        "streams": len(indices),
        "tokens": reader.delivered,
        "complete": reader.complete,
        "out_of_order": reader.out_of_order,
        "cpu_s": cpu.seconds(),
        "last_token_at": reader.last_token_ns / 1e9,
    }
    args.report_out.write_text(json.dumps(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The frontend's arguments, all given by the engine that starts it."""
    parser = argparse.ArgumentParser(
        prog="python -m velomux_quic.programs.demo.frontend",
        description="A frontend process of `velomux demo`, started by its engine.",
    )
    parser.add_argument("--credentials", type=Path, required=True, help="its node directory")
    parser.add_argument("--engine-instance", help="the engine's InstanceId (QUIC arms)")
    parser.add_argument("--engine-host", required=True, help="where the engine listens")
    parser.add_argument("--engine-port", type=int, required=True, help="the engine's port")
    parser.add_argument("--index", type=int, required=True, help="this frontend's number")
    parser.add_argument("--arm", choices=ARMS, required=True, help="the arm being run")
    parser.add_argument("--requests", type=int, required=True, help="requests of the run")
    parser.add_argument("--tokens", type=int, required=True, help="tokens per request")
    parser.add_argument("--pace-ms", type=float, required=True, help="ms between passes")
    parser.add_argument("--lanes", type=int, required=True, help="QUIC lanes per peer")
    parser.add_argument("--flush", choices=("auto", "manual"), required=True, help="policy")
    parser.add_argument("--latency-out", type=Path, required=True, help="samples file")
    parser.add_argument("--report-out", type=Path, help="report file (gRPC arm)")
    parser.add_argument("--timeout", type=float, required=True, help="longest wait, s")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.arm == "grpc":
        return run(grpc_frontend_main(args))
    return run(frontend_main(args))


if __name__ == "__main__":
    sys.exit(main())
