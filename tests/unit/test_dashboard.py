"""docs/grafana/velomux.json is a Grafana dashboard an operator can import as it is.

These checks read the file only: its shape (a Prometheus datasource variable every query
uses, panels for each series the operations guide names), and the PromQL parser that pulls
metric names out of its expressions. That every name is one a node really exports is
checked against two running nodes in tests/integration/test_dashboard_metrics.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "velomux.json"

# PromQL words that look like identifiers but are not metric names.
_PROMQL_WORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
    }
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    A metric name is an identifier that is not a function (not followed by ``(``), not a
    keyword, and not inside a label matcher ``{...}``, a range ``[...]``, a grouping
    clause ``by (...)`` or a string: the identifiers before ``{`` or ``[``, or bare inside
    ``rate(...)``. Grafana's ``$variables`` are not names either.
    """
    text = _STRING.sub('""', expr)
    text = _GROUPING.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    return {
        name
        for name, call in _IDENTIFIER.findall(text)
        if not call and name.lower() not in _PROMQL_WORDS
    }


def histogram_family(name: str) -> str:
    """``x_bucket`` / ``x_sum`` / ``x_count`` -> ``x``; any other name unchanged."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that runs queries, rows' nested panels included."""
    found: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in query_panels(load_dashboard())
        for target in panel["targets"]
    ]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('rate(velo_a_total{job=~"$job"}[$__rate_interval])', {"velo_a_total"}),
        ("rate(velo_a_total[5m])", {"velo_a_total"}),
        ("velo_gauge", {"velo_gauge"}),
        (
            'histogram_quantile(0.99, sum by (le) (rate(velo_h_bucket{i="x"}[1m])))',
            {"velo_h_bucket"},
        ),
        ("sum without (instance) (velo_a) / on (job) group_left velo_b", {"velo_a", "velo_b"}),
        (
            'sum by (reason) (increase(velo_c_total{reason="stale_epoch"}[$__range]))',
            {"velo_c_total"},
        ),
        ("label_values(velo_d, job)", {"velo_d", "job"}),  # not a panel query, shows the limit
    ],
)
def test_the_parser_finds_the_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_histogram_suffixes_map_to_their_family() -> None:
    assert histogram_family("velo_x_seconds_bucket") == "velo_x_seconds"
    assert histogram_family("velo_x_count") == "velo_x"
    assert histogram_family("velo_x_total") == "velo_x_total"


def test_the_dashboard_has_a_prometheus_datasource_variable_every_query_uses() -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    for panel in query_panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])


def test_the_dashboard_is_an_importable_grafana_document() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in query_panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the operator reads in it"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_series_an_operator_reads_first_has_a_panel() -> None:
    names = {name for _, expr in dashboard_expressions() for name in metric_names(expr)}
    for wanted in (
        "velo_streaming_mux_records_per_batch_bucket",  # records per batch
        "velo_streaming_mux_batches_total",  # batches per second
        "velo_streaming_mux_live_slots",
        "velo_streaming_mux_reader_stall_total",
        "velo_streaming_slot_credit_exhausted_total",
        "velo_streaming_mux_records_dropped_total",  # drops, by reason
        "velo_messenger_ordered_lane_wait_seconds_bucket",
        "velo_rendezvous_staged_bytes",
        "velo_transport_active_connections",
        "velo_transport_peer_refusals_total",  # handshake failures
    ):
        assert wanted in names, wanted
    drops = [expr for _, expr in dashboard_expressions() if "records_dropped" in expr]
    assert drops and all("by (reason)" in expr for expr in drops)


def test_every_expression_names_at_least_one_velomux_metric() -> None:
    for title, expr in dashboard_expressions():
        names = metric_names(expr)
        assert names, (title, expr)
        assert all(name.startswith("velo_") for name in names), (title, names)
