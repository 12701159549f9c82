"""The probe's server side: the handlers ``velomux node`` serves for ``velomux probe``.

``velomux.sink`` hands a producer (any payload) the handle of a fresh anchor on this node
and, when the mux runs, a zero-RTT ticket for it (``{"handle": <int>, "ticket": <hex> |
null}``); the producer then streams into that anchor, which the sink reads to its end and
counts (``velomux_sink_records_total``, ``velomux_sink_streams_total{outcome}``).
``velomux.echo`` does the same and writes every record back to an anchor of the caller's,
so a probe times a round trip on its own clock. ``velomux.sink.info`` says who this node
is (and the certificate it presents), and ``velomux.sink.report`` what it counted per
stream of a probe's run. Every bound is counted: open streams, runs waiting for their
report, streams counted per run and in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from velomux_quic import (
    ConfigurationError,
    Context,
    InstanceId,
    Node,
    SendError,
    StreamAnchorHandle,
    StreamCancelled,
    StreamError,
    StreamOpenTicket,
    StreamSender,
    TicketError,
    VelomuxError,
)
from velomux_quic.security import certificates_pem

__all__ = [
    "ECHO_HANDLER",
    "INFO_HANDLER",
    "REPORT_HANDLER",
    "SINK_HANDLER",
    "Sink",
]

SINK_HANDLER = "velomux.sink"
"""The handler a producer calls to get an anchor of this node to stream into."""

ECHO_HANDLER = "velomux.echo"
"""The handler a probe calls to get an anchor whose records this node streams back to an
anchor of the probe's (a round trip timed on the probe's one clock)."""

REPORT_HANDLER = "velomux.sink.report"
"""The handler a probe calls at the end of a run for what this node counted per stream."""

INFO_HANDLER = "velomux.sink.info"
"""The handler a probe calls first: this node's name, certificate and settings."""

MAX_SINK_STREAMS = 65_536
"""Sink streams open at once at most: past it a call is refused (its caller reads
HandlerFailed), so a producer that never finishes cannot make the node grow without end."""

MAX_REPORTED_RUNS = 1024
"""Runs whose per-stream counts wait for their ``velomux.sink.report`` call at most; past
it the oldest run's counts are forgotten (its report then says nothing of those streams)."""

MAX_RUN_STREAMS = 4096
"""Stream indexes of one run the sink counts (a probe opens at most 1,024)."""

MAX_COUNTED_STREAMS = 65_536
"""Stream counts kept for reports across all runs at most (the oldest runs go first)."""

MAX_RUN_ID_LENGTH = 64

ECHO_ATTACH_TIMEOUT = 30.0
"""Seconds an echo stream's anchor waits for its caller's sender before it ends (and its
route back is released)."""

ECHO_RETIRE_TIMEOUT = 30.0
"""Seconds an ended echo stream's last records get to leave before its route is released."""


@dataclass(slots=True)
class _StreamCount:
    """What the sink read from one stream of a probe's run, for its report."""

    records: int = 0
    bytes: int = 0
    checksum: int = 0
    """CRC-32 of every record's bytes, chained in arrival order (``zlib.crc32``)."""
    outcome: str = "open"

    def add(self, item: object) -> None:
        data = item if isinstance(item, bytes) else repr(item).encode()
        self.records += 1
        self.bytes += len(data)
        self.checksum = zlib.crc32(data, self.checksum)

    def as_json(self) -> dict[str, object]:
        return {
            "records": self.records,
            "bytes": self.bytes,
            "checksum": self.checksum,
            "outcome": self.outcome,
        }


def _request(ctx: Context) -> dict[str, Any]:
    """A probe's JSON request object; ConfigurationError (the caller's HandlerFailed) else."""
    try:
        request = json.loads(bytes(ctx.payload))
    except (UnicodeDecodeError, ValueError):
        raise ConfigurationError(f"{ctx.handler}: the payload must be a JSON object") from None
    if not isinstance(request, dict):
        raise ConfigurationError(f"{ctx.handler}: the payload must be a JSON object")
    return request


def _reply_address(value: object) -> tuple[str, int] | None:
    """A caller's ``host:port``; None when absent or a wildcard (use its source address)."""
    if not isinstance(value, str):
        return None
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"velomux.echo: reply_to must be host:port, got {value!r}")
    if host in ("", "0.0.0.0", "::"):
        return None
    return host, int(port)


def _run_key(ctx: Context, request: dict[str, Any]) -> tuple[str, str]:
    run = request.get("run")
    if not isinstance(run, str) or not 0 < len(run) <= MAX_RUN_ID_LENGTH:
        raise ConfigurationError(
            f"{ctx.handler}: run must be a string of 1 to {MAX_RUN_ID_LENGTH} characters"
        )
    return str(ctx.sender), run


class Sink:
    """The streams producers opened into this node: read to the end and counted.

    A stream opened through ``velomux.sink`` is only read; one opened through
    ``velomux.echo`` is also written back, record by record, to an anchor of the caller's.
    A request that names a ``run`` and a ``stream`` index has that stream's count kept
    for the caller's ``velomux.sink.report`` (at most :data:`MAX_REPORTED_RUNS` runs).
    """

    def __init__(self, node: Node, emit: Callable[..., None]) -> None:
        self.node = node
        self.emit = emit
        """Where a stream's end is told: ``emit("stream_end", peer=..., ...)``."""
        self.mux = node.snapshot().mux is not None
        """Whether this node runs the mux (the probe's info says so)."""
        self.tasks: set[asyncio.Task[None]] = set()
        self.routes: dict[InstanceId, int] = {}
        """Callers added as peers for their echo streams, with the streams still open."""
        self.runs: OrderedDict[tuple[str, str], dict[int, _StreamCount]] = OrderedDict()
        self.records = Counter(
            "velomux_sink_records",
            "Records the sink of `velomux node` received",
            registry=node.registry,
        )
        self.echoed = Counter(
            "velomux_sink_echoed_records",
            "Records the sink wrote back to a probe's anchor (velomux.echo streams)",
            registry=node.registry,
        )
        self.streams = Counter(
            "velomux_sink_streams",
            "Sink streams ended, by outcome: complete, cut_by_shutdown (still open when the "
            "node closed), refused, or the error class that ended it",
            ["outcome"],
            registry=node.registry,
        )
        self.open_streams = Gauge(
            "velomux_sink_open_streams", "Sink streams open now", registry=node.registry
        )
        self.open_streams.set_function(lambda: len(self.tasks))

    def register(self) -> None:
        """Serve the sink's handlers on the node: the sink, and the probe's three."""
        self.node.register_handler(SINK_HANDLER, self.handle, dispatch="inline")
        # Opening the stream back awaits the probe's node: a task per request.
        self.node.register_handler(ECHO_HANDLER, self.echo, dispatch="spawn")
        self.node.register_handler(REPORT_HANDLER, self.report, dispatch="inline")
        self.node.register_handler(INFO_HANDLER, self.info, dispatch="inline")

    def info(self, ctx: Context) -> bytes:
        """``velomux.sink.info``: who this node says it is, and the certificate it presents
        (PEM, leaf first), for the caller to check against its trust roots and the
        InstanceId its handshake proved; the mux and lane settings streams will meet.

        The payload may be ``{"reply_to": "host:port"}``: where the caller listens now (see
        :meth:`refresh_route`)."""
        with contextlib.suppress(ConfigurationError):
            self.refresh_route(ctx.sender, _reply_address(_request(ctx).get("reply_to")))
        credentials = self.node.credentials
        record = self.node.record
        return json.dumps(
            {
                "instance_id": str(self.node.instance_id),
                "name": record.name,
                "certificate": certificates_pem(
                    [credentials.certificate, *credentials.chain]
                ).decode(),
                "mux": self.mux,
                "lanes": record.lanes,
            }
        ).encode()

    def refuse_when_full(self) -> None:
        if len(self.tasks) >= MAX_SINK_STREAMS:
            self.streams.labels(outcome="refused").inc()
            raise ConfigurationError(
                f"the sink has {MAX_SINK_STREAMS} streams open; finish some first"
            )

    def counted(self, ctx: Context, request: dict[str, Any]) -> _StreamCount:
        """The count a run's stream keeps for its report (the oldest run goes past the cap)."""
        key = _run_key(ctx, request)
        index = request.get("stream")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ConfigurationError(f"{ctx.handler}: stream must be an integer index")
        if not 0 <= index < MAX_RUN_STREAMS:
            raise ConfigurationError(f"{ctx.handler}: stream must be 0 to {MAX_RUN_STREAMS - 1}")
        streams = self.runs.get(key)
        if streams is None:
            streams = self.runs[key] = {}
        self.runs.move_to_end(key)  # the run streaming now is the last to go
        count = streams[index] = _StreamCount()
        # Runs whose report never came (a probe killed mid-run) go, oldest first.
        while len(self.runs) > 1 and (
            len(self.runs) > MAX_REPORTED_RUNS
            or sum(map(len, self.runs.values())) > MAX_COUNTED_STREAMS
        ):
            self.runs.popitem(last=False)
        return count

    def anchor_reply(
        self,
        ctx: Context,
        count: _StreamCount,
        back: tuple[InstanceId, StreamSender] | None,
        *,
        prebind: bool = True,
    ) -> bytes:
        """Create the anchor the caller streams into; answer its handle and ticket."""
        if back is None:
            anchor = self.node.create_anchor()
        else:  # an echo stream holds a route back: it must not wait for a sender forever
            anchor = self.node.create_anchor(unattached_timeout=ECHO_ATTACH_TIMEOUT)
        ticket: str | None = None
        if prebind:
            with contextlib.suppress(TicketError):
                ticket = self.node.prebind_anchor(anchor.handle).encode().hex()
        task = asyncio.get_running_loop().create_task(
            self.read(anchor, str(ctx.sender), count, back)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return json.dumps({"handle": anchor.handle.value, "ticket": ticket}).encode()

    def handle(self, ctx: Context) -> bytes:
        """``velomux.sink``: any payload; a JSON object with ``run`` and ``stream`` has the
        stream counted for the report."""
        self.refuse_when_full()
        count = _StreamCount()
        try:
            request = json.loads(bytes(ctx.payload))
        except (UnicodeDecodeError, ValueError):
            request = None
        if isinstance(request, dict) and "run" in request:
            count = self.counted(ctx, request)
        return self.anchor_reply(ctx, count, None)

    async def echo(self, ctx: Context) -> bytes:
        """``velomux.echo``: ``{"run", "stream", "handle", "ticket", "reply_to"}`` names
        the caller's anchor, its zero-RTT ticket (null without a mux) and where the caller
        listens (``host:port``); the answer names this node's anchor, and every record read
        from it is sent on to the caller's."""
        self.refuse_when_full()
        request = _request(ctx)
        handle, ticket = request.get("handle"), request.get("ticket")
        if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
            raise ConfigurationError(f"{ctx.handler}: handle must be the caller's anchor handle")
        if ticket is not None and not isinstance(ticket, str):
            raise ConfigurationError(f"{ctx.handler}: ticket must be hex or null")
        count = self.counted(ctx, request)
        try:
            self.hold_route(ctx.sender, _reply_address(request.get("reply_to")))
        except ConfigurationError:
            count.outcome = "echo_no_route"
            self.streams.labels(outcome=count.outcome).inc()
            raise
        try:
            echo_to = await self.open_back(StreamAnchorHandle(handle), ticket)
        except (VelomuxError, ValueError) as error:
            self.release_route(ctx.sender)
            count.outcome = f"echo_{type(error).__name__}"
            self.streams.labels(outcome=count.outcome).inc()
            raise
        try:
            # A caller without a mux (no ticket) attaches on its per-stream path: a mux
            # pre-bind would refuse it.
            return self.anchor_reply(ctx, count, (ctx.sender, echo_to), prebind=ticket is not None)
        except BaseException:
            await echo_to.aclose()
            self.release_route(ctx.sender)
            raise

    def hold_route(self, peer: InstanceId, reply_to: tuple[str, int] | None) -> None:
        """Make ``peer`` a known peer while an echo stream goes back to it.

        A stream handle names its node by WorkerId, which only known peers resolve. A
        caller this node was not configured with is added at the address it says it
        listens on (or, for a wildcard, where its verified connection came from: one UDP
        socket per node both dials and listens), and removed again when its last echo
        stream has ended, so no registered address outlives a probe that restarts
        elsewhere. A caller that comes back from another address while streams of its
        old run linger replaces them: its old connection is cut and the address updated.
        """
        known = self.node.peers.get(peer)
        if known is not None and peer not in self.routes:
            return  # configured or discovered: not ours to add or remove
        address = reply_to or self.node.peer_address(peer)
        if address is None:
            raise ConfigurationError(f"no route back to {peer}: add it as a peer")
        if known is None:
            self.node.add_peer(peer, address)
        else:
            self.refresh_route(peer, address)
        self.routes[peer] = self.routes.get(peer, 0) + 1

    def refresh_route(self, peer: InstanceId, address: tuple[str, int] | None) -> None:
        """A caller this node added comes from another address than it was added at: it
        restarted while streams of its old run linger (until their watchdogs). Adding it
        at the new address cuts the connection to the old one, so replies reach it now."""
        known = self.node.peers.get(peer)
        if peer not in self.routes or known is None or address in (None, known.address):
            return
        assert address is not None
        self.node.add_peer(peer, address)

    def release_route(self, peer: InstanceId) -> None:
        if peer not in self.routes:
            return
        self.routes[peer] -= 1
        if self.routes[peer] == 0:
            del self.routes[peer]
            self.node.remove_peer(peer)

    async def open_back(self, handle: StreamAnchorHandle, ticket: str | None) -> StreamSender:
        """The stream back to the caller's anchor: from its ticket, or by attaching."""
        if ticket is None:
            return await self.node.attach_anchor(handle)
        return await self.node.open_anchor_stream(
            handle, StreamOpenTicket.decode(bytes.fromhex(ticket))
        )

    def report(self, ctx: Context) -> bytes:
        """``velomux.sink.report``: ``{"run"}`` returns (and forgets) that run's counts,
        ``{"streams": {"<index>": {"records", "bytes", "checksum", "outcome"}}}``."""
        streams = self.runs.pop(_run_key(ctx, _request(ctx)), {})
        return json.dumps(
            {"streams": {str(index): count.as_json() for index, count in streams.items()}}
        ).encode()

    async def read(
        self,
        anchor: Any,
        peer: str,
        count: _StreamCount,
        back: tuple[InstanceId, StreamSender] | None,
    ) -> None:
        outcome = "complete"
        echo_to = None if back is None else back[1]
        try:
            async for item in anchor:
                count.add(item)
                self.records.inc()
                if echo_to is not None:
                    await echo_to.send(item)
                    self.echoed.inc()
        except StreamCancelled:
            outcome = "cut_by_shutdown"  # still open when this node closed
        except (StreamError, SendError) as error:
            outcome = type(error).__name__  # a SendError: the way back failed
        # Counted before the way back ends, so a report asked once it ended sees it.
        count.outcome = outcome
        if back is not None:
            if outcome == "complete":
                echo_to = back[1]
                echo_to.finalize()
                # Its last records on the wire before the route back may go.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(echo_to.retired(), ECHO_RETIRE_TIMEOUT)
            else:
                await back[1].aclose()
            self.release_route(back[0])
        self.streams.labels(outcome=outcome).inc()
        self.emit("stream_end", peer=peer, records=count.records, outcome=outcome)
