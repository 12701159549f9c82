"""Streaming metrics (``velo_streaming_*``), in the node's own registry.

Per-record counts are plain integers bumped inline and exported at scrape time; control
operations (one per attach, detach, ...) use prometheus-client objects directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ..messenger.metrics import LATENCY_BUCKETS, Children

__all__ = ["StreamingMetrics"]

ATTACH_RTT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_COUNTERS = {
    "frames_written": ("velo_streaming_frames_written", "Per-stream frames written"),
    "egress_flushes": ("velo_streaming_egress_flushes", "Per-stream egress writes"),
    "frames_received": ("velo_streaming_frames_received", "Per-stream frames received"),
    "producer_send_backpressure": (
        "velo_streaming_producer_send_backpressure",
        "Sends that found their channel full and waited",
    ),
    "reader_pump_backpressure": (
        "velo_streaming_reader_pump_backpressure",
        "Per-stream receivers whose anchor stopped taking records (window closed)",
    ),
    "heartbeat_watchdog_firings": (
        "velo_streaming_heartbeat_watchdog_firings",
        "Streams ended by the heartbeat watchdog",
    ),
    "heartbeat_watchdog_checks": (
        "velo_streaming_heartbeat_watchdog_checks",
        "Wake-ups of the stream watchdogs (about one per stream per window)",
    ),
    "attach_binds_replaced": (
        "velo_streaming_attach_binds_replaced",
        "Binds of an attach whose answer timed out, released by the sender's retry",
    ),
    "attach_retries": (
        "velo_streaming_attach_retries",
        "Attaches sent again because their connection ended before the answer came",
    ),
    "senders_lost": (
        "velo_streaming_senders_lost",
        "Open senders cancelled because their channel closed under them (consumer gone)",
    ),
    "unclaimed_bind_reaped": (
        "velo_streaming_unclaimed_bind_reaped",
        "Binds whose accept window closed before a sender claimed them",
    ),
    "heartbeats_sent": ("velo_streaming_heartbeats_sent", "Heartbeat frames sent"),
    "heartbeats_dropped": (
        "velo_streaming_heartbeats_dropped",
        "Heartbeats dropped because the sender's channel was full",
    ),
    "refused_streams": (
        "velo_streaming_refused_streams",
        "Per-stream QUIC streams refused: no bind matched their opening",
    ),
}


class StreamingMetrics(Collector):
    """Hot-path integers plus the control-operation series."""

    def __init__(self, registry: CollectorRegistry, active_anchors: Callable[[], int]) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)
        self._active_anchors = active_anchors
        registry.register(self)
        self.anchor_operations = Counter(
            "velo_streaming_anchor_operations",
            "Anchor control operations",
            ["operation", "outcome", "transport_scheme"],
            registry=registry,
        )
        self.anchor_operation_duration = Histogram(
            "velo_streaming_anchor_operation_duration_seconds",
            "Anchor control operation time on the receiver",
            ["operation", "outcome", "transport_scheme"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.attach_rtt = Histogram(
            "velo_streaming_anchor_attach_rtt_seconds",
            "Sender-measured attach round trip",
            ["outcome", "transport_scheme"],
            buckets=ATTACH_RTT_BUCKETS,
            registry=registry,
        )
        # Touched once or twice per stream: each series' children resolved once per label
        # values, not by ``labels()`` (its validation, join and lock) at every stream.
        self.anchor_operation = Children(self.anchor_operations)
        self.anchor_operation_time = Children(self.anchor_operation_duration)
        self.attach_rtt_of = Children(self.attach_rtt)

    frames_written: int
    egress_flushes: int
    frames_received: int
    producer_send_backpressure: int
    reader_pump_backpressure: int
    heartbeat_watchdog_firings: int
    heartbeat_watchdog_checks: int
    attach_binds_replaced: int
    attach_retries: int
    senders_lost: int
    unclaimed_bind_reaped: int
    heartbeats_sent: int
    heartbeats_dropped: int
    refused_streams: int

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for attribute, (name, documentation) in _COUNTERS.items():
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], getattr(self, attribute))
            yield family
        anchors = GaugeMetricFamily("velo_streaming_active_anchors", "Anchors in the registry")
        anchors.add_metric([], self._active_anchors())
        yield anchors

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return iter(())
