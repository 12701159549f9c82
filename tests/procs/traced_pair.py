"""Two nodes in one process, traced or not: an attach, a stream, a call, a ticket's stream.

    python -m tests.procs.traced_pair --certs DIR [--sdk | --no-otel]

``--sdk`` installs OpenTelemetry's SDK as the global tracer provider with an in-memory
exporter (what an application does), and prints every finished span as one JSON line.
``--no-otel`` makes OpenTelemetry unimportable before the library is imported (as if the
extra were not installed). Either way the last line is a JSON summary: what arrived, the
messenger's reserved headers, and which OpenTelemetry modules the process imported.

In one process the two nodes share the tracer provider, but not the context: the anchor's
node reads the caller's context only from the request's headers, as a node in another
process does (the spans say so: their parent is remote).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any


def install_sdk() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def span_line(span: Any) -> dict[str, Any]:
    context = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "parent_remote": bool(parent.is_remote) if parent is not None else None,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def request_span() -> contextlib.AbstractContextManager[Any]:
    if "opentelemetry.sdk" not in sys.modules:
        return contextlib.nullcontext()
    from opentelemetry import trace

    return trace.get_tracer("frontend").start_as_current_span("frontend request")


async def scenario(certs: Path) -> dict[str, Any]:
    from velomux_quic import StreamAnchorHandle, StreamOpenTicket, ensure_dev_cluster, open_node

    nodes = ensure_dev_cluster(certs, ("engine", "frontend"))
    async with (
        open_node(nodes["frontend"]) as frontend,
        open_node(nodes["engine"], peers=[frontend.record]) as engine,
    ):
        frontend.add_peer(engine.instance_id, engine.address)
        # 1. An attach and a stream, engine to frontend.
        anchor = frontend.create_anchor()
        sender = await engine.attach_anchor(anchor.handle)
        for token in range(3):
            await sender.send(token)
        await sender.finalize()
        attached = [token async for token in anchor]
        # 2. A call.
        frontend.register_handler("echo", lambda ctx: bytes(ctx.payload))
        echoed = await engine.call(frontend.instance_id, "echo", b"hi", timeout=10)

        # 3. A request answered with a stream opened from its ticket.
        async def generate(ctx: Any) -> bytes:
            request = json.loads(bytes(ctx.payload))
            handle = StreamAnchorHandle(request["handle"])
            ticket = StreamOpenTicket.decode(bytes.fromhex(request["ticket"]))
            stream = await engine.open_anchor_stream(handle, ticket)
            for token in range(4):
                await stream.send(token)
            await stream.finalize()
            return b"done"

        engine.register_handler("generate", generate, dispatch="spawn")
        with request_span():  # the frontend's own span around the request, when traced
            answer = frontend.create_anchor()
            ticket = frontend.prebind_anchor(answer.handle)
            body = json.dumps({"handle": answer.handle.value, "ticket": ticket.encode().hex()})

            async def read() -> list[Any]:
                return [token async for token in answer]

            reply, streamed = await asyncio.gather(
                frontend.call(engine.instance_id, "generate", body.encode(), timeout=10), read()
            )
        return {
            "attached": attached,
            "echoed": echoed.decode(),
            "reply": reply.decode(),
            "streamed": streamed,
            "engine": str(engine.instance_id),
            "frontend": str(frontend.instance_id),
            "reserved_headers": list(engine.snapshot().messenger.reserved_headers),
        }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--certs", type=Path, required=True)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sdk", action="store_true")
    mode.add_argument("--no-otel", action="store_true")
    args = parser.parse_args()
    if args.no_otel:
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]
    exporter = install_sdk() if args.sdk else None
    summary = asyncio.run(scenario(args.certs))
    if exporter is not None:
        for span in exporter.get_finished_spans():
            print(json.dumps(span_line(span)))
    summary["otel_modules"] = sorted(
        name for name, module in sys.modules.items() if "opentelemetry" in name and module
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
