"""OpenTelemetry tracing (the otel extra) between two real nodes, and its absence.

Each test runs ``tests/procs/traced_pair.py`` in a process of its own, so the global tracer
provider it installs (OpenTelemetry's SDK with an in-memory exporter, as an application
would) never reaches another test. The nodes talk over real QUIC; the anchor's node learns
the caller's trace context only from the request's headers (its spans' parents are
remote), as it would in another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_pair(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> list[Any]:
    base = {k: v for k, v in os.environ.items() if k != "VELOMUX_TRACING"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.procs.traced_pair", "--certs", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        env={**base, **(env or {})},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines: list[Any] = [json.loads(line) for line in result.stdout.splitlines()]
    return lines


def one(spans: list[dict[str, Any]], name: str, **attributes: str) -> dict[str, Any]:
    found = [
        span
        for span in spans
        if span["name"] == name
        and all(span["attributes"].get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, attributes, [s["name"] for s in spans])
    return found[0]


@pytest.mark.timeout(90)
def test_attach_stream_and_call_spans_share_one_trace_across_the_two_nodes(
    tmp_path: Path,
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    *spans, summary = run_pair(tmp_path, "--sdk")
    assert summary["attached"] == [0, 1, 2] and summary["streamed"] == [0, 1, 2, 3]
    engine = {"velomux.node": summary["engine"]}
    frontend = {"velomux.node": summary["frontend"]}

    # The attach: the producer's stream span, its attach, the consumer's accept and the
    # consumer's stream span, one trace; the accept's parent is the remote attach.
    stream = one(spans, "velomux.stream.send", **engine, **{"velomux.stream.open": "attach"})
    attach = one(spans, "velomux.attach", **engine)
    accept = one(spans, "velomux.attach.accept", **frontend)
    receive = one(
        spans, "velomux.stream.receive", **frontend, **{"velomux.peer": summary["engine"]}
    )
    assert {s["trace_id"] for s in (stream, attach, accept, receive)} == {stream["trace_id"]}
    assert stream["parent_id"] is None and stream["kind"] == "PRODUCER"
    assert attach["parent_id"] == stream["span_id"] and attach["kind"] == "CLIENT"
    assert accept["parent_id"] == attach["span_id"] and accept["parent_remote"] is True
    assert receive["parent_id"] == accept["span_id"] and receive["kind"] == "CONSUMER"
    assert stream["attributes"]["velomux.stream.outcome"] == "sent"
    assert stream["attributes"]["velomux.transport"] == "messenger-mux-v2"
    assert receive["attributes"]["velomux.stream.outcome"] == "finished"

    # A call and the handler that answered it.
    call = one(spans, "velomux.call echo", **engine)
    handled = one(spans, "velomux.handle echo", **frontend)
    assert handled["trace_id"] == call["trace_id"] != stream["trace_id"]
    assert handled["parent_id"] == call["span_id"] and handled["parent_remote"] is True

    # A request carrying a ticket: the frontend's span, its pre-bound stream, its call, the
    # engine's handler and the stream it opened from the ticket are one trace.
    request = one(spans, "frontend request")
    ticketed = one(spans, "velomux.stream.send", **engine, **{"velomux.stream.open": "ticket"})
    generate = one(spans, "velomux.handle generate", **engine)
    prebound = one(spans, "velomux.stream.receive", **frontend, **{"velomux.peer": "pre-bound"})
    together = (request, one(spans, "velomux.call generate"), generate, ticketed, prebound)
    assert {s["trace_id"] for s in together} == {request["trace_id"]}
    assert ticketed["parent_id"] == generate["span_id"]
    assert ticketed["attributes"]["velomux.stream.outcome"] == "sent"
    assert "_traceparent" in summary["reserved_headers"]
    assert all(span["status"] != "ERROR" for span in spans)
    assert Counter(span["name"] for span in spans)["velomux.stream.send"] == 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["not installed", "switched off"])
def test_without_the_extra_nothing_of_opentelemetry_is_imported_and_all_works(
    tmp_path: Path, how: str
) -> None:
    if how == "not installed":
        *spans, summary = run_pair(tmp_path, "--no-otel")
    else:
        *spans, summary = run_pair(tmp_path, env={"VELOMUX_TRACING": "off"})
    assert spans == []
    assert summary["attached"] == [0, 1, 2] and summary["streamed"] == [0, 1, 2, 3]
    assert summary["echoed"] == "hi" and summary["reply"] == "done"
    assert summary["otel_modules"] == []
    assert summary["reserved_headers"] == ["_mux_slot"]  # no trace header was registered


@pytest.mark.timeout(90)
def test_with_the_extra_and_no_provider_set_no_span_work_is_done_and_all_works(
    tmp_path: Path,
) -> None:
    *spans, summary = run_pair(tmp_path)
    assert spans == []
    assert summary["attached"] == [0, 1, 2] and summary["streamed"] == [0, 1, 2, 3]
    assert summary["echoed"] == "hi" and summary["reply"] == "done"
    assert "_traceparent" in summary["reserved_headers"]  # the hooks are in place
    assert summary["otel_calls"] == {"noop_spans": 0, "context_attaches": 0, "propagations": 0}


@pytest.mark.timeout(90)
def test_tracing_switched_on_goes_through_the_no_op_provider(tmp_path: Path) -> None:
    # The counting above sees the API's no-op work when there is some: here, forced.
    *spans, summary = run_pair(tmp_path, env={"VELOMUX_TRACING": "on"})
    assert spans == []
    assert summary["streamed"] == [0, 1, 2, 3] and summary["reply"] == "done"
    calls = summary["otel_calls"]
    assert calls["noop_spans"] >= 6 and calls["context_attaches"] > 0 and calls["propagations"] > 0


@pytest.mark.timeout(90)
def test_a_provider_set_after_the_nodes_started_records_what_follows(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk")
    *spans, summary = run_pair(tmp_path, "--sdk-late")
    assert summary["otel_calls"] == {"noop_spans": 0, "context_attaches": 0, "propagations": 0}
    names = Counter(span["name"] for span in spans)
    assert names["velomux.attach"] == 0 and names["velomux.attach.accept"] == 0  # before it
    engine = {"velomux.node": summary["engine"]}
    call = one(spans, "velomux.call echo", **engine)
    handled = one(spans, "velomux.handle echo", **{"velomux.node": summary["frontend"]})
    assert handled["parent_id"] == call["span_id"] and handled["parent_remote"] is True
    ticketed = one(spans, "velomux.stream.send", **engine, **{"velomux.stream.open": "ticket"})
    generate = one(spans, "velomux.handle generate", **engine)
    request = one(spans, "frontend request")
    assert ticketed["parent_id"] == generate["span_id"]
    assert ticketed["trace_id"] == generate["trace_id"] == request["trace_id"]
    assert ticketed["attributes"]["velomux.stream.outcome"] == "sent"
    one(spans, "velomux.stream.receive", **{"velomux.peer": "pre-bound"})
