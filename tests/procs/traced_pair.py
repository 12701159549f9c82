"""Two nodes in one process, traced or not: an attach, a stream, a call, a ticket's stream.

    python -m tests.procs.traced_pair --certs DIR [--sdk | --sdk-late | --no-otel]

``--sdk`` installs OpenTelemetry's SDK as the global tracer provider with an in-memory
exporter (what an application does), and prints every finished span as one JSON line;
``--sdk-late`` installs it only after the attach, the nodes already running (an
application that sets its provider late). ``--no-otel`` makes OpenTelemetry unimportable
before the library is imported (as if the extra were not installed). Either way the last
line is a JSON summary: what arrived, the messenger's reserved headers, which
OpenTelemetry modules the process imported, and (``otel_calls``) how many spans the
API's no-op tracers made and how many contexts were attached, counted by wrapping those
API functions before the library is imported.

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


def count_otel_calls() -> dict[str, int]:
    """Wrap the API's no-op span factories and its context attach, counting their calls:
    what tracing does while no provider records (a test double of the API, not of the
    library under test)."""
    from opentelemetry import context, propagate, trace

    counts = {"noop_spans": 0, "context_attaches": 0, "propagations": 0}

    def counting(owner: Any, name: str, key: str) -> None:
        real = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    counting(trace.NoOpTracer, "start_span", "noop_spans")
    counting(trace.ProxyTracer, "start_span", "noop_spans")
    counting(trace.ProxyTracer, "start_as_current_span", "noop_spans")
    counting(context, "attach", "context_attaches")
    propagator = type(propagate.get_global_textmap())
    counting(propagator, "inject", "propagations")
    counting(propagator, "extract", "propagations")
    return counts


async def scenario(certs: Path, between: Any = None) -> dict[str, Any]:
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
        if between is not None:
            between()
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
    mode.add_argument("--sdk-late", action="store_true")
    mode.add_argument("--no-otel", action="store_true")
    args = parser.parse_args()
    counts: dict[str, int] = {}
    if args.no_otel:
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]
    else:
        from velomux_quic.tracing import tracing_available

        if not args.sdk and tracing_available():  # switched off: import nothing of it
            counts = count_otel_calls()
    exporters = [install_sdk()] if args.sdk else []
    before_provider: dict[str, int] = {}

    def provider_late() -> None:
        before_provider.update(counts)  # from here on the spans are real: not counted
        exporters.append(install_sdk())

    summary = asyncio.run(scenario(args.certs, provider_late if args.sdk_late else None))
    summary["otel_calls"] = before_provider if args.sdk_late else dict(counts)
    for exporter in exporters:
        for span in exporter.get_finished_spans():
            print(json.dumps(span_line(span)))
    summary["otel_modules"] = sorted(
        name for name, module in sys.modules.items() if "opentelemetry" in name and module
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
