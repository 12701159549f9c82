"""Measuring one side of a run: CPU from ``getrusage``, the node's counters, percentiles.

CPU is ``getrusage(RUSAGE_SELF)``, user plus system, over a window: every thread of the
process counts. The counters come from the node's own Prometheus registry, the series an
operator reads, so the demo's figures are the ones a dashboard would show.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from dataclasses import dataclass

from velomux_quic import Node

__all__ = ["COUNTERS", "CpuWindow", "live_slots", "percentile_ms", "read_counters"]

COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "datagrams_out": (
        "velo_transport_datagrams_total",
        {"transport": "quic", "direction": "outbound"},
    ),
    "datagrams_in": (
        "velo_transport_datagrams_total",
        {"transport": "quic", "direction": "inbound"},
    ),
    "mux_batches_sent": ("velo_streaming_mux_batches_total", {"direction": "sent"}),
    "mux_records_sent": ("velo_streaming_mux_records_total", {"direction": "sent"}),
}
"""The series a run reads, by short name: (metric, labels). A node without a mux exports
no mux series; they read as 0 there."""


def read_counters(node: Node) -> dict[str, float]:
    """Every series of :data:`COUNTERS` from the node's registry (0 when absent)."""
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in node.registry.collect()
        for sample in family.samples
    }
    return {
        key: samples.get((name, frozenset(labels.items())), 0.0)
        for key, (name, labels) in COUNTERS.items()
    }


def counters_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """CPU seconds of this process at the start of a window; :meth:`seconds` since."""

    user: float
    system: float

    @classmethod
    def open(cls) -> CpuWindow:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(usage.ru_utime, usage.ru_stime)

    def seconds(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return (usage.ru_utime - self.user) + (usage.ru_stime - self.system)


def live_slots(node: Node) -> int:
    """Mux slots still live on ``node``, egress and ingress over every peer and lane (0 on
    a node without a mux): what must be back to 0 once every stream ended."""
    mux = node.snapshot().mux
    if mux is None:
        return 0
    egress = sum(lane.live_slots for lane in mux.egress.values())
    ingress = sum(table.live_slots for table in mux.ingress.values())
    return egress + ingress


def percentile_ms(ordered: Sequence[int], q: float) -> float | None:
    """Nearest-rank percentile of sorted nanoseconds, in milliseconds (None when empty)."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1] / 1e6
