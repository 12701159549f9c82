"""The messenger's cached labelled children: the same series as ``labels()``, resolved once."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from velomux_quic.messenger import metrics as messenger_metrics
from velomux_quic.messenger.metrics import Children, MessengerMetrics


def _counter() -> tuple[CollectorRegistry, Counter]:
    registry = CollectorRegistry()
    return registry, Counter("things", "Things", ["kind", "outcome"], registry=registry)


def test_a_child_is_the_labelled_series_and_is_resolved_once() -> None:
    registry, counter = _counter()
    children = Children(counter)
    first = children("a", "ok")
    assert children("a", "ok") is first
    first.inc(2)
    children("b", "ok").inc()
    assert registry.get_sample_value("things_total", {"kind": "a", "outcome": "ok"}) == 2
    assert registry.get_sample_value("things_total", {"kind": "b", "outcome": "ok"}) == 1


def test_past_its_bound_a_child_is_still_counted_but_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(messenger_metrics, "_CHILDREN_KEPT", 2)
    registry, counter = _counter()
    children = Children(counter)
    children("a", "ok")
    children("b", "ok")
    assert len(children) == 2
    children("c", "ok").inc()
    children("c", "ok").inc()
    assert len(children) == 2
    assert registry.get_sample_value("things_total", {"kind": "c", "outcome": "ok"}) == 2


def test_the_messenger_series_counted_per_message_use_kept_children() -> None:
    metrics = MessengerMetrics(CollectorRegistry())
    assert metrics.response_bytes_of("echo", "unary", "success") is metrics.response_bytes_of(
        "echo", "unary", "success"
    )
    assert metrics.replies_dropped_of("peer_not_reading") is metrics.replies_dropped_of(
        "peer_not_reading"
    )
