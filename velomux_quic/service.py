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

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any

from prometheus_client import Counter, Gauge

from .config import NodeConfig
from .errors import (
    ConfigurationError,
    StreamCancelled,
    StreamError,
    TicketError,
    VelomuxError,
)
from .messenger.registry import Context
from .node import Node
from .runtime import run

__all__ = ["SINK_HANDLER", "add_node_commands", "format_event"]

SINK_HANDLER = "velomux.sink"
"""The handler a producer calls to get an anchor of this node to stream into."""

MAX_SINK_STREAMS = 65_536
"""Sink streams open at once at most: past it a call is refused (its caller reads
HandlerFailed), so a producer that never finishes cannot make the node grow without end."""

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


class _Sink:
    """The streams producers opened into this node: read to the end and counted."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.tasks: set[asyncio.Task[None]] = set()
        self.records = Counter(
            "velomux_sink_records",
            "Records the sink of `velomux node` received",
            registry=node.registry,
        )
        self.streams = Counter(
            "velomux_sink_streams",
            "Sink streams ended, by outcome: complete, cut_by_shutdown (still open when the "
            "node closed), refused, or the StreamError that ended it",
            ["outcome"],
            registry=node.registry,
        )
        self.open_streams = Gauge(
            "velomux_sink_open_streams", "Sink streams open now", registry=node.registry
        )
        self.open_streams.set_function(lambda: len(self.tasks))

    def handle(self, ctx: Context) -> bytes:
        if len(self.tasks) >= MAX_SINK_STREAMS:
            self.streams.labels(outcome="refused").inc()
            raise ConfigurationError(
                f"the sink has {MAX_SINK_STREAMS} streams open; finish some first"
            )
        anchor = self.node.create_anchor()
        try:
            ticket: str | None = self.node.prebind_anchor(anchor.handle).encode().hex()
        except TicketError:
            ticket = None
        task = asyncio.get_running_loop().create_task(self.read(anchor, str(ctx.sender)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return json.dumps({"handle": anchor.handle.value, "ticket": ticket}).encode()

    async def read(self, anchor: Any, peer: str) -> None:
        records = 0
        outcome = "complete"
        try:
            async for _item in anchor:
                records += 1
                self.records.inc()
        except StreamCancelled:
            outcome = "cut_by_shutdown"  # still open when this node closed
        except StreamError as error:
            outcome = type(error).__name__
        self.streams.labels(outcome=outcome).inc()
        _emit("stream_end", peer=peer, records=records, outcome=outcome)


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
    except ConfigurationError as error:
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
        node.register_handler(SINK_HANDLER, sink.handle, dispatch="inline")
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
        await stop.wait()
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
    except VelomuxError as error:
        print(f"velomux node: {error}", file=sys.stderr)
        return 1


def add_node_commands(commands: Any) -> None:
    """Add ``velomux node`` to the command's subparsers."""
    parser = commands.add_parser(
        "node",
        help="run one node as a service, from a TOML configuration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the node's TOML file (see node.toml)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds open streams get to finish on SIGTERM/SIGINT before the node closes",
    )
    parser.add_argument(
        "--ops",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where /metrics, /healthz and /readyz listen (127.0.0.1:0, any free port: the "
        "'listening' line says which); 'off' to serve none",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    parser.set_defaults(handler=node_main)
