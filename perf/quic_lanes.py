"""Bulk throughput over the messenger mux by lane count, against raw aioquic, two processes.

A producer node streams ``--streams`` (64) streams of ``--items`` items of 16 KiB (bytes
payloads) to a consumer node in another process, over mutual-TLS QUIC with certificates
made on demand in a temporary directory. Both nodes run with ``TransportConfig(lanes=n,
max_datagram_size=d)``; the producer attaches every sender unkeyed (``attach_anchor``),
so where the streams go among the lanes is the mux's choice, and one task per stream
sends that stream's items as fast as its sender admits them. Each configuration is
measured:

* for each lane count in 1, 2, 4, 8, 16 (``--lanes``);
* at two datagram sizes, 1452 and 16,384 bytes (``--datagram-sizes``);
* on two networks (``--conditions``): ``clean`` loopback, and ``impaired``, where every
  datagram of both connections crosses the UDP impairment proxy
  (velomux_quic/programs/demo/proxy.py) running in a process of its own, so that it does
  not take the producer's CPU: by default 1% loss and 5 ms of delay each way (``--loss``,
  ``--delay-ms``, ``--jitter-ms``).
  Run *k* of every configuration uses proxy seed ``--seed + k - 1``, so the arms of one
  run meet the same loss pattern (the same datagram indices are dropped).

The ceiling, in the same run: **raw aioquic**, no velomux_quic code in the data path: an
aioquic ``QuicConnection`` over a UDP socket (through ``QuicConnectionProtocol``) in a
sender process and a receiver process, the same bytes (the same 64 x items items, each
carrying its stream index and sequence number) on one connection at the same datagram
size and the same socket buffers, with TLS 1.3 under the same kind of certificate: the
receiver presents the consumer node's certificate and the sender verifies it against the
cluster CA; the sender presents none (server authentication only, where the nodes
authenticate both ways: a handshake cost, outside the measured window). aioquic visits
every stream that has data for every packet it builds, so its cost per packet grows with
the number of streams; the ceiling therefore carries every item on **one** QUIC stream
(``--raw-streams`` spreads them over more, stream *i* on QUIC stream ``i % n``). Raw
aioquic has no back-pressure: the sender hands it one item per stream per event-loop
turn, without waiting, and aioquic buffers what it cannot send yet, where a velomux lane
holds at most its window plus 1 MiB.

Everything else is the library's defaults. Two liveness settings can be changed for a
diagnosis, and the report's first line then says so: ``--health-check-interval`` (the
mux's peer health check; 0 turns it off) and ``--heartbeat-interval`` (the consumer's
heartbeat window; its watchdog ends a stream after three windows without a record). On a
path that drains a lane slowly (1% loss at 1452-byte datagrams), the defaults end
healthy streams: see "Bulk throughput by lane count" in docs/performance.md.

Arms run interleaved: run 1 of every configuration, then run 2, ..., each in fresh
processes, so a burst of other load hits every arm alike. A failed run is reported as
failed for its configuration and the others go on; the exit status is non-zero if any
run failed.

    python perf/quic_lanes.py                        # the full sweep, 3 runs each (~20-30 min)
    python perf/quic_lanes.py --short                # about 1.5-3 minutes on 2 cores
    python perf/quic_lanes.py --lanes 1,4 --datagram-sizes 1452 --conditions clean --runs 5
    python perf/quic_lanes.py --json lanes.json --png lanes.png
    python perf/quic_lanes.py --engine aioquic qh3   # both QUIC engines, interleaved

``--engine`` runs every configuration (the mux and the raw ceiling) on each QUIC engine
named: the nodes with ``TransportConfig(engine=...)``, the raw arm with that library's own
connection and asyncio protocol (qh3's ``QuicConnectionProtocol`` has aioquic's shape).

What a run reports:

* **MiB/s**: payload bytes (streams x items x 16 KiB) over *e2e*, the producer's first
  send to the consumer's last item, both on ``time.perf_counter`` (CLOCK_MONOTONIC on
  Linux: one clock for every process on the host). A configuration shows the median of
  its successful runs and their min-max;
* **CPU seconds per GiB** on each side: user + sys ``getrusage(RUSAGE_SELF)`` deltas.
  The producer's window runs from its first send until the consumer has confirmed every
  item (so it includes handling acknowledgements and credit); the consumer's from just
  before the first send until its last stream ended. Waiting costs no CPU. The proxy's
  own CPU is in neither;
* for the mux, **x raw aioquic**: its median MiB/s over the raw median at the same
  datagram size and network, from the same run set (the JSON also has the ratio run by
  run);
* **lanes with data**: how many lanes carried at least 1% of the producer's frame
  bytes. The transport's metrics have no lane label, so the producer counts the frames
  handed to its transport's ``send`` per lane (one counter bump per batch, about 48 KiB);
* datagrams each way per MiB and, when impaired, what the proxy dropped (JSON).

Correctness is checked, not assumed: every item carries its stream index and sequence
number in its first 8 bytes; the consumer checks each stream received exactly its own
items, in order, whole (16 KiB each), and ended; a mux sender must have negotiated
``messenger-mux-v2`` and retired ``sent``. Any difference fails the run.

Every wait is bounded (``--timeout`` per step; streaming may take twice that) and every
child process (consumer, producer, proxy) is killed when a run fails or times out. Both
children run on ``velomux_quic.programs.runtime.run`` (uvloop when installed; set
``VELOMUX_NO_UVLOOP=1`` to measure plain asyncio), the raw ones too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from _harness import (
    BenchFailure,
    Child,
    CountingTransport,
    DatagramCount,
    Window,
    busy_before,
    expect_line,
    loop_environment,
    package_version,
    run_child,
    say,
    stdin_reader,
    watched,
)
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.security.certs import NodeCredentials, ensure_dev_cluster
from velomux_quic.streaming.anchor import StreamAnchor
from velomux_quic.streaming.control import MESSENGER_MUX_KEY
from velomux_quic.streaming.manager import StreamingConfig
from velomux_quic.streaming.sender import Retired, StreamSender
from velomux_quic.transport import TransportConfig

T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

ITEM_BYTES = 16 * KiB
HEADER = struct.Struct(">II")
"""The first bytes of every item: its stream index and its sequence number in that stream."""

LANE_COUNTS = (1, 2, 4, 8, 16)
DATAGRAM_SIZES = (1452, 16384)
CONDITIONS = ("clean", "impaired")

DEFAULTS = {"streams": 64, "items": 64, "runs": 3}
"""The full sweep: 64 streams of 1 MiB (64 MiB per run), 3 runs per configuration."""

SHORT = {
    "items": 16,
    "runs": 1,
    "lanes": (1, 8),
    "impaired_sizes": (1452,),
}
"""``--short``: 16 MiB per run, lanes 1 and 8, one run, impaired at 1452 bytes only."""

SOCKET_BUFFERS = (8 * MiB, 4 * MiB)
"""(receive, send) buffers of the raw sockets: what a velomux node asks for by default."""

RAW_ALPN = "velomux-bench-raw"
RAW_MAX_DATA = 16 * MiB
RAW_MAX_STREAM_DATA = RAW_MAX_DATA
"""The raw receiver's initial windows: a velomux node's connection window, which its one
stream may fill alone (aioquic grows both as data arrives), so that the ceiling is never
held back by flow control where the mux's n lanes would have n lane windows."""

REPOSITORY = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Arm:
    """One configuration: the mux with ``lanes`` lanes, or raw aioquic on ``lanes``
    QUIC streams, at one datagram size on one network."""

    system: str
    lanes: int
    datagram: int
    condition: str
    engine: str = "aioquic"
    """The QUIC engine both sides run (``--engine``)."""

    @property
    def key(self) -> str:
        what = f"mux lanes={self.lanes}" if self.system == "mux" else f"raw streams={self.lanes}"
        return f"{what} dgram={self.datagram} {self.condition} {self.engine}"


def plan(args: argparse.Namespace) -> list[Arm]:
    """Every configuration of the sweep, raw aioquic first in each group."""
    arms: list[Arm] = []
    for condition in args.conditions:
        sizes = args.datagram_sizes if condition == "clean" else args.impaired_sizes
        for datagram in sizes:
            for engine in args.engine:
                arms.append(Arm("raw", args.raw_streams, datagram, condition, engine))
                arms += [Arm("mux", n, datagram, condition, engine) for n in args.lanes]
    return arms


# -- items and their check --------------------------------------------------------------

_FILLER = bytes(ITEM_BYTES - HEADER.size)


def make_item(index: int, sequence: int) -> bytes:
    """16 KiB: the stream index and sequence number, then zeros."""
    return HEADER.pack(index, sequence) + _FILLER


class Tally:
    """Items received per stream, checked in order; first and last arrival times."""

    def __init__(self, streams: int, items: int) -> None:
        self.streams = streams
        self.items = items
        self.counts = [0] * streams
        self.first = 0.0
        self.last = 0.0
        self.armed = time.perf_counter()
        self.received = 0

    def item(self, index: int, sequence: int) -> None:
        """Record one item, failing at the first one lost, duplicated or out of place.
        The caller stamps ``last`` once the item's bytes are all in."""
        if not 0 <= index < self.streams:
            raise BenchFailure(f"an item names stream {index}: there are {self.streams}")
        expected = self.counts[index]
        if sequence != expected or expected >= self.items:
            raise BenchFailure(
                f"stream {index}: item #{expected} carries sequence {sequence} "
                f"(lost, duplicated or reordered; {self.items} expected)"
            )
        self.counts[index] = expected + 1
        self.received += 1
        if self.received == 1:
            self.first = time.perf_counter()

    @property
    def complete(self) -> bool:
        return self.received == self.streams * self.items

    def shortfall(self) -> str:
        short = [(i, n) for i, n in enumerate(self.counts) if n != self.items]
        sample = ", ".join(f"#{i}: {n}" for i, n in short[:8])
        return (
            f"{self.received} of {self.streams * self.items} items; {len(short)} streams "
            f"short of {self.items} ({sample}{', ...' if len(short) > 8 else ''})"
        )


# -- measuring inside a child -----------------------------------------------------------


def _transport_config(args: argparse.Namespace) -> TransportConfig:
    return TransportConfig(
        lanes=args.arm_lanes, max_datagram_size=args.datagram, engine=args.quic_engine
    )


def _mux_config(args: argparse.Namespace) -> MuxConfig:
    """The library's defaults, unless ``--health-check-interval`` overrides the check."""
    if args.health_check_interval is None:
        return MuxConfig()
    return MuxConfig(health_check_interval=args.health_check_interval)


def _streaming_config(args: argparse.Namespace) -> StreamingConfig:
    """The library's defaults, unless ``--heartbeat-interval`` overrides the window."""
    if args.heartbeat_interval is None:
        return StreamingConfig()
    return StreamingConfig(heartbeat_interval=args.heartbeat_interval)


async def _start_node(args: argparse.Namespace) -> Node:
    credentials = NodeCredentials.load(args.credentials)
    return await Node.start(
        credentials,
        transport=_transport_config(args),
        mux=_mux_config(args),
        streaming=_streaming_config(args),
    )


def _node_counter(node: Node, name: str, labels: dict[str, str]) -> float:
    for family in node.registry.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise BenchFailure(f"the node exports no {name} {labels}")


def _datagrams(node: Node) -> dict[str, float]:
    name = "velo_transport_datagrams_total"
    return {
        "out": _node_counter(node, name, {"transport": "quic", "direction": "outbound"}),
        "in": _node_counter(node, name, {"transport": "quic", "direction": "inbound"}),
    }


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


# -- the mux consumer -------------------------------------------------------------------


async def read_stream(anchor: StreamAnchor, index: int, tally: Tally) -> None:
    """One task per anchor: every item must be this stream's next, whole."""
    try:
        await _read_items(anchor, index, tally)
    except BenchFailure:
        raise
    except Exception as exc:  # the stream ended abnormally: say which, and how far it got
        raise BenchFailure(
            f"stream {index} failed after {tally.counts[index]} of {tally.items} items, "
            f"{time.perf_counter() - tally.armed:.1f} s after the go: "
            f"{type(exc).__name__}: {exc}; overall {tally.shortfall()}"
        ) from exc


async def _read_items(anchor: StreamAnchor, index: int, tally: Tally) -> None:
    count = 0
    async for item in anchor:
        if type(item) is not bytes or len(item) != ITEM_BYTES:
            raise BenchFailure(f"stream {index}: item #{count} is not {ITEM_BYTES} bytes")
        named, sequence = HEADER.unpack_from(item)
        if named != index:
            raise BenchFailure(f"stream {index}: item #{count} belongs to stream {named}")
        tally.item(index, sequence)
        tally.last = time.perf_counter()
        count += 1
    if count != tally.items:
        raise BenchFailure(f"stream {index} ended after {count} of {tally.items} items")


async def mux_consumer_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    async with await _start_node(args) as node:
        anchors = [node.create_anchor() for _ in range(args.streams)]
        tally = Tally(args.streams, args.items)
        readers = [
            asyncio.create_task(read_stream(anchor, index, tally))
            for index, anchor in enumerate(anchors)
        ]
        try:
            host, port = node.address
            say(
                "ready",
                {
                    "instance_id": str(node.instance_id),
                    "address": [host, port],
                    "handles": [anchor.handle.to_wire() for anchor in anchors],
                },
            )
            await expect_line(stdin, "go")
            window, datagrams = Window.open(None), _datagrams(node)
            tally.armed = window.at
            say("armed", {"at": window.at})
            try:
                async with asyncio.timeout(args.timeout):
                    await asyncio.gather(*readers)
            except TimeoutError:
                raise BenchFailure(
                    f"no end after {args.timeout:g} s: {tally.shortfall()}"
                ) from None
            ended_at = time.perf_counter()
            say(
                "result",
                {
                    "items": tally.received,
                    "armed_at": window.at,
                    "first_at": tally.first,
                    "last_at": tally.last,
                    "ended_at": ended_at,
                    "datagrams": _delta(_datagrams(node), datagrams),
                    **window.cpu(),
                    **loop_environment(),
                },
            )
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        await expect_line(stdin, "exit")
    return 0


# -- the mux producer -------------------------------------------------------------------


class LaneTally:
    """Frames and bytes the producer's transport is asked to send, per lane.

    The transport's metrics carry no lane label, so this wraps the transport's ``send``
    (an instance attribute shadowing the method: one extra call per ~48 KiB batch) to
    show where the mux placed the streams' batches.
    """

    def __init__(self, node: Node) -> None:
        transport = node.messenger.transport
        self.lanes = transport.config.lanes
        self.frames = [0] * self.lanes
        self.bytes = [0] * self.lanes
        send = transport.send

        def counted(peer: InstanceId, lane: int, body: bytes) -> Any:
            self.frames[lane % self.lanes] += 1
            self.bytes[lane % self.lanes] += len(body)
            return send(peer, lane, body)

        transport.send = counted  # type: ignore[method-assign]

    def reset(self) -> None:
        self.frames = [0] * self.lanes
        self.bytes = [0] * self.lanes

    def report(self) -> dict[str, Any]:
        total = sum(self.bytes)
        used = sum(1 for value in self.bytes if total and value >= 0.01 * total)
        return {"lane_frames": self.frames, "lane_bytes": self.bytes, "lanes_with_data": used}


async def send_stream(sender: StreamSender, index: int, items: int) -> None:
    """One task per stream sends its items as fast as its sender admits them."""
    for sequence in range(items):
        await sender.send(make_item(index, sequence))


async def mux_producer_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    async with await _start_node(args) as node:
        peer = await expect_line(stdin, "peer")
        consumer = InstanceId.parse(peer["instance_id"])
        node.add_peer(consumer, (peer["address"][0], int(peer["address"][1])))
        handles = [StreamAnchorHandle.from_wire(wire) for wire in peer["handles"]]
        lanes = LaneTally(node)
        started = time.perf_counter()
        async with asyncio.timeout(args.timeout):
            senders: list[StreamSender] = list(
                await asyncio.gather(*(node.attach_anchor(handle) for handle in handles))
            )
        attach_s = time.perf_counter() - started
        transports = sorted({str(sender.negotiated_transport()) for sender in senders})
        if transports != [MESSENGER_MUX_KEY]:
            raise BenchFailure(f"attached over {transports}, not only {MESSENGER_MUX_KEY}")
        say("attached", {"attach_s": attach_s, "lanes": node.messenger.transport.lanes(consumer)})

        await expect_line(stdin, "go")
        lanes.reset()
        window, datagrams = Window.open(None), _datagrams(node)
        try:
            async with asyncio.timeout(args.timeout):
                await asyncio.gather(
                    *(send_stream(s, i, args.items) for i, s in enumerate(senders))
                )
                sent_at = time.perf_counter()
                retired = await asyncio.gather(*(sender.finalize() for sender in senders))
                retired_at = time.perf_counter()
        except TimeoutError:
            raise BenchFailure(f"the producer did not finish within {args.timeout:g} s") from None
        outcomes = sorted({outcome.value for outcome in retired})
        if outcomes != [Retired.SENT.value]:
            raise BenchFailure(f"streams retired as {outcomes}, expected only 'sent'")
        await expect_line(stdin, "done")  # the consumer has every item
        cpu = window.cpu()
        say(
            "result",
            {
                "first_send_at": window.at,
                "sent_at": sent_at,
                "retired_at": retired_at,
                "datagrams": _delta(_datagrams(node), datagrams),
                **lanes.report(),
                **cpu,
                **loop_environment(),
            },
        )
        await expect_line(stdin, "exit")
    return 0


# -- raw aioquic ------------------------------------------------------------------------


def _raw_socket() -> socket.socket:
    """A loopback UDP socket with a velomux node's buffer sizes (best effort), so both
    systems meet the same kernel queues."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receive, send = SOCKET_BUFFERS
        for force, plain, size in (
            (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF, receive),
            (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF, send),
        ):
            try:
                sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, plain, size)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class RawPeer(QuicConnectionProtocol):
    """aioquic's own asyncio protocol for one connection, counting datagrams and, on the
    receiver, checking every stream's items."""

    def __init__(
        self, quic: QuicConnection, count: DatagramCount, tally: Tally | None = None
    ) -> None:
        super().__init__(quic)
        self.count = count
        self.tally = tally
        self.parsers: dict[int, ItemParser] = {}
        self.ended: set[int] = set()
        self.done = asyncio.Event()
        self.failure: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        counting = CountingTransport(transport, self.count)  # type: ignore[arg-type]
        super().connection_made(counting)  # type: ignore[arg-type]

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.count.into += 1
        super().datagram_received(data, addr)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if self.tally is None or self.failure is not None:
            return
        if isinstance(event, events.StreamDataReceived):
            try:
                self.stream_data(event)
            except BenchFailure as exc:
                self.failure = exc
                self.done.set()
        elif isinstance(event, events.ConnectionTerminated) and not self.done.is_set():
            self.failure = BenchFailure(f"the connection ended early: {event.reason_phrase!r}")
            self.done.set()

    def stream_data(self, event: events.StreamDataReceived) -> None:
        assert self.tally is not None
        parser = self.parsers.get(event.stream_id)
        if parser is None:
            parser = self.parsers[event.stream_id] = ItemParser()
        parser.feed(event.data, self.tally)
        self.tally.last = time.perf_counter()
        if event.end_stream:
            if parser.offset:
                raise BenchFailure(f"QUIC stream {event.stream_id} ended inside an item")
            self.ended.add(event.stream_id)
            if self.tally.complete and self.ended == set(self.parsers):
                self.done.set()


class ItemParser:
    """Cuts one QUIC stream's bytes into 16 KiB items and checks each header."""

    __slots__ = ("header", "offset")

    def __init__(self) -> None:
        self.offset = 0
        self.header = b""

    def feed(self, data: bytes, tally: Tally) -> None:
        position, size = 0, len(data)
        while position < size:
            if self.offset < HEADER.size:
                take = min(HEADER.size - self.offset, size - position)
                self.header += data[position : position + take]
                if len(self.header) == HEADER.size:
                    tally.item(*HEADER.unpack(self.header))
                    self.header = b""
            else:
                take = min(ITEM_BYTES - self.offset, size - position)
            position += take
            self.offset = (self.offset + take) % ITEM_BYTES


class RawServer(asyncio.DatagramProtocol):
    """The receiver's socket: creates the one server connection on the first datagram."""

    def __init__(
        self, configuration: QuicConfiguration, tally: Tally, engine: str = "aioquic"
    ) -> None:
        self.engine = engine
        self.configuration = configuration
        self.tally = tally
        self.count = DatagramCount()
        self.peer: RawPeer | None = None
        self.transport: asyncio.DatagramTransport | None = None
        self.connected = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.peer is None:
            connection_class, _, _, destination_of = _raw_stack(self.engine)
            quic = connection_class(
                configuration=self.configuration,
                original_destination_connection_id=destination_of(
                    data, self.configuration.connection_id_length
                ),
            )
            self.peer = _raw_peer_class(self.engine)(quic, self.count, self.tally)
            assert self.transport is not None
            self.peer.connection_made(self.transport)
            self.connected.set()
        self.peer.datagram_received(data, addr)


def _raw_stack(engine: str) -> tuple[Any, Any, Any, Callable[[bytes, int], bytes]]:
    """(connection class, configuration class, events module, header -> destination CID)
    of the raw arm's QUIC library: aioquic's, or qh3's, whose asyncio protocol has the
    same shape."""
    if engine == "qh3":
        from qh3._hazmat import pull_quic_header as qh3_header
        from qh3.quic import events as qh3_events
        from qh3.quic.configuration import QuicConfiguration as Qh3Configuration
        from qh3.quic.connection import QuicConnection as Qh3Connection

        return Qh3Connection, Qh3Configuration, qh3_events, lambda d, n: qh3_header(d, 0, n)[3]
    return (
        QuicConnection,
        QuicConfiguration,
        events,
        lambda d, n: pull_quic_header(Buffer(data=d), host_cid_length=n).destination_cid,
    )


def _raw_peer_class(engine: str) -> type[RawPeer]:
    """RawPeer on the engine's own asyncio protocol (qh3's twin of aioquic's)."""
    if engine != "qh3":
        return RawPeer
    from qh3.asyncio.protocol import QuicConnectionProtocol as Qh3Protocol
    from qh3.quic import events as qh3_events

    class Qh3RawPeer(Qh3Protocol):  # type: ignore[misc]
        """RawPeer's body on qh3's protocol (zero-argument super() cannot be shared)."""

        def __init__(self, quic: Any, count: DatagramCount, tally: Tally | None = None) -> None:
            super().__init__(quic)
            self.count = count
            self.tally = tally
            self.parsers: dict[int, ItemParser] = {}
            self.ended: set[int] = set()
            self.done = asyncio.Event()
            self.failure: BaseException | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            counting = CountingTransport(transport, self.count)  # type: ignore[arg-type]
            super().connection_made(counting)

        def datagram_received(self, data: bytes | str, addr: Any) -> None:
            self.count.into += 1
            super().datagram_received(data, addr)

        stream_data = RawPeer.stream_data

        def quic_event_received(self, event: Any) -> None:
            if self.tally is None or self.failure is not None:
                return
            if isinstance(event, qh3_events.StreamDataReceived):
                try:
                    self.stream_data(event)
                except BenchFailure as exc:
                    self.failure = exc
                    self.done.set()
            elif isinstance(event, qh3_events.ConnectionTerminated) and not self.done.is_set():
                self.failure = BenchFailure(f"the connection ended early: {event.reason_phrase!r}")
                self.done.set()

    return Qh3RawPeer  # type: ignore[return-value]


def _raw_configuration(args: argparse.Namespace, *, is_client: bool) -> QuicConfiguration:
    configuration_class = _raw_stack(args.quic_engine)[1]
    return configuration_class(  # type: ignore[no-any-return]
        initial_rtt=0.1,  # aioquic's default, for both libraries alike
        alpn_protocols=[RAW_ALPN],
        is_client=is_client,
        max_datagram_size=args.datagram,
        max_data=RAW_MAX_DATA,
        max_stream_data=RAW_MAX_STREAM_DATA,
        idle_timeout=30.0,
        server_name="localhost" if is_client else None,
    )


async def raw_receiver_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    credentials = NodeCredentials.load(args.credentials)
    configuration = _raw_configuration(args, is_client=False)
    if args.quic_engine == "qh3":
        pem = credentials.certificate.public_bytes(Encoding.PEM)
        key = credentials.private_key.private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        )
        configuration.load_cert_chain(pem, key)
    else:
        configuration.certificate = credentials.certificate
        configuration.certificate_chain = list(credentials.chain)
        configuration.private_key = credentials.private_key
    tally = Tally(args.streams, args.items)
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(
        lambda: RawServer(configuration, tally, args.quic_engine), sock=_raw_socket()
    )
    try:
        host, port = transport.get_extra_info("sockname")[:2]
        say("ready", {"address": [host, port]})
        await expect_line(stdin, "go")
        window, datagrams = Window.open(None), server.count.snapshot()
        say("armed", {"at": window.at})
        try:
            async with asyncio.timeout(args.timeout):
                await server.connected.wait()
                assert server.peer is not None
                await server.peer.done.wait()
        except TimeoutError:
            raise BenchFailure(f"no end after {args.timeout:g} s: {tally.shortfall()}") from None
        if server.peer.failure is not None:
            raise server.peer.failure
        ended_at = time.perf_counter()
        say(
            "result",
            {
                "items": tally.received,
                "armed_at": window.at,
                "first_at": tally.first,
                "last_at": tally.last,
                "ended_at": ended_at,
                "datagrams": _delta(server.count.snapshot(), datagrams),
                **window.cpu(),
                **loop_environment(),
            },
        )
        await expect_line(stdin, "exit")
    finally:
        transport.close()
    return 0


async def raw_sender_main(args: argparse.Namespace) -> int:
    stdin = await stdin_reader()
    credentials = NodeCredentials.load(args.credentials)
    configuration = _raw_configuration(args, is_client=True)
    cadata = b"".join(root.public_bytes(Encoding.PEM) for root in credentials.trust_roots)
    configuration.load_verify_locations(cadata=cadata)
    peer = await expect_line(stdin, "peer")
    loop = asyncio.get_running_loop()
    count = DatagramCount()
    quic = _raw_stack(args.quic_engine)[0](configuration=configuration)
    peer_class = _raw_peer_class(args.quic_engine)
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: peer_class(quic, count), sock=_raw_socket()
    )
    try:
        started = time.perf_counter()
        protocol.connect((peer["address"][0], int(peer["address"][1])))
        async with asyncio.timeout(args.timeout):
            await protocol.wait_connected()
        say("attached", {"attach_s": time.perf_counter() - started, "lanes": args.arm_lanes})
        await expect_line(stdin, "go")
        window, datagrams = Window.open(None), count.snapshot()
        # Client-initiated unidirectional streams are 4k + 2 (RFC 9000, 2.1); aioquic's
        # get_next_available_stream_id would name the same unopened stream every time.
        streams = [4 * k + 2 for k in range(args.arm_lanes)]
        for sequence in range(args.items):  # one pass: one item per stream, in order
            for index in range(args.streams):
                last = sequence == args.items - 1 and index >= args.streams - args.arm_lanes
                quic.send_stream_data(
                    streams[index % len(streams)], make_item(index, sequence), end_stream=last
                )
            protocol.transmit()
            await asyncio.sleep(0)  # let acknowledgements in between passes
        sent_at = time.perf_counter()
        await expect_line(stdin, "done")  # the receiver has every item
        cpu = window.cpu()
        say(
            "result",
            {
                "first_send_at": window.at,
                "sent_at": sent_at,
                "retired_at": sent_at,
                "datagrams": _delta(count.snapshot(), datagrams),
                "lanes_with_data": args.arm_lanes,
                **cpu,
                **loop_environment(),
            },
        )
        protocol.close()
        with contextlib.suppress(TimeoutError):  # draining is outside the measurement
            async with asyncio.timeout(5):
                await protocol.wait_closed()
        await expect_line(stdin, "exit")
    finally:
        transport.close()
    return 0


# -- the orchestrator -------------------------------------------------------------------


def _child_command(args: argparse.Namespace, arm: Arm, role: str, credentials: Path) -> list[str]:
    command = [
        sys.executable, str(Path(__file__).resolve()),
        "--role", f"{arm.system}-{role}",
        "--credentials", str(credentials),
        "--arm-lanes", str(arm.lanes),
        "--quic-engine", arm.engine,
        "--datagram", str(arm.datagram),
        "--streams", str(args.streams),
        "--items", str(args.items),
        "--timeout", str(args.timeout),
    ]  # fmt: skip
    if args.health_check_interval is not None:
        command += ["--health-check-interval", str(args.health_check_interval)]
    if args.heartbeat_interval is not None:
        command += ["--heartbeat-interval", str(args.heartbeat_interval)]
    return command


def _proxy_command(args: argparse.Namespace, target: Sequence[Any], number: int) -> list[str]:
    return [
        sys.executable, "-m", "velomux_quic.programs.demo.proxy",
        "--target", f"{target[0]}:{target[1]}",
        "--loss", str(args.loss),
        "--delay-ms", str(args.delay_ms),
        "--jitter-ms", str(args.jitter_ms),
        "--seed", str(args.seed + number),
    ]  # fmt: skip


@dataclass
class Exchange:
    """What the children said during one run."""

    attached: dict[str, Any]
    sent: dict[str, Any]
    received: dict[str, Any]
    proxy: dict[str, Any] | None


@dataclass
class Cast:
    """The processes of one run: the receiving side, the proxy when impaired, the sender."""

    consumer: Child
    proxy: Child | None
    producer: Child

    def others(self, child: Child) -> list[Child]:
        """Everyone but ``child``: the processes whose death ends a wait on it."""
        everyone = [self.consumer, self.producer, *([self.proxy] if self.proxy else [])]
        return [other for other in everyone if other is not child]


async def _start(
    args: argparse.Namespace, arm: Arm, nodes: dict[str, Path], number: int, children: list[Child]
) -> tuple[Cast, dict[str, Any]]:
    """Start the receiving side, the proxy when impaired, then the sender, and wait until
    the sender is attached (mux) or connected (raw). Returns the cast and what the sender
    said; ``children`` gets every process as soon as it exists, for the caller to kill."""
    timeout = args.timeout
    receiver, sender = ("consumer", "producer") if arm.system == "mux" else ("receiver", "sender")
    consumer = await Child.start(
        receiver, _child_command(args, arm, receiver, nodes["consumer"]), REPOSITORY
    )
    children.append(consumer)
    ready = await watched(consumer.expect("ready"), [], f"starting the {receiver}", timeout)
    address = ready["address"]
    proxy: Child | None = None
    if arm.condition == "impaired":
        proxy = await Child.start("proxy", _proxy_command(args, address, number), REPOSITORY)
        children.append(proxy)
        where = await watched(
            proxy.expect_json("its address"), [consumer], "starting the proxy", timeout
        )
        address = [where["host"], where["port"]]
    producer = await Child.start(
        sender, _child_command(args, arm, sender, nodes["producer"]), REPOSITORY
    )
    children.append(producer)
    cast = Cast(consumer, proxy, producer)
    producer.send("peer", {**ready, "address": address})
    attached = await watched(
        producer.expect("attached"), cast.others(producer), "attaching", timeout
    )
    return cast, attached


async def _measure(args: argparse.Namespace, cast: Cast) -> tuple[dict[str, Any], dict[str, Any]]:
    """Arm the consumer, start the producer, and collect both reports."""
    consumer, producer, timeout = cast.consumer, cast.producer, args.timeout
    consumer.send("go")
    await watched(consumer.expect("armed"), cast.others(consumer), "arming", timeout)
    producer.send("go")
    # Generous: each child enforces ``timeout`` itself and explains what is stuck.
    received = await watched(
        consumer.expect("result"), cast.others(consumer), "streaming", 2 * timeout
    )
    producer.send("done")
    sent = await watched(
        producer.expect("result"), cast.others(producer), f"{producer.name} report", timeout
    )
    return sent, received


async def _stop(args: argparse.Namespace, cast: Cast) -> dict[str, Any] | None:
    """Let every child exit cleanly; the proxy's counters when there was one."""
    for child in (cast.producer, cast.consumer):
        child.send("exit")
        code = await child.finish(args.timeout)
        if code != 0:
            raise BenchFailure(f"the {child.name} exited with code {code} after its report")
    if cast.proxy is None:
        return None
    cast.proxy.close_stdin()
    counters = await watched(
        cast.proxy.expect_json("its counters"), [], "stopping the proxy", args.timeout
    )
    if await cast.proxy.finish(args.timeout) != 0:
        raise BenchFailure("the proxy exited with an error")
    return counters


async def one_run(
    args: argparse.Namespace, arm: Arm, nodes: dict[str, Path], number: int
) -> dict[str, Any]:
    children: list[Child] = []
    try:
        cast, attached = await _start(args, arm, nodes, number, children)
        sent, received = await _measure(args, cast)
        counters = await _stop(args, cast)
    finally:
        for child in children:
            await child.reap()
    return _summarise(args, arm, Exchange(attached, sent, received, counters))


def _summarise(args: argparse.Namespace, arm: Arm, exchange: Exchange) -> dict[str, Any]:
    sent, received = exchange.sent, exchange.received
    expected = args.streams * args.items
    if received["items"] != expected:
        raise BenchFailure(f"{received['items']} items delivered, expected {expected}")
    payload = expected * ITEM_BYTES
    shared = "CLOCK_MONOTONIC" in sent["clock"] and "CLOCK_MONOTONIC" in received["clock"]
    start = sent["first_send_at"] if shared else received["armed_at"]
    e2e = received["last_at"] - start
    cpu_p = sent["cpu_user_s"] + sent["cpu_sys_s"]
    cpu_c = received["cpu_user_s"] + received["cpu_sys_s"]
    mib = payload / MiB
    result: dict[str, Any] = {
        **asdict(arm),
        "key": arm.key,
        "payload_bytes": payload,
        "attach_s": exchange.attached["attach_s"],
        "send_s": sent["sent_at"] - sent["first_send_at"],
        "e2e_s": e2e,
        "e2e_shared_clock": shared,
        "mib_per_s": mib / e2e,
        "producer_cpu_s": cpu_p,
        "consumer_cpu_s": cpu_c,
        "producer_cpu_s_per_gib": cpu_p * GiB / payload,
        "consumer_cpu_s_per_gib": cpu_c * GiB / payload,
        "producer_datagrams_out_per_mib": sent["datagrams"]["out"] / mib,
        "producer_datagrams_in_per_mib": sent["datagrams"]["in"] / mib,
        "consumer_datagrams_in_per_mib": received["datagrams"]["in"] / mib,
        "lanes_configured": exchange.attached["lanes"],
        "lanes_with_data": sent["lanes_with_data"],
        "producer_loop": sent["loop"],
        "consumer_loop": received["loop"],
    }
    if "lane_bytes" in sent:
        result["lane_bytes"] = sent["lane_bytes"]
    if exchange.proxy is not None:
        counters = exchange.proxy["counters"]
        result["proxy"] = counters
        for direction, short in (
            ("client_to_server", "to_consumer"),
            ("server_to_client", "to_producer"),
        ):
            seen = counters[direction]
            result[f"proxy_loss_{short}"] = seen["dropped_loss"] / max(1, seen["received"])
    return result


# -- reporting --------------------------------------------------------------------------


def _ok(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run for run in runs if "failed" not in run]


def summarise_arm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (and the throughput's min-max) over one configuration's successful runs."""
    done = _ok(runs)
    summary: dict[str, Any] = {"runs": len(runs), "ok": len(done)}
    if not done:
        return summary
    rates = [run["mib_per_s"] for run in done]
    summary.update(
        {
            "mib_per_s": statistics.median(rates),
            "mib_per_s_min": min(rates),
            "mib_per_s_max": max(rates),
            "producer_cpu_s_per_gib": statistics.median(r["producer_cpu_s_per_gib"] for r in done),
            "consumer_cpu_s_per_gib": statistics.median(r["consumer_cpu_s_per_gib"] for r in done),
            "lanes_with_data": max(run["lanes_with_data"] for run in done),
            "datagrams_out_per_mib": statistics.median(
                r["producer_datagrams_out_per_mib"] for r in done
            ),
        }
    )
    if "proxy_loss_to_consumer" in done[0]:
        summary["proxy_loss_to_consumer"] = statistics.median(
            r["proxy_loss_to_consumer"] for r in done
        )
    return summary


def _raw_of(arm: Arm, arms: Sequence[Arm]) -> Arm | None:
    for other in arms:
        if other.system == "raw" and (other.datagram, other.condition, other.engine) == (
            arm.datagram,
            arm.condition,
            arm.engine,
        ):
            return other
    return None


def add_ratios(
    arms: Sequence[Arm],
    by_arm: dict[Arm, list[dict[str, Any]]],
    summaries: dict[Arm, dict[str, Any]],
) -> None:
    """Each mux configuration's throughput over raw aioquic's, of the medians and run by run."""
    for arm in arms:
        raw = _raw_of(arm, arms)
        if arm.system != "mux" or raw is None:
            continue
        mine, base = summaries[arm], summaries[raw]
        if "mib_per_s" in mine and "mib_per_s" in base:
            mine["x_raw"] = mine["mib_per_s"] / base["mib_per_s"]
        paired = [
            run["mib_per_s"] / base_run["mib_per_s"]
            for run, base_run in zip(by_arm[arm], by_arm[raw], strict=True)
            if "failed" not in run and "failed" not in base_run
        ]
        if paired:
            mine["x_raw_by_run"] = paired


def markdown_table(arms: Sequence[Arm], summaries: dict[Arm, dict[str, Any]]) -> str:
    header = [
        "network", "datagram", "engine", "system", "lanes", "MiB/s (median)", "min-max",
        "producer CPU s/GiB", "consumer CPU s/GiB", "x raw (same engine)", "lanes with data",
        "datagrams out/MiB", "runs ok",
    ]  # fmt: skip
    lines = [
        "| " + " | ".join(header) + " |",
        "|---|---:|---|---|---:|" + "---:|" * (len(header) - 5),
    ]
    for arm in arms:
        s = summaries[arm]
        system = "mux" if arm.system == "mux" else f"raw {arm.engine}"
        lanes = (
            str(arm.lanes)
            if arm.system == "mux"
            else f"({arm.lanes} stream{'s' * (arm.lanes > 1)})"
        )
        cells = [arm.condition, f"{arm.datagram:,}", arm.engine, system, lanes]
        if "mib_per_s" in s:
            cells += [
                f"{s['mib_per_s']:.1f}",
                f"{s['mib_per_s_min']:.1f}-{s['mib_per_s_max']:.1f}",
                f"{s['producer_cpu_s_per_gib']:.1f}",
                f"{s['consumer_cpu_s_per_gib']:.1f}",
                f"{s['x_raw']:.2f}" if "x_raw" in s else ("1" if arm.system == "raw" else "n/a"),
                str(s["lanes_with_data"]) if arm.system == "mux" else "—",
                f"{s['datagrams_out_per_mib']:.0f}",
            ]
        else:
            cells += ["FAILED", *("—" for _ in range(6))]
        cells.append(f"{s['ok']}/{s['runs']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mux_line(
    axis: Any,
    arms: Sequence[Arm],
    summaries: dict[Arm, dict[str, Any]],
    size: int,
    condition: str,
    colour: str,
) -> None:
    """One datagram size's mux medians by lane count, min-max as error bars; a failed
    configuration as a red cross on the axis."""
    mine = [a for a in arms if a.system == "mux" and (a.datagram, a.condition) == (size, condition)]
    done = [a for a in mine if "mib_per_s" in summaries[a]]
    failed = [a.lanes for a in mine if "mib_per_s" not in summaries[a]]
    if done:
        medians = [summaries[a]["mib_per_s"] for a in done]
        below = [summaries[a]["mib_per_s"] - summaries[a]["mib_per_s_min"] for a in done]
        above = [summaries[a]["mib_per_s_max"] - summaries[a]["mib_per_s"] for a in done]
        axis.errorbar(
            [a.lanes for a in done],
            medians,
            yerr=[below, above],
            marker="o",
            capsize=3,
            color=colour,
            label=f"mux, {size:,} B datagrams",
        )
    if failed:
        axis.plot(
            failed,
            [0] * len(failed),
            "x",
            color="red",
            markersize=10,
            clip_on=False,
            label=f"mux, {size:,} B: every run failed",
        )
    raw = next(
        (a for a in arms if a.system == "raw" and (a.datagram, a.condition) == (size, condition)),
        None,
    )
    if raw is not None and "mib_per_s" in summaries[raw]:
        axis.axhline(
            summaries[raw]["mib_per_s"],
            linestyle="--",
            color=colour,
            label=f"raw aioquic, {size:,} B datagrams",
        )


def draw(path: Path, arms: Sequence[Arm], summaries: dict[Arm, dict[str, Any]], title: str) -> None:
    """MiB/s by lane count, one panel per network, one line per datagram size (min-max
    as error bars), raw aioquic as a dashed horizontal line of the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conditions = [c for c in CONDITIONS if any(a.condition == c for a in arms)]
    figure, axes = plt.subplots(
        1, len(conditions), figsize=(6.5 * len(conditions), 4.6), squeeze=False
    )
    sizes = sorted({arm.datagram for arm in arms})
    colours = dict(zip(sizes, ("tab:blue", "tab:orange", "tab:green", "tab:purple"), strict=False))
    ticks = sorted({arm.lanes for arm in arms if arm.system == "mux"}) or list(LANE_COUNTS)
    for axis, condition in zip(axes[0], conditions, strict=True):
        for size in sizes:
            if any(a.condition == condition and a.datagram == size for a in arms):
                _mux_line(axis, arms, summaries, size, condition, colours.get(size, "black"))
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
        axis.set_xlabel("lanes")
        axis.set_ylabel("MiB/s (median, min-max)")
        axis.set_ylim(bottom=0)
        axis.set_title(condition)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def replot(source: Path, target: Path) -> int:
    """Draw ``target`` from a ``--json`` document, without measuring anything."""
    document = json.loads(source.read_text())
    arms: list[Arm] = []
    summaries: dict[Arm, dict[str, Any]] = {}
    for entry in document["summary"]:
        arm = Arm(
            entry["system"],
            entry["lanes"],
            entry["datagram"],
            entry["condition"],
            entry.get("engine", "aioquic"),
        )
        arms.append(arm)
        summaries[arm] = entry
    config = document["config"]
    title = (
        f"quic_lanes: {config['streams']} streams x {config['items_per_stream']} items of "
        f"{config['item_bytes'] // KiB} KiB, {config['runs']} "
        f"run{'s' * (config['runs'] > 1)} per configuration"
    )
    draw(target, arms, summaries, title)
    return 0


def _progress(arm: Arm, number: int, runs: int, result: dict[str, Any]) -> str:
    where = f"{arm.key} run {number + 1}/{runs}"
    if "failed" in result:
        return f"{where}: FAILED: {result['failed']}"
    line = (
        f"{where}: {result['mib_per_s']:.1f} MiB/s, CPU s/GiB "
        f"{result['producer_cpu_s_per_gib']:.1f} producer, "
        f"{result['consumer_cpu_s_per_gib']:.1f} consumer"
    )
    if arm.system == "mux":
        line += f", lanes with data {result['lanes_with_data']}/{result['lanes_configured']}"
    if "proxy_loss_to_consumer" in result:
        line += f", proxy dropped {100 * result['proxy_loss_to_consumer']:.2f}% to the consumer"
    return line


def _overrides(args: argparse.Namespace) -> str:
    """The library defaults this run changed, for the headline (none by default)."""
    changed = []
    if args.health_check_interval is not None:
        changed.append(f"mux health check every {args.health_check_interval:g} s (0: off)")
    if args.heartbeat_interval is not None:
        changed.append(f"heartbeat window {args.heartbeat_interval:g} s")
    return f"; NOT the defaults: {', '.join(changed)}" if changed else ""


def _headline(args: argparse.Namespace, environment: dict[str, Any]) -> str:
    payload = args.streams * args.items * ITEM_BYTES
    impaired = (
        f"; impaired = {100 * args.loss:g}% loss, {args.delay_ms:g} ms delay"
        + (f" + U(0, {args.jitter_ms:g}) ms jitter" if args.jitter_ms else "")
        + " each way, proxy in its own process"
        if "impaired" in args.conditions
        else ""
    )
    return (
        f"quic_lanes: {args.streams} streams x {args.items} items of {ITEM_BYTES // KiB} KiB "
        f"({payload / MiB:g} MiB per run), {args.runs} run{'s' * (args.runs > 1)} per "
        f"configuration (interleaved){impaired}{_overrides(args)}; raw aioquic on "
        f"{args.raw_streams} QUIC "
        f"stream{'s' * (args.raw_streams > 1)}, server certificate only; "
        f"{environment['loop']}, {environment['cpus']} CPUs, Python {environment['python']}, "
        f"aioquic {environment['aioquic']}"
    )


async def orchestrate(args: argparse.Namespace) -> int:
    arms = plan(args)
    by_arm: dict[Arm, list[dict[str, Any]]] = {arm: [] for arm in arms}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="quic-lanes-") as tmp:
        nodes = ensure_dev_cluster(Path(tmp), ("producer", "consumer"))
        for number in range(args.runs):  # interleaved: run 1 of every arm, then run 2, ...
            for arm in arms:
                busy = await busy_before(f"{arm.key} run {number + 1}")
                try:
                    result = await one_run(args, arm, nodes, number)
                except BenchFailure as exc:
                    result = {**asdict(arm), "key": arm.key, "failed": str(exc)}
                result["run"] = number + 1
                result["other_cpu_busy_before"] = busy
                by_arm[arm].append(result)
                print(_progress(arm, number, args.runs, result), file=sys.stderr, flush=True)
    summaries = {arm: summarise_arm(runs) for arm, runs in by_arm.items()}
    add_ratios(arms, by_arm, summaries)
    environment = _environment_of(by_arm)
    headline = _headline(args, environment)
    print(headline + "\n")
    print(markdown_table(arms, summaries))
    failures = [result for runs in by_arm.values() for result in runs if "failed" in result]
    for failure in failures:
        print(f"\n{failure['key']} run {failure['run']} FAILED: {failure['failed']}")
    print(
        f"\n{len(arms)} configurations x {args.runs} runs in {time.perf_counter() - started:.0f} s"
    )
    if args.json is not None:
        document = {
            "benchmark": "quic_lanes",
            "config": _config_of(args),
            "environment": environment,
            "runs": [run for runs in by_arm.values() for run in runs],
            "summary": [{**asdict(arm), "key": arm.key, **summaries[arm]} for arm in arms],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.png is not None:
        draw(args.png, arms, summaries, headline.split(";")[0])
    return 2 if failures else 0


def _environment_of(by_arm: dict[Arm, list[dict[str, Any]]]) -> dict[str, Any]:
    loops = sorted({run["producer_loop"] for runs in by_arm.values() for run in _ok(runs)})
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loop": ", ".join(loops) or "unknown",
        "aioquic": package_version("aioquic"),
        "qh3": package_version("qh3"),
        "uvloop": package_version("uvloop"),
        "velomux_quic": package_version("velomux_quic"),
    }


def _config_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "streams": args.streams,
        "items_per_stream": args.items,
        "item_bytes": ITEM_BYTES,
        "runs": args.runs,
        "lanes": list(args.lanes),
        "datagram_sizes": list(args.datagram_sizes),
        "impaired_sizes": list(args.impaired_sizes),
        "conditions": list(args.conditions),
        "loss": args.loss,
        "delay_ms": args.delay_ms,
        "jitter_ms": args.jitter_ms,
        "seed": args.seed,
        "raw_streams": args.raw_streams,
        "mux_health_check_interval": args.health_check_interval,
        "heartbeat_interval": args.heartbeat_interval,
        "short": args.short,
        "interleaved": True,
    }


# -- command line -----------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _conditions(text: str) -> tuple[str, ...]:
    found = tuple(part.strip() for part in text.split(",") if part.strip())
    if not found or any(part not in CONDITIONS for part in found):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(CONDITIONS)}, got {text!r}")
    return found


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="16 MiB per run, lanes 1 and 8, one run, impaired at 1452 B only",
    )
    parser.add_argument(
        "--runs", type=int, help=f"runs per configuration (default {DEFAULTS['runs']})"
    )
    parser.add_argument(
        "--streams", type=int, default=DEFAULTS["streams"], help="streams (default 64)"
    )
    parser.add_argument(
        "--items", type=int, help=f"16 KiB items per stream (default {DEFAULTS['items']})"
    )
    parser.add_argument("--lanes", type=_ints, help="lane counts (default 1,2,4,8,16)")
    parser.add_argument(
        "--datagram-sizes", type=_ints, default=DATAGRAM_SIZES, help="default 1452,16384"
    )
    parser.add_argument(
        "--impaired-sizes", type=_ints, help="datagram sizes measured impaired (default: all)"
    )
    parser.add_argument(
        "--conditions", type=_conditions, default=CONDITIONS, help="clean,impaired (default both)"
    )
    parser.add_argument(
        "--loss", type=float, default=0.01, help="impaired: loss each way (default 0.01)"
    )
    parser.add_argument(
        "--delay-ms", type=float, default=5.0, help="impaired: delay each way (default 5)"
    )
    parser.add_argument(
        "--jitter-ms", type=float, default=0.0, help="impaired: jitter each way (default 0)"
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="proxy seed of run 1 (run k uses seed + k - 1)"
    )
    parser.add_argument(
        "--raw-streams",
        type=int,
        default=1,
        help="QUIC streams raw aioquic spreads the items over (default 1)",
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="longest wait for any one step (s)"
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        help="the consumer's heartbeat window (StreamingConfig; default: its default); its "
        "watchdog ends a stream after 3 windows without a record",
    )
    parser.add_argument(
        "--health-check-interval",
        type=float,
        help="the mux's peer health check period on both nodes (default: MuxConfig's); "
        "0 turns the check off",
    )
    parser.add_argument("--json", type=Path, help="also write every run and the summary here")
    parser.add_argument("--png", type=Path, help="also draw MiB/s by lane count here")
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only draw --png from a --json document of an earlier run",
    )

    # The children's own arguments (the benchmark starts them with these).
    parser.add_argument(
        "--role",
        choices=("mux-consumer", "mux-producer", "raw-receiver", "raw-sender"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--engine",
        nargs="+",
        choices=("aioquic", "qh3"),
        default=["aioquic"],
        help="QUIC engines: every configuration runs on each, interleaved (aioquic)",
    )
    parser.add_argument("--credentials", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--quic-engine", choices=("aioquic", "qh3"), default="aioquic", help=argparse.SUPPRESS
    )
    parser.add_argument("--arm-lanes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--datagram", type=int, default=1452, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    short = args.short
    args.runs = args.runs or (SHORT["runs"] if short else DEFAULTS["runs"])
    args.items = args.items or (SHORT["items"] if short else DEFAULTS["items"])
    args.lanes = args.lanes or (SHORT["lanes"] if short else LANE_COUNTS)
    args.impaired_sizes = args.impaired_sizes or (
        SHORT["impaired_sizes"] if short else args.datagram_sizes
    )
    if args.role is not None:
        return args
    if min(args.runs, args.streams, args.items, args.raw_streams) < 1:
        parser.error("--runs, --streams, --items and --raw-streams must be at least 1")
    if args.raw_streams > args.streams:
        parser.error("--raw-streams cannot exceed --streams")
    if any(not 1 <= lanes <= 16 for lanes in args.lanes):
        parser.error("lane counts are 1 to 16")
    if any(not 1200 <= size <= 65000 for size in (*args.datagram_sizes, *args.impaired_sizes)):
        parser.error("datagram sizes are 1200 to 65000 bytes")
    if not 0 <= args.loss < 1 or args.delay_ms < 0 or args.jitter_ms < 0 or args.timeout <= 0:
        parser.error("--loss must be 0 to 1, delays >= 0, --timeout > 0")
    if args.health_check_interval is not None and args.health_check_interval < 0:
        parser.error("--health-check-interval must be >= 0")
    if args.heartbeat_interval is not None and args.heartbeat_interval <= 0:
        parser.error("--heartbeat-interval must be > 0")
    return args


_ROLES: dict[str, Callable[[argparse.Namespace], Any]] = {
    "mux-consumer": mux_consumer_main,
    "mux-producer": mux_producer_main,
    "raw-receiver": raw_receiver_main,
    "raw-sender": raw_sender_main,
}


def _child(args: argparse.Namespace) -> int:
    code: int = run_child(_ROLES[args.role](args))
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        if args.role is not None:
            return _child(args)
        if args.replot is not None:
            if args.png is None:
                print("--replot needs --png", file=sys.stderr)
                return 2
            return replot(args.replot, args.png)
        return asyncio.run(orchestrate(args))
    except BenchFailure as exc:
        who = f"{args.role}: " if args.role else ""
        print(f"quic_lanes FAILED: {who}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
