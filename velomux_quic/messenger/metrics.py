"""Messenger and rendezvous metrics, in the node's own registry.

The messenger carries one message per mux batch (not per token), so prometheus-client
objects are cheap enough here; labelled children are cached per handler name so a message
costs a dict lookup, not a label resolution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

__all__ = ["LATENCY_BUCKETS", "Children", "MessengerMetrics"]

M = TypeVar("M", Counter, Histogram)

_CHILDREN_KEPT = 4096
"""Label combinations a :class:`Children` keeps; past it, each look-up resolves the labels
again (right, only slower), so a caller's unbounded names cannot grow the cache."""


class Children(Generic[M]):
    """The labelled children of one metric, resolved once per label values and kept.

    prometheus-client's ``labels()`` validates and joins the values and takes a lock on
    every call, which a series counted once per message pays each time; a dict look-up
    by the values' tuple does not. Use it where a series is touched per message, per
    request or per call."""

    __slots__ = ("_kept", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._kept: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._kept.get(values)
        if child is None:
            child = self._metric.labels(*values)
            if len(self._kept) < _CHILDREN_KEPT:
                self._kept[values] = child
        return child

    def __len__(self) -> int:
        """Label combinations kept."""
        return len(self._kept)


LATENCY_BUCKETS = tuple(0.0005 * 2**i for i in range(16))
"""0.5 ms doubling, 16 buckets (about 16 s at the top), as the metrics reference sets."""


class MessengerMetrics:
    """The messenger's and rendezvous' Prometheus series, in one node's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.handler_requests = Counter(
            "velo_messenger_handler_requests",
            "Handled messages",
            ["handler", "response_type", "outcome"],
            registry=r,
        )
        self.handler_duration = Histogram(
            "velo_messenger_handler_duration_seconds",
            "Time a handler ran",
            ["handler", "response_type", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_bytes = Counter(
            "velo_messenger_handler_request_bytes",
            "Request payload bytes handled",
            ["handler", "response_type"],
            registry=r,
        )
        self.response_bytes = Counter(
            "velo_messenger_handler_response_bytes",
            "Response payload bytes sent",
            ["handler", "response_type", "outcome"],
            registry=r,
        )
        self.messages = Counter(
            "velo_messenger_messages",
            "Messages by handler and direction",
            ["handler", "direction"],
            registry=r,
        )
        self.message_bytes = Counter(
            "velo_messenger_message_bytes",
            "Payload bytes by handler and direction",
            ["handler", "direction"],
            registry=r,
        )
        self.lane_wait = Histogram(
            "velo_messenger_ordered_lane_wait_seconds",
            "Enqueue to handler start on an ordered (handler, sender, lane) queue",
            ["handler"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.dispatch_failures = Counter(
            "velo_messenger_dispatch_failures",
            "Messages that could not be dispatched",
            ["stage", "reason"],
            registry=r,
        )
        self.unary_duration = Histogram(
            "velo_messenger_unary_duration_seconds",
            "Caller-side unary and sync call latency",
            ["handler", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pending_responses = Gauge(
            "velo_messenger_pending_responses", "Calls waiting for an answer", registry=r
        )
        self.ordered_lanes = Gauge(
            "velo_messenger_ordered_lanes",
            "Live ordered (handler, sender, lane) queues",
            registry=r,
        )
        self.ordered_lane_depth = Gauge(
            "velo_messenger_ordered_lane_depth", "Messages queued, not yet handled", registry=r
        )
        self.rendezvous_ops = Counter(
            "velo_rendezvous_operations",
            "Rendezvous operations",
            ["operation", "outcome"],
            registry=r,
        )
        self.rendezvous_bytes = Counter(
            "velo_rendezvous_bytes", "Rendezvous bytes", ["operation"], registry=r
        )
        self.staged_bytes = Gauge(
            "velo_rendezvous_staged_bytes", "Bytes staged for peers, not yet pulled", registry=r
        )
        self.active_slots = Gauge(
            "velo_rendezvous_active_slots", "Payloads staged for peers", registry=r
        )
        self.refusals = Counter(
            "velo_rendezvous_refusals",
            "Staged payloads refused by the receiver, by reason",
            ["reason"],
            registry=r,
        )
        self.staged_pulls_refused = Counter(
            "velo_messenger_staged_pulls_refused",
            "Staged descriptors refused because their peer had too many pulls outstanding,"
            " by the bound reached (count or bytes)",
            ["reason"],
            registry=r,
        )
        self.staged_releases_skipped = Counter(
            "velo_messenger_staged_releases_skipped",
            "Staged descriptors refused for their size whose sender was not asked to release"
            " the payload, because max_releases_per_peer such requests to it were in flight",
            registry=r,
        )
        self.replies_dropped = Counter(
            "velo_messenger_replies_dropped",
            "Replies not sent because their peer had max_pending_reply_bytes waiting already",
            ["reason"],
            registry=r,
        )
        self.pending_reply_bytes = Gauge(
            "velo_messenger_pending_reply_bytes",
            "Bytes of replies waiting in the admission gates of peers' lanes",
            registry=r,
        )
        self.pulls_outstanding = Gauge(
            "velo_rendezvous_pulls_outstanding",
            "Staged payloads of peers accepted and not delivered yet",
            registry=r,
        )
        self.response_bytes_of = Children(self.response_bytes)
        self.replies_dropped_of = Children(self.replies_dropped)
        self.unary_duration_of = Children(self.unary_duration)
        self.lane_wait_of = Children(self.lane_wait)
        self._in: dict[str, tuple[Counter, Counter]] = {}
        self._out: dict[str, tuple[Counter, Counter]] = {}
        self._handled: dict[tuple[str, str, str], tuple[Counter, Histogram, Counter]] = {}

    def bind_gauges(
        self,
        pending: Callable[[], float],
        lanes: Callable[[], float],
        depth: Callable[[], float],
        staged_bytes: Callable[[], float],
        staged_count: Callable[[], float],
        pulls_outstanding: Callable[[], float],
        pending_reply_bytes: Callable[[], float],
    ) -> None:
        """Read the gauges from the messenger's live state at scrape time (nothing to keep in
        step)."""
        self.pending_responses.set_function(pending)
        self.ordered_lanes.set_function(lanes)
        self.ordered_lane_depth.set_function(depth)
        self.staged_bytes.set_function(staged_bytes)
        self.active_slots.set_function(staged_count)
        self.pulls_outstanding.set_function(pulls_outstanding)
        self.pending_reply_bytes.set_function(pending_reply_bytes)

    def observe_handler(
        self, handler: str, response_type: str, outcome: str, seconds: float, size: int
    ) -> None:
        """One handler run: its count, duration and request bytes.

        The labelled children are looked up once per (handler, type, outcome) and kept:
        ``labels()`` costs several microseconds, which a mux lane pays on every batch it
        receives. Handler names are this node's own registrations, so the cache is bounded.
        """
        key = (handler, response_type, outcome)
        children = self._handled.get(key)
        if children is None:
            children = self._handled[key] = (
                self.handler_requests.labels(handler, response_type, outcome),
                self.handler_duration.labels(handler, response_type, outcome),
                self.request_bytes.labels(handler, response_type),
            )
        children[0].inc()
        children[1].observe(seconds)
        children[2].inc(size)

    def count_message(self, handler: str, direction: str, size: int) -> None:
        """One message and its payload bytes, by handler and direction (labelled children
        cached)."""
        cache = self._in if direction == "inbound" else self._out
        children = cache.get(handler)
        if children is None:
            if len(cache) > 4096:  # names are peer-controlled on the inbound side: stay bounded
                handler = "_other"
                children = cache.get(handler)
            if children is None:
                children = cache[handler] = (
                    self.messages.labels(handler, direction),
                    self.message_bytes.labels(handler, direction),
                )
        children[0].inc()
        children[1].inc(size)
