"""``velomux probe PEER --config node.toml``: is the path to a peer trustworthy, and how fast?

The iperf of this project. The probe starts a node of its own from the configuration (its
own credentials; port 0 is fine), proves who the peer is, then opens ``--streams``
streams to it and streams fixed-size records for ``--duration`` seconds (or
``--records`` per stream, at ``--rate`` records/s across all streams when given) through
the peer's ``velomux.echo`` handler: the peer (``velomux node``) reads each stream and
writes every record back to an anchor of the probe's. What it prints:

- **identity**: the InstanceId the peer's certificate proved in the mutual-TLS handshake,
  the trust domain, the certificate's serial, fingerprint and not-after (as the peer
  reports it, checked here against this node's trust roots and that InstanceId), the
  handshake time, and the transport the streams negotiated (the messenger mux or a QUIC
  stream each).
- **throughput**: records/s and bytes/s that reached the peer over the streaming window
  (first send to the last record back), and records per write (data records per mux
  batch this node wrote).
- **latency**: p50/p99 of the round trip probe, peer, probe, timed on the probe's clock
  alone (the send time travels in the record), so no two clocks are compared.
- **delivery**: records sent, counted by the peer (its ``velomux.sink.report``, with a
  CRC-32 per stream) and echoed back; streams completed whole; errors by class.

Exit 0 when every stream completed whole and the identity was verified, 1 when anything
was lost or failed (a refused handshake says why), 2 for a usage or configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import random
import signal
import struct
import sys
import time
import uuid
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography import x509

from .. import (
    MESSENGER_MUX_KEY,
    PER_STREAM_KEY,
    ConfigurationError,
    DialError,
    InstanceId,
    Node,
    NodeConfig,
    PeerVerificationError,
    StreamAnchor,
    StreamAnchorHandle,
    StreamOpenTicket,
    StreamSender,
    TicketError,
    UnaryTimeout,
    UnknownHandler,
    VelomuxError,
)
from ..security import PeerVerifier, spiffe_uris, summarize_certificate
from .runtime import run, show_deprecated_settings
from .sink import ECHO_HANDLER, INFO_HANDLER, REPORT_HANDLER

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "LatencySamples",
    "ProbeOptions",
    "add_probe_commands",
    "probe",
    "render_text",
    "resolve_peer",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

MAX_STREAMS = 1024
"""Streams one probe opens at most (each is an anchor and a sender on both nodes)."""
MAX_DURATION = 300.0
"""Seconds of streaming at most."""
MAX_RECORDS_PER_STREAM = 10_000_000
MIN_PAYLOAD_BYTES = 16
"""A record carries its stream's sequence number and its send time (8 bytes each)."""
MAX_PAYLOAD_BYTES = 1 << 20
MAX_LATENCY_SAMPLES = 100_000
"""Round-trip samples kept (a uniform reservoir past it), so memory stays bounded."""

_HEADER = struct.Struct("<QQ")  # sequence number, perf_counter_ns at send

TRANSPORT_NAMES = {MESSENGER_MUX_KEY: "mux", PER_STREAM_KEY: "per-stream"}
LATENCY_MEASURES = (
    "round trip: the probe's send() of a record to the probe's anchor yielding it back "
    "from the peer (both nodes' batching and the peer's read and re-send included), "
    "timed on the probe's clock alone"
)


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What one probe run does; validated on construction (ConfigurationError)."""

    streams: int = 4
    duration: float | None = 5.0
    """Seconds of streaming; None when ``records`` bounds the run instead."""
    records: int | None = None
    """Records per stream; None when ``duration`` bounds the run."""
    rate: float | None = None
    """Records per second across all streams; None: as fast as credit allows."""
    payload_bytes: int = 64
    timeout: float = 20.0
    """Seconds each step may take beyond the streaming itself (handshake, calls, the
    last records coming back)."""
    peer_id: str | None = None
    """The InstanceId of a peer named by ``host:port``."""

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigurationError(f"--streams must be 1 to {MAX_STREAMS}, got {self.streams}")
        if (self.duration is None) == (self.records is None):
            raise ConfigurationError("give one of --duration and --records")
        if self.duration is not None and not 0 < self.duration <= MAX_DURATION:
            raise ConfigurationError(
                f"--duration must be above 0 and at most {MAX_DURATION:g} s, got {self.duration}"
            )
        if self.records is not None and not 1 <= self.records <= MAX_RECORDS_PER_STREAM:
            raise ConfigurationError(
                f"--records must be 1 to {MAX_RECORDS_PER_STREAM:,} per stream, got {self.records}"
            )
        if self.rate is not None and not 0 < self.rate <= 1e9:
            raise ConfigurationError(f"--rate must be above 0 records/s, got {self.rate}")
        if not MIN_PAYLOAD_BYTES <= self.payload_bytes <= MAX_PAYLOAD_BYTES:
            raise ConfigurationError(
                f"--payload-bytes must be {MIN_PAYLOAD_BYTES} to {MAX_PAYLOAD_BYTES}, "
                f"got {self.payload_bytes}"
            )
        if not 0 < self.timeout <= 600:
            raise ConfigurationError(
                f"--timeout must be above 0 and at most 600 s, got {self.timeout}"
            )


class LatencySamples:
    """Round-trip times in nanoseconds: exact count, min and max; a bounded uniform
    reservoir (Algorithm R) for the percentiles."""

    def __init__(self, capacity: int = MAX_LATENCY_SAMPLES) -> None:
        self.capacity = capacity
        self.samples: list[int] = []
        self.count = 0
        self.low: int | None = None
        self.high: int | None = None
        self._random = random.Random(0x5EED)

    def add(self, nanoseconds: int) -> None:
        self.count += 1
        if self.low is None or nanoseconds < self.low:
            self.low = nanoseconds
        if self.high is None or nanoseconds > self.high:
            self.high = nanoseconds
        if len(self.samples) < self.capacity:
            self.samples.append(nanoseconds)
        else:
            slot = self._random.randrange(self.count)
            if slot < self.capacity:
                self.samples[slot] = nanoseconds

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.samples)

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6

        return {
            "measures": LATENCY_MEASURES,
            "samples": self.count,
            "p50_ms": quantile(0.50),
            "p99_ms": quantile(0.99),
            "min_ms": None if self.low is None else self.low / 1e6,
            "max_ms": None if self.high is None else self.high / 1e6,
        }


@dataclass(slots=True)
class StreamResult:
    """One stream of the run, as both ends saw it."""

    index: int
    transport: str | None = None
    lane: int | None = None
    sent: int = 0
    sent_checksum: int = 0
    received_by_peer: int | None = None
    peer_checksum: int | None = None
    peer_outcome: str | None = None
    echoed: int = 0
    echo_checksum: int = 0
    out_of_order: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whole: no error, and the peer and the echo both hold exactly what was sent."""
        return (
            not self.errors
            and self.peer_outcome == "complete"
            and self.received_by_peer == self.sent == self.echoed
            and self.peer_checksum == self.sent_checksum == self.echo_checksum
            and self.out_of_order == 0
        )


class _Run:
    """The streams of one probe: set up, streamed, read back, reconciled."""

    def __init__(self, node: Node, peer: InstanceId, options: ProbeOptions) -> None:
        self.node = node
        self.mux = node.snapshot().mux is not None
        self.peer = peer
        self.options = options
        self.run_id = uuid.uuid4().hex
        self.results = [StreamResult(index) for index in range(options.streams)]
        self.latency = LatencySamples()
        self.stop = asyncio.Event()
        self.start = asyncio.Event()
        self.started_at = 0.0
        self.last_back_at = 0.0
        self.last_sent_at = 0.0
        self.error_messages: dict[str, str] = {}
        pattern = bytes(range(256)) * (options.payload_bytes // 256 + 1)
        self.pad = pattern[: options.payload_bytes - _HEADER.size]

    def fail(self, result: StreamResult, reason: str, error: BaseException | None = None) -> None:
        """Count one error of a stream by reason; the first message of each reason is kept."""
        result.errors.append(reason)
        if error is not None and str(error):
            self.error_messages.setdefault(reason, str(error))

    async def open(self, result: StreamResult) -> tuple[StreamSender, StreamAnchor[Any]] | None:
        """The stream to the peer and the anchor its records come back to."""
        node, timeout = self.node, self.options.timeout
        back = node.create_anchor(unattached_timeout=timeout)
        try:
            ticket: str | None = node.prebind_anchor(back.handle).encode().hex()
        except TicketError:
            ticket = None
        request = {
            "run": self.run_id,
            "stream": result.index,
            "handle": back.handle.value,
            "reply_to": _listening(node),
        }
        try:
            answer = json.loads(
                await node.call(
                    self.peer,
                    ECHO_HANDLER,
                    json.dumps({**request, "ticket": ticket}).encode(),
                    timeout=timeout,
                )
            )
            handle = StreamAnchorHandle(answer["handle"])
            async with asyncio.timeout(timeout):
                if answer.get("ticket") and self.mux:
                    sender = await node.open_anchor_stream(
                        handle, StreamOpenTicket.decode(bytes.fromhex(answer["ticket"]))
                    )
                else:
                    sender = await node.attach_anchor(handle)
        except (VelomuxError, TimeoutError, ValueError, KeyError, TypeError) as error:
            self.fail(result, f"open:{type(error).__name__}", error)
            back.cancel()
            return None
        key = sender.negotiated_transport()
        result.transport = TRANSPORT_NAMES.get(key or "", key)
        result.lane = sender.lane
        return sender, back

    async def write(self, result: StreamResult, sender: StreamSender) -> None:
        options, loop = self.options, asyncio.get_running_loop()
        await self.start.wait()
        deadline = None if options.duration is None else self.started_at + options.duration
        limit = options.records
        interval = None if options.rate is None else options.streams / options.rate
        due = self.started_at + random.random() * (interval or 0.0)
        pack, pad, clock = _HEADER.pack, self.pad, time.perf_counter_ns
        seq, checksum = 0, 0
        try:
            while not self.stop.is_set():
                if limit is not None and seq >= limit:
                    break
                if deadline is not None and loop.time() >= deadline:
                    break
                if interval is not None:
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)  # pacing to --rate, not synchronisation
                    due += interval
                record = pack(seq, clock()) + pad
                await sender.send(record)
                checksum = zlib.crc32(record, checksum)
                seq += 1
        except VelomuxError as error:
            self.fail(result, f"send:{type(error).__name__}", error)
            await sender.aclose()
            return
        finally:
            result.sent, result.sent_checksum = seq, checksum
            self.last_sent_at = max(self.last_sent_at, loop.time())
        await sender.finalize()

    async def read_back(self, result: StreamResult, back: StreamAnchor[Any]) -> None:
        clock, unpack, latency = time.perf_counter_ns, _HEADER.unpack_from, self.latency
        expected, checksum, count = 0, 0, 0
        try:
            async for item in back:
                now = clock()
                seq, sent_at = unpack(item)
                latency.add(now - sent_at)
                if seq != expected:
                    result.out_of_order += 1
                expected = seq + 1
                checksum = zlib.crc32(item, checksum)
                count += 1
        except (VelomuxError, struct.error, TypeError) as error:
            self.fail(result, f"echo:{type(error).__name__}", error)
        finally:
            result.echoed, result.echo_checksum = count, checksum
            self.last_back_at = max(self.last_back_at, asyncio.get_running_loop().time())

    async def stream(self) -> None:
        """Open every stream, start them together, wait for every record to come back."""
        opened = await asyncio.gather(*(self.open(result) for result in self.results))
        tasks: list[asyncio.Task[None]] = []
        for result, pair in zip(self.results, opened, strict=True):
            if pair is not None:
                sender, back = pair
                tasks.append(asyncio.create_task(self.write(result, sender)))
                tasks.append(asyncio.create_task(self.read_back(result, back)))
        loop = asyncio.get_running_loop()
        self.started_at = self.last_back_at = self.last_sent_at = loop.time()
        self.start.set()
        if not tasks:
            return
        bound = self.options.timeout + (self.options.duration or MAX_DURATION)
        _done, pending = await asyncio.wait(tasks, timeout=bound)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            for result in self.results:
                if not result.complete and not result.errors:
                    result.errors.append("timeout")

    async def reconcile(self) -> None:
        """Ask the peer what it counted per stream (``velomux.sink.report``)."""
        try:
            answer = json.loads(
                await self.node.call(
                    self.peer,
                    REPORT_HANDLER,
                    json.dumps({"run": self.run_id}).encode(),
                    timeout=self.options.timeout,
                )
            )
            streams = answer["streams"]
        except (VelomuxError, ValueError, KeyError, TypeError) as error:
            for result in self.results:
                self.fail(result, f"report:{type(error).__name__}", error)
            return
        for result in self.results:
            counted = streams.get(str(result.index))
            if counted is None:
                if not result.errors:
                    result.errors.append("report:stream_unknown_to_peer")
                continue
            result.received_by_peer = counted.get("records")
            result.peer_checksum = counted.get("checksum")
            result.peer_outcome = counted.get("outcome")
            if result.peer_outcome not in ("complete", None):
                result.errors.append(f"peer:{result.peer_outcome}")

    def summary(self, batches_sent: float | None, data_sent: float | None) -> dict[str, Any]:
        window = max(self.last_back_at - self.started_at, 1e-9)
        reached = sum(min(r.sent, r.received_by_peer or 0) for r in self.results)
        sent = sum(r.sent for r in self.results)
        transports = Counter(r.transport for r in self.results if r.transport is not None)
        errors = Counter(error for r in self.results for error in r.errors)
        lost = sum(max(0, r.sent - (r.received_by_peer or 0)) for r in self.results)
        echo_lost = sum(max(0, r.sent - r.echoed) for r in self.results)
        per_write = None
        if batches_sent and data_sent is not None:
            per_write = data_sent / batches_sent
        return {
            "transport": {
                "negotiated": "/".join(sorted(transports)) or None,
                "streams_by_transport": dict(transports),
            },
            "throughput": {
                "window_seconds": window,
                "send_seconds": self.last_sent_at - self.started_at,
                "records": reached,
                "bytes": reached * self.options.payload_bytes,
                "records_per_second": reached / window,
                "bytes_per_second": reached * self.options.payload_bytes / window,
                "records_per_write": per_write,
                "batches_sent": batches_sent,
            },
            "latency": self.latency.summary(),
            "delivery": {
                "streams": len(self.results),
                "streams_completed": sum(r.complete for r in self.results),
                "records_sent": sent,
                "records_received_by_peer": sum(r.received_by_peer or 0 for r in self.results),
                "records_echoed": sum(r.echoed for r in self.results),
                "records_lost": lost,
                "records_lost_on_the_way_back": echo_lost,
                "checksum_mismatches": sum(
                    r.received_by_peer is not None
                    and not r.peer_checksum == r.sent_checksum == r.echo_checksum
                    for r in self.results
                ),
                "out_of_order": sum(r.out_of_order for r in self.results),
            },
            "errors": dict(errors),
            "error_messages": {k: v for k, v in self.error_messages.items() if k in errors},
            "streams": [{**asdict(r), "complete": r.complete} for r in self.results],
        }


def _listening(node: Node) -> str:
    """Where this node listens, as ``host:port`` (a peer's way back to it)."""
    host, port = node.address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _mux_sent(node: Node, mux: bool) -> tuple[float | None, float | None]:
    """(batches, data records) this node's mux has written, None without a mux."""
    if not mux:
        return None, None
    batches = node.registry.get_sample_value(
        "velo_streaming_mux_batches_total", {"direction": "sent"}
    )
    data = node.registry.get_sample_value(
        "velo_streaming_mux_records_sent_total", {"record_type": "data"}
    )
    return batches, data


async def resolve_peer(node: Node, spec: str, peer_id: str | None) -> InstanceId:
    """The InstanceId PEER names: an InstanceId, a peer's name, or ``host:port``.

    ConfigurationError (exit 2) when it names no peer this node knows or can find.
    """
    records = node.snapshot().peers
    if peer_id is not None:
        try:
            wanted: InstanceId | None = InstanceId.parse(peer_id)
        except (ValueError, TypeError):
            raise ConfigurationError(
                f"--peer-id {peer_id!r} is not an InstanceId (a UUID)"
            ) from None
    else:
        wanted = None
    host, sep, port = spec.rpartition(":")
    if sep and port.isdigit() and host:
        address = (host.strip("[]"), int(port))
        if wanted is None:
            matches = [r.instance_id for r in records if r.address == address]
            if not matches:
                raise ConfigurationError(
                    f"no known peer listens at {spec}; give its InstanceId with --peer-id"
                )
            return matches[0]
        node.add_peer(wanted, address)
        return wanted
    try:
        instance = InstanceId.parse(spec)
    except (ValueError, TypeError):
        named = [r.instance_id for r in records if r.name == spec]
        if len(named) == 1:
            return named[0]
        names = ", ".join(sorted({r.name for r in records if r.name})) or "none"
        if named:
            raise ConfigurationError(
                f"peer name {spec!r} is ambiguous; give its InstanceId"
            ) from None
        raise ConfigurationError(
            f"unknown peer {spec!r}: not a name of the configuration's [[peers]] or of a "
            f"discovered record (known names: {names}), nor an InstanceId or host:port"
        ) from None
    if wanted is not None and wanted != instance:
        raise ConfigurationError(f"PEER {spec} and --peer-id {peer_id} disagree")
    if not await node.resolve_peer(instance):
        raise ConfigurationError(
            f"unknown peer {instance}: neither a [[peers]] entry nor discovery knows its "
            "address; add one, or give host:port with --peer-id"
        )
    return instance


def _certificate_facts(
    node: Node, peer: InstanceId, info: dict[str, Any], presented_serial: str | None
) -> dict[str, Any]:
    """The certificate the peer reports, checked against this node's trust roots, the
    InstanceId its handshake proved and the serial of the certificate it presented in that
    handshake (``presented_serial``, from the connection snapshot)."""
    try:
        chain = x509.load_pem_x509_certificates(str(info["certificate"]).encode())
    except (KeyError, ValueError) as error:
        return {"checked": False, "error": f"the peer reported no readable certificate: {error}"}
    leaf = chain[0]
    summary = summarize_certificate(leaf)
    spiffe = spiffe_uris(leaf)
    facts: dict[str, Any] = {
        "serial": summary.serial,
        "sha256": summary.fingerprint,
        "not_after": summary.not_after.isoformat(),
        "issuer": summary.issuer,
        "spiffe_id": spiffe[0] if spiffe else None,
        "presented_serial": presented_serial,
    }
    if presented_serial is not None and presented_serial != facts["serial"]:
        return {
            **facts,
            "checked": False,
            "error": f"the peer reports certificate serial {facts['serial']} but presented "
            f"{presented_serial} in the handshake",
        }
    own = node.credentials
    try:
        PeerVerifier(own.trust_roots, own.trust_domain).verify(
            leaf, chain[1:], role="server", expected=peer
        )
    except PeerVerificationError as error:
        return {**facts, "checked": False, "error": str(error)}
    return {**facts, "checked": True, "error": None}


async def _identity(node: Node, peer: InstanceId, timeout: float) -> dict[str, Any]:
    """Dial the peer (mutual TLS), time the handshake, and read what it proved."""
    credentials = node.credentials
    record = node.peers.get(peer)
    identity: dict[str, Any] = {
        "verified": False,
        "instance_id": None,
        "trust_domain": credentials.trust_domain,
        "handshake_seconds": None,
        "certificate": None,
        "refusal": None,
        "name": record.name if record is not None else "",
        "address": None if record is None else f"{record.address[0]}:{record.address[1]}",
    }
    began = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await node.connect(peer)
    except DialError as error:
        identity["refusal"] = {"reason": error.reason, "message": str(error)}
        return identity
    except TimeoutError:
        identity["refusal"] = {
            "reason": "handshake_timeout",
            "message": f"no handshake with {peer} within {timeout:g} s",
        }
        return identity
    identity["handshake_seconds"] = time.perf_counter() - began
    connection = node.snapshot().transport.to(peer)
    if connection is None or connection.peer != peer or connection.state != "established":
        identity["refusal"] = {"reason": "not_established", "message": "the connection closed"}
        return identity
    identity["instance_id"] = str(connection.peer)
    try:
        request = json.dumps({"reply_to": _listening(node)}).encode()
        info = json.loads(await node.call(peer, INFO_HANDLER, request, timeout=timeout))
    except UnaryTimeout as error:
        inbound = node.snapshot().transport.inbound_from(peer)
        if not any(connection.state == "established" for connection in inbound):
            # The handshake worked, the answer never came, and the peer never dialed
            # back: it sends what is for this InstanceId to another address it knows.
            raise ConfigurationError(
                f"{peer} took the probe's handshake but its answer went elsewhere: it "
                f"knows another address for the probe's InstanceId {node.instance_id} (a "
                "node running with these credentials). Give the probe credentials of its "
                "own (velomux certs issue --name probe-...)"
            ) from error
        identity["refusal"] = {"reason": "UnaryTimeout", "message": str(error)}
        return identity
    except UnknownHandler:
        identity["refusal"] = {
            "reason": "not_a_probe_sink",
            "message": f"{peer} serves no {INFO_HANDLER}: run `velomux node` there",
        }
        return identity
    except (VelomuxError, ValueError) as error:
        identity["refusal"] = {"reason": type(error).__name__, "message": str(error)}
        return identity
    identity["name"] = identity["name"] or str(info.get("name", ""))
    identity["peer_mux"] = bool(info.get("mux"))
    identity["peer_lanes"] = info.get("lanes")
    identity["certificate"] = _certificate_facts(
        node, peer, info, connection.peer_certificate_serial
    )
    if not identity["certificate"]["checked"]:
        identity["refusal"] = {
            "reason": "reported_certificate",
            "message": identity["certificate"]["error"],
        }
        return identity
    identity["verified"] = True
    return identity


async def _refuse_a_running_identity(node: Node) -> None:
    """A probe with a running node's credentials would look like that node to its peers
    (which close the older of two connections from one identity): refuse it."""
    discovery = node.discovery
    if discovery is None:
        return
    record = await discovery.lookup(node.instance_id)
    if record is not None:
        host, port = record.address
        raise ConfigurationError(
            f"the probe's credentials are those of a running node ({record.name or 'unnamed'} "
            f"at {host}:{port}, {node.instance_id}): give the probe credentials of its own "
            "(velomux certs issue --name probe-...)"
        )


async def probe(config: NodeConfig, spec: str, options: ProbeOptions) -> dict[str, Any]:
    """Run one probe and return its report (the ``--json`` object).

    Raises ConfigurationError (exit 2) for a peer it cannot resolve or a node it cannot
    start; every other failure is in the report. The probe's node closes on every path.
    SIGINT during the run ends the streaming window early (the report says
    ``interrupted``); a second one cancels the probe.
    """
    # Discovery finds the peer; the probe is not listed there (nobody is to route to it).
    try:
        node = await Node.start(config, publish=False)
    except ConfigurationError as error:
        if isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.EADDRINUSE:
            raise ConfigurationError(
                f"{error}. A probe is a node of its own: give it a configuration of its "
                "own, with port = 0 and credentials of its own (velomux certs issue "
                "--name probe-...), not a running node's"
            ) from error
        raise
    try:
        await _refuse_a_running_identity(node)
    except BaseException:
        await node.close()
        raise
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    interrupted: list[bool] = []
    stop_streams: asyncio.Event | None = None

    def on_interrupt() -> None:
        if interrupted and main is not None:
            main.cancel()
        interrupted.append(True)
        if stop_streams is not None:
            stop_streams.set()

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, on_interrupt)
    try:
        peer = await resolve_peer(node, spec, options.peer_id)
        report: dict[str, Any] = {
            "ok": False,
            "peer": {"requested": spec, "instance_id": str(peer)},
            "run": {
                "streams": options.streams,
                "duration_seconds": options.duration,
                "records_per_stream": options.records,
                "rate": options.rate,
                "payload_bytes": options.payload_bytes,
            },
        }
        identity = await _identity(node, peer, options.timeout)
        report["identity"] = identity
        report["peer"].update(name=identity["name"], address=identity["address"])
        if not identity["verified"]:
            report["exit_code"] = EXIT_FAILED
            return report
        streams = _Run(node, peer, options)
        stop_streams = streams.stop
        if interrupted:
            streams.stop.set()
        before = _mux_sent(node, streams.mux)
        await streams.stream()
        after = _mux_sent(node, streams.mux)
        await streams.reconcile()
        batches = data = None
        if before[0] is not None and after[0] is not None:
            batches = after[0] - before[0]
        if before[1] is not None and after[1] is not None:
            data = after[1] - before[1]
        report.update(streams.summary(batches, data))
        report["interrupted"] = bool(interrupted)
        delivery = report["delivery"]
        report["ok"] = delivery["streams_completed"] == delivery["streams"]
        report["exit_code"] = EXIT_OK if report["ok"] else EXIT_FAILED
        return report
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
        await node.close()


# -- output ------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def render_text(report: dict[str, Any]) -> str:
    """The report for a person: one section per question, one fact per line."""
    peer, run_ = report["peer"], report["run"]
    bound = (
        f"{run_['duration_seconds']:g} s"
        if run_["duration_seconds"] is not None
        else f"{run_['records_per_stream']:,} records per stream"
    )
    rate = "as fast as credit allows" if run_["rate"] is None else f"{run_['rate']:g} records/s"
    lines = [
        f"velomux probe to {peer.get('name') or peer['requested']} ({peer['instance_id']}) "
        f"at {peer.get('address') or '?'}: {run_['streams']} streams, {bound}, "
        f"{run_['payload_bytes']} B records, {rate}",
        "",
        "identity",
    ]
    identity = report["identity"]
    refusal = identity["refusal"]
    if identity["instance_id"] is not None:
        lines.append(
            f"  instance       {identity['instance_id']} (proven by its certificate in the "
            "mutual-TLS handshake)"
        )
    lines.append(f"  trust domain   {identity['trust_domain']}")
    certificate = identity["certificate"]
    if certificate is not None and "serial" in certificate:
        checked = (
            "checked against this node's trust roots and the proven InstanceId"
            if certificate["checked"]
            else "NOT valid here"
        )
        lines.append(
            f"  certificate    serial {certificate['serial']}, not after "
            f"{certificate['not_after']}, issuer {certificate['issuer']}"
        )
        origin = (
            "the certificate it presented in the handshake"
            if certificate.get("presented_serial") == certificate["serial"]
            else "as the peer reports it"
        )
        lines.append(f"  sha256         {certificate['sha256']} ({origin}; {checked})")
        if certificate.get("spiffe_id"):
            lines.append(f"  spiffe id      {certificate['spiffe_id']}")
    if identity["handshake_seconds"] is not None:
        lines.append(
            f"  handshake      {_ms(identity['handshake_seconds'] * 1e3)} (dial to established)"
        )
    if refusal is not None:
        lines.append(f"  REFUSED        {refusal['reason']}: {refusal['message']}")
        lines += ["", "result: FAILED (identity not verified)"]
        return "\n".join(lines)
    transport = report["transport"]
    by = ", ".join(
        f"{name} on {count}" for name, count in transport["streams_by_transport"].items()
    )
    lines.append(
        f"  transport      {transport['negotiated'] or 'none'} ({by or 'no stream opened'}); "
        f"peer lanes {identity.get('peer_lanes')}"
    )
    throughput = report["throughput"]
    per_write = throughput["records_per_write"]
    lines += [
        "",
        "throughput",
        f"  window         {throughput['window_seconds']:.3f} s (first send to last record "
        f"back; sending took {throughput['send_seconds']:.3f} s)",
        f"  records        {throughput['records']:,} reached the peer, "
        f"{_si(throughput['records_per_second'], 'records/s')}",
        f"  bytes          {_si(throughput['bytes'], 'B')}, "
        f"{_si(throughput['bytes_per_second'], 'B/s')}",
        "  records/write  "
        + ("- (no mux)" if per_write is None else f"{per_write:.1f} (data records per mux batch)"),
    ]
    latency = report["latency"]
    lines += [
        "",
        "latency (round trip probe -> peer -> probe, on the probe's clock)",
        f"  p50            {_ms(latency['p50_ms'])}",
        f"  p99            {_ms(latency['p99_ms'])}",
        f"  min / max      {_ms(latency['min_ms'])} / {_ms(latency['max_ms'])}",
        f"  samples        {latency['samples']:,}",
    ]
    delivery = report["delivery"]
    lines += [
        "",
        "delivery",
        f"  streams        {delivery['streams_completed']} of {delivery['streams']} "
        "completed whole",
        f"  records        sent {delivery['records_sent']:,}, received by the peer "
        f"{delivery['records_received_by_peer']:,}, echoed back {delivery['records_echoed']:,}",
        f"  lost           {delivery['records_lost']:,} on the way there, "
        f"{delivery['records_lost_on_the_way_back']:,} on the way back",
        f"  checksums      {delivery['checksum_mismatches']} streams differ; "
        f"{delivery['out_of_order']} records out of order",
        "",
        "errors",
    ]
    errors = report["errors"]
    messages = report["error_messages"]
    for reason, count in sorted(errors.items()):
        detail = f": {messages[reason]}" if reason in messages else ""
        lines.append(f"  {reason} x{count}{detail}")
    if not errors:
        lines.append("  none")
    lines.append("")
    if report.get("interrupted"):
        lines.append("(interrupted: the streaming window ended early)")
    lines.append("result: ok" if report["ok"] else "result: FAILED")
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def probe_main(args: argparse.Namespace) -> int:
    """``velomux probe``: exit 0 when whole and verified, 1 on a loss or failure, 2 on a
    usage or configuration error (one line on standard error)."""
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="velomux probe: log %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    show_deprecated_settings()
    try:
        options = ProbeOptions(
            streams=args.streams,
            duration=None if args.records is not None else _or(args.duration, 5.0),
            records=args.records,
            rate=args.rate,
            payload_bytes=args.payload_bytes,
            timeout=args.timeout,
            peer_id=args.peer_id,
        )
        if args.records is not None and args.duration is not None:
            raise ConfigurationError("give one of --duration and --records, not both")
        config = NodeConfig.from_toml(args.config)
    except ConfigurationError as error:
        print(f"velomux probe: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = run(probe(config, args.peer, options))
    except ConfigurationError as error:
        print(f"velomux probe: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        print(f"velomux probe: cannot start its node: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("velomux probe: interrupted; its node closed", file=sys.stderr)
        return EXIT_FAILED
    except VelomuxError as error:
        print(f"velomux probe: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(render_text(report))
    code: int = report["exit_code"]
    return code


DESCRIPTION = """\
Is the path to a peer trustworthy, and how fast? The probe starts a node of its own
from the configuration (its own credentials; port 0 is fine), proves who the peer is,
then opens --streams streams to it and streams fixed-size records for --duration
seconds (or --records per stream, at --rate records/s across all streams when given)
through the peer's velomux.echo handler: the peer, a `velomux node`, reads each stream
and writes every record back. It prints:

  identity    the InstanceId the peer's certificate proved in the handshake,
              the trust domain, the certificate's serial, fingerprint and
              not-after, the handshake time, the transport negotiated
  throughput  records/s and bytes/s that reached the peer, records per write
  latency     round-trip p50/p99 (probe, peer, probe) on the probe's clock
  delivery    records sent, counted by the peer (a CRC-32 per stream) and
              echoed back; streams completed whole; errors by class

Exit 0 when every stream completed whole and the identity was verified, 1 when
anything was lost or failed (a refused handshake says why), 2 for a usage or
configuration error.
"""


def add_probe_commands(commands: Any) -> None:
    """Add ``velomux probe`` to the command's subparsers."""
    parser = commands.add_parser(
        "probe",
        help="prove a peer's identity and measure streams to it (run `velomux node` there)",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "peer",
        metavar="PEER",
        help="an InstanceId, a [[peers]] or discovered name, or host:port (with --peer-id)",
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="TOML",
        help="the probe's own node configuration (its credentials)",
    )
    parser.add_argument(
        "--peer-id", metavar="UUID", help="the InstanceId of a PEER given as host:port"
    )
    parser.add_argument(
        "--streams", type=int, default=4, help=f"streams to open (1 to {MAX_STREAMS})"
    )
    bound = parser.add_mutually_exclusive_group()
    bound.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help=f"how long to stream (default 5, at most {MAX_DURATION:g})",
    )
    bound.add_argument(
        "--records", type=int, metavar="N", help="records per stream, in place of --duration"
    )
    parser.add_argument(
        "--rate",
        type=float,
        metavar="PER_SECOND",
        help="records per second across all streams (default: no pacing)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=64,
        help=f"bytes per record ({MIN_PAYLOAD_BYTES} to {MAX_PAYLOAD_BYTES})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="how long each step may take beyond the streaming (handshake, calls, drain)",
    )
    parser.add_argument(
        "--log-level",
        default="error",
        choices=["debug", "info", "warning", "error"],
        help="the least severe library log record shown on standard error",
    )
    parser.set_defaults(handler=probe_main)
