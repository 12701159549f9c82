"""Messenger and rendezvous metrics, in the node's own registry.

The series touched per message (messages and payload bytes by handler and direction, a
handler's runs, duration and request bytes) are plain integers and floats kept per label
combination and turned into samples at scrape time (:class:`MessageTallies`): the mux
sends one message per batch, and prometheus-client's ``inc`` (a lock and an observability
check per call) and ``observe`` (two of those and a bucket search) were a visible share of
what the messenger spends on a batch (docs/performance.md, "What does one batch cost?").
The rest are prometheus-client objects, with the labelled children of those touched per
call cached (:class:`Children`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, cast

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

__all__ = ["LATENCY_BUCKETS", "Children", "MessageTallies", "MessengerMetrics"]

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

_BOUND_LABELS: tuple[str, ...] = tuple(
    cast(Callable[[float], str], floatToGoString)(bound) for bound in LATENCY_BUCKETS
)
"""Each duration bucket's ``le`` label, as prometheus-client writes a histogram's."""

_LABELS_KEPT = 4096
"""Label combinations of one tallied series; past it, peer-chosen handler names are
counted under ``_other`` (the inbound side's names are the peer's choice)."""


class _Count:
    """A message count and its payload bytes."""

    __slots__ = ("count", "size")

    def __init__(self) -> None:
        self.count = 0
        self.size = 0


class _Handled:
    """A handler's runs (per response type and outcome): count, request bytes, duration."""

    __slots__ = ("buckets", "count", "seconds", "size")

    def __init__(self) -> None:
        self.count = 0
        self.size = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        """Runs per duration bucket (not cumulative); the last is above the top bound."""


class MessageTallies(Collector):
    """The per-message series, as plain numbers read at scrape time.

    ``velo_messenger_messages`` and ``velo_messenger_message_bytes`` by handler and
    direction; ``velo_messenger_handler_requests``, ``velo_messenger_handler_duration_seconds``
    and ``velo_messenger_handler_request_bytes`` by handler, response type (and outcome):
    the same names, labels and meaning as counters and a histogram would give. The event
    loop is the only writer; a scrape from another thread reads numbers, each whole."""

    def __init__(self) -> None:
        self._messages: dict[str, dict[str, _Count]] = {"inbound": {}, "outbound": {}}
        """Per direction, per handler name."""
        self._handled: dict[tuple[str, str, str], _Handled] = {}

    def message(self, handler: str, direction: str, size: int) -> None:
        """One message and its payload bytes."""
        names = self._messages[direction]
        tally = names.get(handler)
        if tally is None:
            if len(names) >= _LABELS_KEPT:
                handler = "_other"
                tally = names.get(handler)
            if tally is None:
                tally = names[handler] = _Count()
        tally.count += 1
        tally.size += size

    def handled(
        self, handler: str, response_type: str, outcome: str, seconds: float, size: int
    ) -> None:
        """One handler run: its duration and request bytes. Handler names are this node's
        own registrations, so the label combinations are bounded."""
        key = (handler, response_type, outcome)
        tally = self._handled.get(key)
        if tally is None:
            tally = self._handled[key] = _Handled()
        tally.count += 1
        tally.size += size
        tally.seconds += seconds
        tally.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        return self._families()

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        return self._families(fill=True)

    def _families(
        self, fill: bool = False
    ) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        messages = CounterMetricFamily(
            "velo_messenger_messages", "Messages by handler and direction",
            labels=["handler", "direction"],
        )  # fmt: skip
        message_bytes = CounterMetricFamily(
            "velo_messenger_message_bytes", "Payload bytes by handler and direction",
            labels=["handler", "direction"],
        )  # fmt: skip
        requests = CounterMetricFamily(
            "velo_messenger_handler_requests", "Handled messages",
            labels=["handler", "response_type", "outcome"],
        )  # fmt: skip
        duration = HistogramMetricFamily(
            "velo_messenger_handler_duration_seconds", "Time a handler ran",
            labels=["handler", "response_type", "outcome"],
        )  # fmt: skip
        request_bytes = CounterMetricFamily(
            "velo_messenger_handler_request_bytes", "Request payload bytes handled",
            labels=["handler", "response_type"],
        )  # fmt: skip
        if fill:
            for direction, names in self._messages.items():
                for handler, count in list(names.items()):
                    messages.add_metric([handler, direction], count.count)
                    message_bytes.add_metric([handler, direction], count.size)
            sizes: dict[tuple[str, str], int] = {}
            for (handler, response_type, outcome), run in list(self._handled.items()):
                labels = [handler, response_type, outcome]
                requests.add_metric(labels, run.count)
                cumulative = 0
                buckets: list[tuple[str, float]] = []
                for bound, runs in zip(_BOUND_LABELS, run.buckets, strict=False):
                    cumulative += runs
                    buckets.append((bound, cumulative))
                buckets.append(("+Inf", run.count))
                duration.add_metric(labels, buckets, sum_value=run.seconds)
                key = (handler, response_type)
                sizes[key] = sizes.get(key, 0) + run.size
            for (handler, response_type), size in sizes.items():
                request_bytes.add_metric([handler, response_type], size)
        yield from (messages, message_bytes, requests, duration, request_bytes)


class MessengerMetrics:
    """The messenger's and rendezvous' Prometheus series, in one node's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.tallies = MessageTallies()
        r.register(self.tallies)
        self.count_message: Callable[[str, str, int], None] = self.tallies.message
        """``count_message(handler, direction, size)``: one message and its payload bytes
        (the tally's own method: a message pays no call through this object)."""
        self.observe_handler: Callable[[str, str, str, float, int], None] = self.tallies.handled
        """``observe_handler(handler, response_type, outcome, seconds, size)``: one handler
        run, its duration and request bytes."""
        self.response_bytes = Counter(
            "velo_messenger_handler_response_bytes",
            "Response payload bytes sent",
            ["handler", "response_type", "outcome"],
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
