"""A frontend: registers requests with an engine and reads each one's tokens as they come.

Start ``examples/engine.py`` first and run the command line it prints::

    python examples/frontend.py --certs /tmp/velomux-certs --engine <id> --address 127.0.0.1:<port>

For every request the frontend

1. creates an anchor (the consumer's end of the request's stream) and pre-binds it:
   ``prebind_anchor`` returns a :class:`StreamOpenTicket` for a slot already bound here;
2. sends ``generate`` to the engine with ``Node.call``: the handle and the ticket ride
   inside the request it had to send anyway, so the engine's first token batch opens the
   stream (zero round trips spent on the stream itself);
3. reads the tokens with ``async for``, timing the first one and the gaps between them.

At the end it checks every stream arrived complete and in order, that no mux slot is
left live, and prints the latency it saw. Only root imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from velomux_quic import (
    CallError,
    InstanceId,
    Node,
    PeerRecord,
    StreamError,
    VelomuxError,
    ensure_dev_cluster,
    open_node,
)

NODE_NAMES = ("engine", "frontend")


@dataclass
class RequestResult:
    """What one request's stream delivered, and when."""

    request_id: str
    tokens: list[dict[str, object]] = field(default_factory=list)
    first_token_seconds: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def in_order(self, expected: int) -> bool:
        return [token["i"] for token in self.tokens] == list(range(expected))


async def run_request(
    frontend: Node, engine: InstanceId, request_id: str, tokens: int
) -> RequestResult:
    """Register one request with the engine and read its stream to the end."""
    anchor = frontend.create_anchor()
    ticket = frontend.prebind_anchor(anchor.handle)  # the slot is bound here, now
    request = {
        "id": request_id,
        "handle": str(anchor.handle.value),
        "ticket": ticket.encode().hex(),
        "tokens": tokens,
    }
    result = RequestResult(request_id)
    started = time.perf_counter()
    reply = await frontend.call(engine, "generate", json.dumps(request).encode(), timeout=30.0)
    if json.loads(reply).get("accepted") != request_id:
        raise RuntimeError(f"the engine answered {reply!r} to {request_id}")
    last = started
    async for token in anchor:
        now = time.perf_counter()
        if result.tokens:
            result.gaps.append(now - last)
        else:
            result.first_token_seconds = now - started
        last = now
        result.tokens.append(token)
    return result


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def run(
    certs: Path, engine: InstanceId, address: tuple[str, int], requests: int, tokens: int
) -> int:
    dirs = ensure_dev_cluster(certs, NODE_NAMES)
    engine_record = PeerRecord(engine, address, name="engine")
    async with open_node(dirs["frontend"], peers=[engine_record], name="frontend") as frontend:
        started = time.perf_counter()
        try:
            results = await asyncio.gather(
                *(run_request(frontend, engine, f"req-{n}", tokens) for n in range(requests))
            )
        except CallError as error:  # UnknownHandler, UnaryTimeout, PeerGone, ...
            print(f"frontend: the engine did not take a request: {error!r}")
            return 1
        except StreamError as error:  # SenderDropped, StreamTransportError, ...
            print(f"frontend: a stream broke: {error!r}")
            return 1
        elapsed = time.perf_counter() - started
        delivered = sum(len(result.tokens) for result in results)
        complete = all(result.in_order(tokens) for result in results)
        first = [result.first_token_seconds * 1000 for result in results]
        gaps = [gap * 1000 for result in results for gap in result.gaps]
        snapshot = frontend.snapshot().mux
        live_slots = sum(t.live_slots for t in snapshot.ingress.values()) if snapshot else 0
        print(f"frontend: {requests} requests x {tokens} tokens from engine {engine}")
        print(
            f"delivered {delivered} tokens in {elapsed:.2f} s, "
            f"every stream complete and in order: {complete}"
        )
        print(
            f"first token p50 {statistics.median(first):.1f} ms, "
            f"p99 {percentile(first, 0.99):.1f} ms; "
            f"inter-token p50 {statistics.median(gaps):.1f} ms, "
            f"p99 {percentile(gaps, 0.99):.1f} ms"
        )
        print(f"live ingress slots after the run: {live_slots}")
        ok = complete and delivered == requests * tokens and live_slots == 0
        print("frontend OK" if ok else "frontend FAILED")
        return 0 if ok else 1


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_instance_id(text: str) -> InstanceId:
    try:
        return InstanceId.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--certs", type=Path, required=True, help="the engine's --certs")
    parser.add_argument("--engine", type=parse_instance_id, required=True, help="its InstanceId")
    parser.add_argument("--address", type=parse_address, required=True, help="its HOST:PORT")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args.certs, args.engine, args.address, args.requests, args.tokens))
    except VelomuxError as error:
        print(f"frontend failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
