"""``velomux node --config node.toml``: one node run as a service, the sink of a probe.

The node starts from a :class:`~velomux_quic.NodeConfig` and registers the handler
``velomux.sink``: a producer calls it (any payload) and gets back, as JSON, the handle
of a fresh anchor on this node and, when the mux runs, a zero-RTT ticket for it
(``{"handle": <int>, "ticket": <hex> | null}``); it then streams into that anchor. The
node reads every such stream to its end and counts records and streams in its metrics
(``velomux_sink_records_total``, ``velomux_sink_streams_total{outcome}``), so an
operator or a probe can see what arrived.

Every event is one line on standard output in ``key=value`` form (values with spaces
quoted), flushed at once, so a supervisor or a test reads it as it happens; library log
records go to standard error in the same form. SIGTERM or SIGINT stops it cleanly:
its streams (the sink's inbound ones and any it produces) get ``drain_timeout`` seconds
to finish, then the node closes (what is still open ends with the chapter's shutdown
terminal; a sink stream cut this way is counted as ``cut_by_shutdown``) and the process
exits 0. A bad
configuration exits 2 with one line saying what is wrong and where. SIGHUP reads the
configured credentials directory again (a renewed certificate, new trust roots) for new
connections, printing ``credentials_reloaded`` or ``credentials_reload_failed``; a bad
set leaves the running credentials in place and the node running.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import serialization
from prometheus_client import Counter, Gauge

from .config import NodeConfig
from .errors import (
    ConfigurationError,
    SendError,
    StreamCancelled,
    StreamError,
    TicketError,
    VelomuxError,
)
from .ids import InstanceId, StreamAnchorHandle
from .messenger.peers import PeerRecord
from .messenger.registry import Context
from .node import Node
from .runtime import run
from .streaming.control import StreamOpenTicket
from .streaming.sender import StreamSender

__all__ = [
    "ECHO_HANDLER",
    "INFO_HANDLER",
    "REPORT_HANDLER",
    "SINK_HANDLER",
    "add_node_commands",
    "format_event",
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

EXIT_BAD_CONFIG = 2


def format_event(event: str, **fields: object) -> str:
    """One structured line: ``ts=... event=... key=value ...`` (values quoted if needed)."""
    parts = [f"ts={time.time():.3f}", f"event={event}"]
    for key, value in fields.items():
        text = str(value)
        if not text or any(ch in text for ch in ' "=\n'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _emit(event: str, **fields: object) -> None:
    sys.stdout.write(format_event(event, **fields) + "\n")
    sys.stdout.flush()


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return format_event(
            "log",
            level=record.levelname.lower(),
            logger=record.name,
            message=record.getMessage(),
        )


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


class _Sink:
    """The streams producers opened into this node: read to the end and counted.

    A stream opened through ``velomux.sink`` is only read; one opened through
    ``velomux.echo`` is also written back, record by record, to an anchor of the caller's.
    A request that names a ``run`` and a ``stream`` index has that stream's count kept
    for the caller's ``velomux.sink.report`` (at most :data:`MAX_REPORTED_RUNS` runs).
    """

    def __init__(self, node: Node) -> None:
        self.node = node
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
        credentials = self.node.messenger.transport.credentials
        pem = b"".join(
            certificate.public_bytes(serialization.Encoding.PEM)
            for certificate in (credentials.certificate, *credentials.chain)
        )
        return json.dumps(
            {
                "instance_id": str(self.node.instance_id),
                "name": self.node.record.name,
                "certificate": pem.decode(),
                "mux": self.node.mux is not None,
                "lanes": self.node.messenger.transport.config.lanes,
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
        known = self.node.messenger.peers.get(peer)
        if known is not None and peer not in self.routes:
            return  # configured or discovered: not ours to add or remove
        address = reply_to or self.node.messenger.transport.peer_address(peer)
        if address is None:
            raise ConfigurationError(f"no route back to {peer}: add it as a peer")
        if known is None:
            self.node.add_peer(peer, address)
        else:
            self.refresh_route(peer, address)
        self.routes[peer] = self.routes.get(peer, 0) + 1

    def refresh_route(self, peer: InstanceId, address: tuple[str, int] | None) -> None:
        """A caller this node added comes from another address than it was added at: it
        restarted while streams of its old run linger (until their watchdogs). Cut the
        connection to the old address and dial the new one, so replies reach it now."""
        known = self.node.messenger.peers.get(peer)
        if peer not in self.routes or known is None or address in (None, known.address):
            return
        assert address is not None
        self.node.messenger.transport.disconnect(peer, inbound=False)
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
        _emit("stream_end", peer=peer, records=count.records, outcome=outcome)


def _report_peers(node: Node) -> Callable[[], None]:
    """One event line per peer the node knows now (``peer_joined``), then one per change:
    ``peer_joined``, ``peer_moved`` (at a new address) or ``peer_left``, as discovery or
    the configuration says; a record refreshed in place says nothing. Returns the call
    that stops it."""
    registry = node.messenger.peers
    known: dict[InstanceId, tuple[str, int]] = {}

    def report(record: PeerRecord, event: str) -> None:
        known[record.instance_id] = record.address
        host, port = record.address
        _emit(event, instance=record.instance_id, name=record.name, address=f"{host}:{port}")

    for record in registry:
        report(record, "peer_joined")

    def changed(record: PeerRecord | None, instance_id: InstanceId) -> None:
        if record is None:
            if known.pop(instance_id, None) is not None:
                _emit("peer_left", instance=instance_id)
        elif instance_id not in known:
            report(record, "peer_joined")
        elif known[instance_id] != record.address:
            report(record, "peer_moved")

    return registry.subscribe(changed)


def _reload_credentials(node: Node) -> None:
    """SIGHUP: read the configured credentials directory again; a bad set changes nothing."""
    try:
        summary = node.reload_credentials()
    except VelomuxError as error:
        _emit("credentials_reload_failed", reason=str(error))
        return
    _emit(
        "credentials_reloaded",
        serial=summary.serial,
        not_after=summary.not_after.strftime("%Y-%m-%dT%H:%M:%SZ"),
        fingerprint=summary.fingerprint,
    )


async def serve(config: NodeConfig, drain_timeout: float, ops: str = "127.0.0.1:0") -> int:
    """Run the node until SIGTERM or SIGINT; returns the exit status.

    ``ops`` is where the HTTP operations endpoints listen (``/metrics``, ``/healthz``,
    ``/readyz``): on by default here, unlike in the library; ``off`` turns them off.
    """
    try:
        node = await Node.start(config)
    except (VelomuxError, OSError) as error:
        print(f"velomux node: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    ops_address = ""
    if ops != "off":
        ops_host, _, ops_port = ops.rpartition(":")
        try:
            bound = await node.serve_ops(ops_host or "127.0.0.1", int(ops_port))
        except (ConfigurationError, ValueError) as error:
            await node.close()
            print(f"velomux node: --ops {ops}: {error}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        ops_address = f"{bound[0]}:{bound[1]}"
    stop = asyncio.Event()
    received: list[str] = []
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):

        def on_signal(signum: signal.Signals = signum) -> None:
            received.append(signum.name)
            stop.set()

        loop.add_signal_handler(signum, on_signal)
    loop.add_signal_handler(signal.SIGHUP, _reload_credentials, node)
    try:
        sink = _Sink(node)
        sink.register()
        host, port = node.address
        _emit(
            "listening",
            instance=node.instance_id,
            worker=node.worker_id,
            address=f"{host}:{port}",
            name=node.record.name,
            lanes=config.transport.lanes,
            mux=node.mux is not None,
            peers=len(config.peers),
            ops=ops_address or "off",
        )
        unsubscribe = _report_peers(node)
        await stop.wait()
        unsubscribe()
        _emit("stopping", signal=received[0], open_streams=len(sink.tasks))
        # Inbound streams get the window to finish as well as this node's own senders.
        drained = await node.drain(drain_timeout)
        if sink.tasks:
            _done, pending = await asyncio.wait(set(sink.tasks), timeout=drain_timeout)
            drained = drained and not pending
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        await node.close()
    if sink.tasks:
        await asyncio.wait(set(sink.tasks), timeout=drain_timeout)
    _emit("stopped", drained=drained)
    return 0


def node_main(args: argparse.Namespace) -> int:
    """``velomux node``: load the configuration (exit 2 on a bad one), then serve."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter())
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), handlers=[handler])
    try:
        config = NodeConfig.from_toml(args.config)
    except ConfigurationError as error:
        print(f"velomux node: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        return run(serve(config, args.drain_timeout, args.ops))
    except (VelomuxError, OSError) as error:
        # Whatever stopped the node from starting or running, in one line (no traceback):
        # every such failure is the configuration's or the machine's, not a crash.
        print(f"velomux node: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG


DESCRIPTION = """\
Run one node as a service, from a TOML configuration (examples/node.toml in the
repository lists every key). Besides the application's traffic it serves the probe:
its velomux.sink handler hands a producer a fresh anchor (and a zero-RTT ticket when
the mux runs) and counts what arrives in velomux_sink_records_total and
velomux_sink_streams_total.

Every event is one key=value line on standard output, flushed at once; library log
records go to standard error in the same form. SIGTERM or SIGINT drains the open
streams for --drain-timeout seconds, closes the node and exits 0. SIGHUP reads the
credentials directory again (renewed certificate, new trust roots) for new
connections and prints credentials_reloaded or credentials_reload_failed. A bad
configuration exits 2 with one line saying what is wrong and where.
"""


def add_node_commands(commands: Any) -> None:
    """Add ``velomux node`` to the command's subparsers."""
    parser = commands.add_parser(
        "node",
        help="run one node as a service, from a TOML configuration",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--config", required=True, metavar="TOML", help="the node's configuration file"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long open streams get to finish on SIGTERM/SIGINT before the node closes",
    )
    parser.add_argument(
        "--ops",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where /metrics, /healthz and /readyz listen (port 0: any free port, which the "
        "'listening' line names); 'off' to serve none",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="the least severe library log record shown on standard error",
    )
    parser.set_defaults(handler=node_main)
