"""The probe's pure parts: option bounds, the latency reservoir, the text for a refusal."""

from __future__ import annotations

import pytest

from velomux_quic.errors import ConfigurationError
from velomux_quic.programs.probe import MAX_STREAMS, LatencySamples, ProbeOptions, render_text


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"streams": 0}, "--streams must be 1"),
        ({"streams": MAX_STREAMS + 1}, "--streams must be 1"),
        ({"duration": 0.0}, "--duration must be above 0"),
        ({"duration": None}, "give one of --duration and --records"),
        ({"duration": 1.0, "records": 5}, "give one of --duration and --records"),
        ({"duration": None, "records": 0}, "--records must be 1"),
        ({"rate": 0.0}, "--rate must be above 0"),
        ({"payload_bytes": 15}, "--payload-bytes must be 16"),
        ({"timeout": 0.0}, "--timeout must be above 0"),
    ],
)
def test_options_out_of_bounds_say_which_flag(options: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        ProbeOptions(**options)  # type: ignore[arg-type]


def test_latency_percentiles_are_nearest_rank_over_the_samples() -> None:
    samples = LatencySamples()
    for value in range(1, 101):  # 1..100 ms
        samples.add(value * 1_000_000)
    summary = samples.summary()
    assert summary["samples"] == 100
    assert summary["p50_ms"] == 51.0 and summary["p99_ms"] == 100.0
    assert summary["min_ms"] == 1.0 and summary["max_ms"] == 100.0


def test_the_reservoir_stays_bounded_and_keeps_exact_extremes() -> None:
    samples = LatencySamples(capacity=1000)
    for value in range(100_000):
        samples.add(value)
    assert len(samples.samples) == 1000 and samples.count == 100_000
    assert samples.low == 0 and samples.high == 99_999
    # A uniform sample of 0..99,999: its median is near the middle.
    median = samples.summary()["p50_ms"] * 1e6
    assert 40_000 < median < 60_000


def test_no_samples_give_no_percentiles() -> None:
    summary = LatencySamples().summary()
    assert summary["p50_ms"] is None and summary["p99_ms"] is None and summary["samples"] == 0


def test_a_refused_identity_prints_the_reason_and_fails() -> None:
    report = {
        "peer": {"requested": "sink-0", "instance_id": "7f3c", "name": "sink-0", "address": None},
        "run": {
            "streams": 1, "duration_seconds": 1.0, "records_per_stream": None,
            "rate": None, "payload_bytes": 64,
        },
        "identity": {
            "verified": False, "instance_id": None, "trust_domain": "velomux.local",
            "handshake_seconds": None, "certificate": None,
            "refusal": {"reason": "untrusted_chain", "message": "not issued by a CA we trust"},
        },
    }  # fmt: skip
    text = render_text(report)
    assert "REFUSED        untrusted_chain: not issued by a CA we trust" in text
    assert text.splitlines()[-1] == "result: FAILED (identity not verified)"
