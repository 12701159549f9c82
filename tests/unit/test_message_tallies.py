"""The per-message series as plain numbers read at scrape time: the samples a counter and a
histogram of the same names would give, and a bounded set of peer-chosen label values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from velomux_quic.messenger import metrics as messenger_metrics
from velomux_quic.messenger.metrics import LATENCY_BUCKETS, MessengerMetrics


def test_messages_and_their_bytes_are_counted_by_handler_and_direction() -> None:
    registry = CollectorRegistry()
    metrics = MessengerMetrics(registry)
    metrics.count_message("echo", "inbound", 100)
    metrics.count_message("echo", "inbound", 50)
    metrics.count_message("echo", "outbound", 7)
    inbound = {"handler": "echo", "direction": "inbound"}
    assert registry.get_sample_value("velo_messenger_messages_total", inbound) == 2
    assert registry.get_sample_value("velo_messenger_message_bytes_total", inbound) == 150
    outbound = {"handler": "echo", "direction": "outbound"}
    assert registry.get_sample_value("velo_messenger_messages_total", outbound) == 1


def test_handler_runs_give_the_samples_of_a_histogram_of_the_same_buckets() -> None:
    registry = CollectorRegistry()
    metrics = MessengerMetrics(registry)
    reference = CollectorRegistry()
    histogram = Histogram("ref", "reference", buckets=LATENCY_BUCKETS, registry=reference)
    durations = [0.0001, 0.0005, 0.0007, 0.003, 0.003, 1.5, 100.0]
    for seconds in durations:
        metrics.observe_handler("echo", "unary", "success", seconds, 10)
        histogram.observe(seconds)
    labels = {"handler": "echo", "response_type": "unary", "outcome": "success"}
    for bound in (*LATENCY_BUCKETS, float("inf")):
        le = "+Inf" if bound == float("inf") else repr(bound)
        ours = registry.get_sample_value(
            "velo_messenger_handler_duration_seconds_bucket", labels | {"le": le}
        )
        assert ours == reference.get_sample_value("ref_bucket", {"le": le}), le
    assert registry.get_sample_value(
        "velo_messenger_handler_duration_seconds_sum", labels
    ) == pytest.approx(sum(durations))
    assert registry.get_sample_value("velo_messenger_handler_requests_total", labels) == 7
    assert (
        registry.get_sample_value(
            "velo_messenger_handler_request_bytes_total",
            {"handler": "echo", "response_type": "unary"},
        )
        == 70
    )


def test_peer_chosen_handler_names_past_the_bound_are_counted_as_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(messenger_metrics, "_LABELS_KEPT", 2)
    registry = CollectorRegistry()
    metrics = MessengerMetrics(registry)
    for name in ("a", "b", "c", "d"):
        metrics.count_message(name, "inbound", 1)

    def count(handler: str) -> float | None:
        return registry.get_sample_value(
            "velo_messenger_messages_total", {"handler": handler, "direction": "inbound"}
        )

    assert (count("a"), count("b"), count("c"), count("_other")) == (1, 1, None, 2)
