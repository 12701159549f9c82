"""What the demo's engine and frontends say to each other, and the shape of one run.

Everything crosses the nodes' own request path (``Node.call`` / ``Node.send_message``):
the frontends send requests and reports to the engine, the engine streams tokens back
through the mux (or one QUIC stream per request on the per-stream arm). The frontends'
latency samples, which are large, go through a file the engine names for each of them.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ARMS",
    "GENERATE",
    "PROGRESS",
    "REPORT",
    "ArmPlan",
    "Latencies",
    "Request",
    "read_latencies",
    "write_latencies",
]

GENERATE = "demo.generate"
"""Frontend to engine, one call per request: its index, its anchor's handle and, when the
frontend has a mux, the zero-RTT ticket that opens the stream with no attach round trip."""
PROGRESS = "demo.progress"
"""Frontend to engine, a few times a second (fire-and-forget): tokens read so far."""
REPORT = "demo.report"
"""Frontend to engine, once every stream of the frontend ended: what arrived, its CPU."""

ARMS = ("mux", "per-stream", "grpc")
"""``mux``: every stream to a frontend batched on the messenger mux (the default);
``per-stream``: the engine runs without a mux, so every stream is a QUIC stream of its
own (``quic-stream-v1``); ``grpc``: grpc.aio, one server-streaming RPC per request."""


@dataclass(frozen=True, slots=True)
class ArmPlan:
    """One arm's load and settings, as both sides need them."""

    arm: str
    requests: int
    tokens: int
    pace_ms: float
    lanes: int
    flush: str
    """``auto`` (the mux's AutoFlush) or ``manual`` (one ``flush_batch()`` per pass)."""
    frontends: int = 2

    def indices(self, frontend: int) -> range:
        """The requests frontend ``frontend`` owns: every ``frontends``-th one."""
        return range(frontend, self.requests, self.frontends)


@dataclass(frozen=True, slots=True)
class Request:
    """One GENERATE call's body."""

    index: int
    handle: int
    ticket: bytes | None

    def encode(self) -> bytes:
        ticket = self.ticket.hex() if self.ticket is not None else ""
        return json.dumps({"index": self.index, "handle": self.handle, "ticket": ticket}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        body: dict[str, Any] = json.loads(data)
        ticket = bytes.fromhex(body["ticket"]) if body["ticket"] else None
        return cls(int(body["index"]), int(body["handle"]), ticket)


@dataclass(slots=True)
class Latencies:
    """Nanosecond samples, emit (the engine's ``perf_counter_ns`` in the token) to the
    consumer's code; one clock, since every process of the demo runs on one host."""

    first: array[int]
    """Each stream's first token."""
    later: array[int]
    """Every token after a stream's first."""
    gaps: array[int]
    """Between consecutive tokens of one stream, at the consumer: the inter-token latency
    a user reading the stream sees."""

    @classmethod
    def empty(cls) -> Latencies:
        return cls(array("q"), array("q"), array("q"))

    def extend(self, other: Latencies) -> None:
        self.first.extend(other.first)
        self.later.extend(other.later)
        self.gaps.extend(other.gaps)


_HEADER = struct.Struct("<3Q")


def write_latencies(path: Path, latencies: Latencies) -> None:
    """The three arrays, counts first, renamed into place so a reader sees all or none."""
    parts: Sequence[array[int]] = (latencies.first, latencies.later, latencies.gaps)
    staging = path.with_suffix(".partial")
    with staging.open("wb") as out:
        out.write(_HEADER.pack(*(len(part) for part in parts)))
        for part in parts:
            part.tofile(out)
    staging.replace(path)


def read_latencies(path: Path) -> Latencies:
    data = path.read_bytes()
    counts = _HEADER.unpack_from(data)
    offset = _HEADER.size
    found = Latencies.empty()
    for target, count in zip((found.first, found.later, found.gaps), counts, strict=True):
        target.frombytes(data[offset : offset + 8 * count])
        offset += 8 * count
    return found
