"""``velomux demo``: a decode engine streaming tokens to a frontend in another process.

The engine (node-a, this process) starts its node and a frontend process (node-b), which
it tells where it listens. The frontend sends the engine one request per stream, through
the node's public request path: each request carries the anchor's handle and a zero-RTT
ticket (:meth:`Node.prebind_anchor`). The engine opens every stream with its ticket, no
attach round trip, then runs forward passes: one token per live request per pass, the
shape of LLM decoding. The frontend reads every stream with its own task, checks each
arrived complete and in order, and reports back with one more request. Both nodes
authenticate each other with certificates made on demand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .errors import TicketError
from .ids import InstanceId, StreamAnchorHandle
from .messenger import PeerRecord
from .messenger.registry import Context
from .node import Node, open_node
from .runtime import run
from .security.certs import ensure_dev_cluster
from .streaming.control import StreamOpenTicket
from .streaming.sender import StreamSender

__all__ = ["add_demo_commands"]

HELLO = "demo.hello"
"""Frontend to engine: where the frontend listens, so the engine can stream back to it."""
GENERATE = "demo.generate"
"""Frontend to engine: one request, with its anchor's handle and (with a mux) a ticket."""
REPORT = "demo.report"
"""Frontend to engine: what arrived, once every stream ended."""


async def _frontend(args: argparse.Namespace) -> int:
    """node-b: requests out, tokens checked, a report out."""
    engine = PeerRecord(
        instance_id=InstanceId.parse(args.engine_instance),
        address=(args.engine_host, args.engine_port),
    )
    async with open_node(args.credentials, peers=[engine]) as node:
        peer = engine.instance_id
        address = json.dumps({"address": list(node.address)}).encode()
        await node.call(peer, HELLO, address, timeout=args.timeout)
        anchors = [node.create_anchor() for _ in range(args.streams)]

        def request(index: int) -> bytes:
            handle = anchors[index].handle
            try:
                ticket = node.prebind_anchor(handle).encode().hex()
            except TicketError:  # no mux on this node: the engine attaches instead
                ticket = ""
            return json.dumps({"index": index, "handle": handle.value, "ticket": ticket}).encode()

        async def read(index: int) -> tuple[int, bool]:
            expected = 0
            in_order = True
            async for token in anchors[index]:
                in_order &= token == [index, expected]
                expected += 1
            return expected, in_order

        readers = asyncio.gather(*map(read, range(args.streams)))
        await asyncio.gather(
            *(
                node.call(peer, GENERATE, request(i), timeout=args.timeout)
                for i in range(args.streams)
            )
        )
        results = await asyncio.wait_for(readers, args.timeout)
        report = {
            "tokens": sum(count for count, _ in results),
            "in_order": all(ok for _, ok in results),
            "metrics": {
                line.split()[0]: float(line.split()[1])
                for line in node.metrics_text().splitlines()
                if line.startswith("velo_streaming_frames_received_total")
            },
        }
        await node.call(peer, REPORT, json.dumps(report).encode(), timeout=args.timeout)
    return 0


class _EngineInbox:
    """What the engine's handlers receive from the frontend, and the events it waits on."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.requests: list[tuple[int, StreamAnchorHandle, StreamOpenTicket | None]] = []
        """(the frontend's index of the stream, its anchor, its ticket) per request."""
        self.all_requests = asyncio.Event()
        self.report: dict[str, Any] = {}
        self.reported = asyncio.Event()

    def generate(self, ctx: Context) -> None:
        """A request: inline, it only notes the handle and ticket for the next pass."""
        body = json.loads(bytes(ctx.payload))
        ticket = StreamOpenTicket.decode(bytes.fromhex(body["ticket"])) if body["ticket"] else None
        handle = StreamAnchorHandle(int(body["handle"]))
        self.requests.append((int(body["index"]), handle, ticket))
        if len(self.requests) == self.streams:
            self.all_requests.set()

    def report_received(self, ctx: Context) -> None:
        self.report = json.loads(bytes(ctx.payload))
        self.reported.set()


async def _demo(args: argparse.Namespace) -> int:
    nodes = ensure_dev_cluster(args.certs, ("node-a", "node-b"))
    async with open_node(nodes["node-a"]) as engine:
        inbox = _EngineInbox(args.streams)
        frontend_seen = asyncio.Event()
        frontend_address: list[tuple[str, int]] = []

        def hello(ctx: Context) -> None:
            host, port = json.loads(bytes(ctx.payload))["address"]
            engine.add_peer(ctx.sender, (str(host), int(port)))
            frontend_address.append((str(host), int(port)))
            frontend_seen.set()

        engine.register_handler(HELLO, hello)
        engine.register_handler(GENERATE, inbox.generate)
        engine.register_handler(REPORT, inbox.report_received)
        host, port = engine.address
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "velomux_quic.cli", "demo-frontend",
            "--credentials", str(nodes["node-b"]), "--streams", str(args.streams),
            "--timeout", str(args.timeout), "--engine-instance", str(engine.instance_id),
            "--engine-host", host, "--engine-port", str(port),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            print(f"engine   node-a {engine.instance_id} on {host}:{port}")
            await asyncio.wait_for(frontend_seen.wait(), args.timeout)
            started = time.perf_counter()
            await asyncio.wait_for(inbox.all_requests.wait(), args.timeout)
            print(f"frontend node-b on {frontend_address[0][0]}:{frontend_address[0][1]} "
                  f"(child pid {child.pid}), {args.streams} requests")  # fmt: skip
            senders = await asyncio.gather(*(_open(engine, h, t) for _, h, t in inbox.requests))
            open_ms = 1e3 * (time.perf_counter() - started)
            keys = {str(s.negotiated_transport()) for s in senders}
            tickets = sum(ticket is not None for _, _, ticket in inbox.requests)
            print(f"opened {len(senders)} streams ({tickets} with zero-RTT tickets) "
                  f"{open_ms:.0f} ms after the hello, transport {sorted(keys)}")  # fmt: skip
            index_of = [index for index, _, _ in inbox.requests]
            started = time.perf_counter()
            for step in range(args.tokens):
                for index, sender in zip(index_of, senders, strict=True):
                    await sender.send([index, step])
                engine.flush_batch()  # one write per peer per pass
            retired = await asyncio.gather(*(s.finalize() for s in senders))
            await asyncio.wait_for(inbox.reported.wait(), args.timeout)
            report = inbox.report
            elapsed = time.perf_counter() - started
            tokens = args.streams * args.tokens
            print(f"{args.tokens} forward passes: {tokens} tokens in {elapsed:.2f} s "
                  f"({tokens / elapsed:,.0f} tokens/s)")  # fmt: skip
            print(f"frontend received {int(report['tokens'])} tokens, every stream in order: "
                  f"{report['in_order']}; all {len(retired)} streams retired as "
                  f"{sorted({r.value for r in retired})}")  # fmt: skip
            ok = report["in_order"] and report["tokens"] == tokens
            print("demo OK" if ok else "demo FAILED")
            exit_code = await asyncio.wait_for(child.wait(), args.timeout)
            return 0 if ok and exit_code == 0 else 1
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()


async def _open(
    engine: Node, handle: StreamAnchorHandle, ticket: StreamOpenTicket | None
) -> StreamSender:
    """Open a request's stream with its ticket, or attach when the frontend had no mux."""
    if ticket is None:
        return await engine.attach_anchor(handle)
    return await engine.open_anchor_stream(handle, ticket)


def add_demo_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``velomux demo`` (and the hidden ``demo-frontend`` it runs as its child)."""
    demo = commands.add_parser("demo", help="an engine streams tokens to a frontend process")
    demo.add_argument("--certs", type=Path, default=Path("certs/dev"),
                      help="where dev certificates live (made on demand)")  # fmt: skip
    demo.add_argument("--streams", type=int, default=256, help="concurrent requests")
    demo.add_argument("--tokens", type=int, default=64, help="tokens per request")
    demo.add_argument("--timeout", type=float, default=120.0)
    demo.set_defaults(handler=lambda args: run(_demo(args)))

    frontend = commands.add_parser("demo-frontend", help=argparse.SUPPRESS)
    frontend.add_argument("--credentials", type=Path, required=True)
    frontend.add_argument("--streams", type=int, default=256)
    frontend.add_argument("--timeout", type=float, default=120.0)
    frontend.add_argument("--engine-instance", required=True)
    frontend.add_argument("--engine-host", required=True)
    frontend.add_argument("--engine-port", type=int, required=True)
    frontend.set_defaults(handler=lambda args: run(_frontend(args)))
