"""Transport metrics: plain integer counters on the hot path, exported at scrape time.

Incrementing a prometheus-client Counter takes a lock and a label lookup; doing that per
frame would cost more than framing the frame. The transport bumps attributes of a
``__slots__`` object instead, and :class:`TransportCollector` turns them into the
``velo_transport_*`` series when Prometheus scrapes the node's registry.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["TRANSPORT_KEY", "TransportCollector", "TransportStats"]

TRANSPORT_KEY = "quic"
"""Value of the ``transport`` label on every series this transport exports."""

DATAGRAM_SIZE_BUCKETS = (1200, 1452, 2048, 4096, 8192, 8952, 8972, 16384, 32768, 65527)
"""Upper bounds of the datagram-size histogram: the base, the jumbo-frame payloads, the
loopback default."""


class TransportStats:
    """Counters the transport updates inline; read by the collector and by tests."""

    __slots__ = (
        "active_connections",
        "bytes_in",
        "bytes_out",
        "certificate_not_after",
        "credential_reloads",
        "datagram_sizes",
        "datagrams_in",
        "datagrams_out",
        "datagrams_too_big",
        "dials",
        "engine_failures",
        "frames_in",
        "frames_out",
        "gro_buffers",
        "gso_fallbacks",
        "gso_trains",
        "peer_refusals",
        "pmtu_black_holes",
        "pmtu_probes",
        "registered_peers",
        "rejections",
        "send_backpressure",
        "send_failures_after_admission",
        "stateless_resets_late",
        "stateless_resets_received",
        "stateless_resets_sent",
        "stateless_resets_suppressed",
        "turns_waited",
        "udp_send_drops",
        "unacked_cap_reached",
    )

    def __init__(self) -> None:
        self.frames_in = 0
        self.frames_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.datagrams_in = 0
        self.datagrams_out = 0
        self.send_backpressure = 0
        self.send_failures_after_admission = 0
        self.unacked_cap_reached = 0
        self.turns_waited = 0
        """Times a connection's lane data waited for its peer's next turn of the loop
        (``peer_turn_bytes`` spent)."""
        """Times a connection's lanes (or its peer's) reached this node's cap on bytes
        admitted and not acknowledged, so that sends waited (``max_unacked_bytes``)."""
        self.dials = 0
        self.active_connections = 0
        self.registered_peers = 0
        self.stateless_resets_sent = 0
        """Resets sent for datagrams addressed to connections this node no longer has."""
        self.stateless_resets_received = 0
        """Connections ended because their peer reset them (it had lost their state)."""
        self.stateless_resets_suppressed = 0
        """Resets not sent because the rate bound was spent."""
        self.stateless_resets_late = 0
        """Resets that arrived for connections this node had already closed (ignored)."""
        self.rejections: Counter[str] = Counter()
        """Refused inbound input by reason (``oversized_frame``, ``unverified_data``, ...)."""
        self.peer_refusals: Counter[str] = Counter()
        """Handshakes refused by peer verification, by reason (``no_certificate``, ...)."""
        self.credential_reloads: Counter[str] = Counter()
        """``reload_credentials`` calls by outcome (``ok``, ``refused``)."""
        self.certificate_not_after = 0.0
        """Unix time at which the certificate new connections present expires."""
        self.datagram_sizes: Counter[int] = Counter()
        """Established connections by the datagram size each uses now."""
        self.pmtu_probes: Counter[str] = Counter()
        """Path MTU probes by outcome: ``sent``, ``acked``, ``lost``."""
        self.pmtu_black_holes = 0
        self.datagrams_too_big = 0
        """Sends the kernel refused as larger than the device's MTU (EMSGSIZE)."""
        self.gso_trains = 0
        """``sendmsg`` calls that carried several datagrams (UDP GSO)."""
        self.gso_fallbacks = 0
        """Destinations for which the kernel refused GSO (EIO, EINVAL): sent singly since."""
        self.gro_buffers = 0
        """Received buffers that held several datagrams (UDP GRO)."""
        self.udp_send_drops = 0
        """Datagrams dropped because the send queue behind a full kernel buffer was full."""
        self.engine_failures = 0
        """Connections ended because their QUIC engine raised (INTERNAL_ERROR sent)."""


def _transport_counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    """One counter of the endpoint's, labelled with the transport's key."""
    family = CounterMetricFamily(name, documentation, labels=["transport"])
    family.add_metric([TRANSPORT_KEY], value)
    return family


class TransportCollector(Collector):
    """Exports a :class:`TransportStats` as the ``velo_transport_*`` series."""

    def __init__(self, stats: TransportStats, connections: Callable[[], int]) -> None:
        self._stats = stats
        self._connections = connections

    def collect(
        self,
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily | GaugeHistogramMetricFamily]:
        s = self._stats
        labels = ["transport", "direction", "message_type", "outcome"]
        frames = CounterMetricFamily(
            "velo_transport_frames", "Frames seen by the transport", labels=labels
        )
        frames.add_metric([TRANSPORT_KEY, "inbound", "message", "accepted"], s.frames_in)
        frames.add_metric([TRANSPORT_KEY, "outbound", "message", "accepted"], s.frames_out)
        yield frames
        frame_bytes = CounterMetricFamily(
            "velo_transport_frame_bytes",
            "Frame bytes seen by the transport",
            labels=["transport", "direction", "message_type"],
        )
        frame_bytes.add_metric([TRANSPORT_KEY, "inbound", "message"], s.bytes_in)
        frame_bytes.add_metric([TRANSPORT_KEY, "outbound", "message"], s.bytes_out)
        yield frame_bytes
        datagrams = CounterMetricFamily(
            "velo_transport_datagrams",
            "UDP datagrams moved by the node's endpoint",
            labels=["transport", "direction"],
        )
        datagrams.add_metric([TRANSPORT_KEY, "inbound"], s.datagrams_in)
        datagrams.add_metric([TRANSPORT_KEY, "outbound"], s.datagrams_out)
        yield datagrams
        yield _transport_counter(
            "velo_transport_send_backpressure",
            "Sends that returned Pending (the lane was full)",
            s.send_backpressure,
        )
        yield _transport_counter(
            "velo_transport_unacked_cap_reached",
            "Times a connection's (or its peer's) unacknowledged bytes reached this node's"
            " cap (max_unacked_bytes, max_unacked_bytes_per_peer) and its sends waited",
            s.unacked_cap_reached,
        )
        yield _transport_counter(
            "velo_transport_peer_turns_waited",
            "Times a connection's lane data waited for its peer's next turn of the event loop"
            " (peer_turn_bytes spent: other peers are served first)",
            s.turns_waited,
        )
        rejections = CounterMetricFamily(
            "velo_transport_rejections",
            "Inbound input dropped or refused, by reason",
            labels=["transport", "reason"],
        )
        for reason, count in sorted(s.rejections.items()):
            rejections.add_metric([TRANSPORT_KEY, reason], count)
        rejections.add_metric([TRANSPORT_KEY, "send_error"], s.send_failures_after_admission)
        yield rejections
        refusals = CounterMetricFamily(
            "velo_transport_peer_refusals",
            "Handshakes refused because the peer's certificate failed verification",
            labels=["transport", "reason"],
        )
        for reason, count in sorted(s.peer_refusals.items()):
            refusals.add_metric([TRANSPORT_KEY, reason], count)
        yield refusals
        reloads = CounterMetricFamily(
            "velo_transport_credential_reloads",
            "Credential reloads by outcome (refused: the old credentials stayed in use)",
            labels=["transport", "outcome"],
        )
        for outcome in ("ok", "refused"):
            reloads.add_metric([TRANSPORT_KEY, outcome], s.credential_reloads[outcome])
        yield reloads
        expiry = GaugeMetricFamily(
            "velo_transport_certificate_expiry_timestamp_seconds",
            "Unix time at which the node certificate new connections present expires",
            labels=["transport"],
        )
        expiry.add_metric([TRANSPORT_KEY], s.certificate_not_after)
        yield expiry
        resets = CounterMetricFamily(
            "velo_transport_stateless_resets",
            "Stateless resets: sent for connections this node lost, received for ones its "
            "peer lost (each such connection ends at once), suppressed by the rate bound, "
            "late (for a connection already closed here; ignored)",
            labels=["transport", "direction"],
        )
        resets.add_metric([TRANSPORT_KEY, "sent"], s.stateless_resets_sent)
        resets.add_metric([TRANSPORT_KEY, "received"], s.stateless_resets_received)
        resets.add_metric([TRANSPORT_KEY, "suppressed"], s.stateless_resets_suppressed)
        resets.add_metric([TRANSPORT_KEY, "late"], s.stateless_resets_late)
        yield resets
        dials = CounterMetricFamily(
            "velo_transport_dials", "Outbound connections started", labels=["transport"]
        )
        dials.add_metric([TRANSPORT_KEY], s.dials)
        yield dials
        yield _transport_counter(
            "velo_transport_engine_failures",
            "Connections ended at once because their QUIC engine raised (the peer was sent "
            "CONNECTION_CLOSE with INTERNAL_ERROR)",
            s.engine_failures,
        )
        active = GaugeMetricFamily(
            "velo_transport_active_connections", "Open QUIC connections", labels=["transport"]
        )
        active.add_metric([TRANSPORT_KEY], self._connections())
        yield active
        peers = GaugeMetricFamily(
            "velo_transport_registered_peers", "Peers with a known address", labels=["transport"]
        )
        peers.add_metric([TRANSPORT_KEY], s.registered_peers)
        yield peers
        yield from self._datagram_series(s)

    @staticmethod
    def _datagram_series(
        s: TransportStats,
    ) -> Iterator[CounterMetricFamily | GaugeHistogramMetricFamily]:
        sizes = GaugeHistogramMetricFamily(
            "velo_transport_datagram_size_bytes",
            "Established connections by the datagram size each uses now",
            labels=["transport"],
        )
        buckets: list[tuple[str, float]] = []
        for bound in DATAGRAM_SIZE_BUCKETS:
            count = sum(n for size, n in s.datagram_sizes.items() if size <= bound)
            buckets.append((str(bound), count))
        buckets.append(("+Inf", sum(s.datagram_sizes.values())))
        sizes.add_metric(
            [TRANSPORT_KEY], buckets, sum(size * n for size, n in s.datagram_sizes.items())
        )
        yield sizes
        probes = CounterMetricFamily(
            "velo_transport_pmtu_probes",
            "Path MTU probes (padded PINGs above the current size), by outcome",
            labels=["transport", "outcome"],
        )
        for outcome in ("sent", "acked", "lost"):
            probes.add_metric([TRANSPORT_KEY, outcome], s.pmtu_probes[outcome])
        yield probes
        yield _transport_counter(
            "velo_transport_pmtu_black_holes",
            "Connections that fell back to the base datagram size: full-size packets were lost",
            s.pmtu_black_holes,
        )
        yield _transport_counter(
            "velo_transport_datagrams_too_big",
            "Datagrams the kernel refused to send as larger than the device MTU (EMSGSIZE)",
            s.datagrams_too_big,
        )
        yield _transport_counter(
            "velo_transport_gso_trains",
            "sendmsg calls that carried several datagrams to one peer (UDP GSO)",
            s.gso_trains,
        )
        yield _transport_counter(
            "velo_transport_gso_fallbacks",
            "Destinations for which the kernel refused UDP GSO; they are sent one datagram "
            "per call since",
            s.gso_fallbacks,
        )
        yield _transport_counter(
            "velo_transport_gro_buffers",
            "Received buffers in which the kernel coalesced several datagrams (UDP GRO)",
            s.gro_buffers,
        )
        yield _transport_counter(
            "velo_transport_udp_send_drops",
            "Datagrams dropped because the queue behind a full socket send buffer was full "
            "(QUIC's loss recovery resends them)",
            s.udp_send_drops,
        )

    @classmethod
    def register(
        cls, registry: CollectorRegistry, stats: TransportStats, connections: Callable[[], int]
    ) -> TransportCollector:
        collector = cls(stats, connections)
        registry.register(collector)
        return collector
