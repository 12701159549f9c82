"""``velomux node --config node.toml``: one node run as a service, the sink of a probe.

The node starts from a :class:`~velomux_quic.NodeConfig` and serves the probe's handlers
(:mod:`.sink`: ``velomux.sink`` hands a producer an anchor of this node to stream into,
and counts what arrives in ``velomux_sink_records_total`` and
``velomux_sink_streams_total{outcome}``), so an operator or a probe can see what arrived.

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
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .. import (
    ConfigurationError,
    InstanceId,
    Node,
    NodeConfig,
    PeerRecord,
    VelomuxError,
)
from ..node import warn_unknown_variables
from .example_config import EXAMPLE_CONFIG
from .runtime import quiet_engine_loggers, run, show_deprecated_settings
from .sink import Sink

__all__ = ["add_node_commands", "format_event"]

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


def _report_peers(node: Node) -> Callable[[], None]:
    """One event line per peer the node knows now (``peer_joined``), then one per change:
    ``peer_joined``, ``peer_moved`` (at a new address) or ``peer_left``, as discovery or
    the configuration says; a record refreshed in place says nothing. Returns the call
    that stops it."""
    registry = node.peers
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
        ops_host, ops_port = ops_address_of(ops)
        try:
            bound = await node.serve_ops(ops_host, ops_port)
        except ConfigurationError as error:
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
        sink = Sink(node, _emit)
        sink.register()
        host, port = node.address
        _emit(
            "listening",
            instance=node.instance_id,
            worker=node.worker_id,
            address=f"{host}:{port}",
            name=node.record.name,
            lanes=config.transport.lanes,
            mux=sink.mux,
            peers=len(config.peers),
            ops=ops_address or "off",
            engine=node.build_info["engine"],
            record_path=node.build_info["record_path"],
            version=node.build_info["version"],
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


def ops_address_of(text: str) -> tuple[str, int]:
    """``--ops HOST:PORT`` (or ``:PORT``, the host 127.0.0.1) as an address; an
    argparse type, so a malformed one is a usage error naming the form."""
    host, colon, port = text.rpartition(":")
    if text == "off":
        return "off", 0
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT with a port 0 to 65535: write e.g. --ops "
            "127.0.0.1:9100 (port 0: any free port), or --ops off"
        )
    return host.strip("[]") or "127.0.0.1", int(port)


def _ops_option(text: str) -> str:
    ops_address_of(text)  # refused at parse time, with exit 2 and the form to use
    return text


def node_main(args: argparse.Namespace) -> int:
    """``velomux node``: load the configuration (exit 2 on a bad one), then serve."""
    if args.example_config:
        sys.stdout.write(EXAMPLE_CONFIG)
        return 0
    if args.config is None:
        print(
            "velomux node: --config TOML is required: 'velomux node --example-config > "
            "node.toml' writes a commented one to start from",
            file=sys.stderr,
        )
        return EXIT_BAD_CONFIG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter())
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), handlers=[handler])
    quiet_engine_loggers(debug=args.log_level == "debug")
    show_deprecated_settings()
    warn_unknown_variables()
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
Run one node as a service, from a TOML configuration: 'velomux node --example-config
> node.toml' writes one listing every key at its default, commented. Besides the
application's traffic it serves the probe: its velomux.sink handler hands a producer a
fresh anchor (and a zero-RTT ticket when the mux runs) and counts what arrives in
velomux_sink_records_total and velomux_sink_streams_total.

Every event is one key=value line on standard output, flushed at once; library log
records go to standard error in the same form (the QUIC engine's own only at
--log-level debug, or its errors). The 'listening' line names the QUIC engine and the
record path. SIGTERM or SIGINT drains the open streams for --drain-timeout seconds,
closes the node and exits 0. SIGHUP reads the credentials directory again (renewed
certificate, new trust roots) for new connections and prints credentials_reloaded or
credentials_reload_failed. A node does not start on an expired or not yet valid
certificate. A bad configuration exits 2 with one line saying what is wrong and where.
"""


def add_node_commands(commands: Any) -> None:
    """Add ``velomux node`` to the command's subparsers."""
    parser = commands.add_parser(
        "node",
        help="run one node as a service, from a TOML configuration",
        description=DESCRIPTION,
    )
    parser.add_argument("--config", metavar="TOML", help="the node's configuration file")
    parser.add_argument(
        "--example-config",
        action="store_true",
        help="print a commented configuration listing every key at its default, and exit",
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
        type=_ops_option,
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
