"""What a node is built from and how long its certificates last, as Prometheus series.

``velomux_build_info{version,engine,record_path} 1`` is the usual build-info gauge: a
dashboard or an alert joins it on the instance to say which QUIC engine and which record
path produced a figure. ``velo_node_certificate_expiry_seconds{which}`` is the time left
before the node's certificate (``which="node"``) and the first of the CAs it trusts
(``which="ca"``) expire, negative once expired, in the style certificate exporters use so
one alert rule covers every node; both are read at scrape time from the credentials the
node presents now, so a reload shows at the next scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..security.certs import NodeCredentials
from ..security.startup import expiring_certificates

__all__ = ["BUILD_INFO", "CERTIFICATE_EXPIRY", "NodeInfoCollector"]

BUILD_INFO = "velomux_build_info"
CERTIFICATE_EXPIRY = "velo_node_certificate_expiry_seconds"


class NodeInfoCollector(Collector):
    """The two series above for one node (its registry holds one such collector)."""

    def __init__(
        self,
        *,
        version: str,
        engine: str,
        record_path: str,
        credentials: Callable[[], NodeCredentials],
    ) -> None:
        self._labels = [version, engine, record_path]
        self._credentials = credentials

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            BUILD_INFO,
            "This node's velomux_quic version, QUIC engine and record path (value 1)",
            labels=["version", "engine", "record_path"],
        )
        info.add_metric(self._labels, 1)
        yield info
        expiry = GaugeMetricFamily(
            CERTIFICATE_EXPIRY,
            "Seconds until the node's certificate (which=node) or the first CA it trusts "
            "(which=ca) expires; negative once expired",
            labels=["which"],
        )
        seen: set[str] = set()
        for each in expiring_certificates(self._credentials()):  # soonest first
            if each.which not in seen:
                seen.add(each.which)
                expiry.add_metric([each.which], each.seconds_left)
        yield expiry

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """Names only, so registering it does not read the credentials."""
        yield GaugeMetricFamily(BUILD_INFO, "", labels=["version", "engine", "record_path"])
        yield GaugeMetricFamily(CERTIFICATE_EXPIRY, "", labels=["which"])
