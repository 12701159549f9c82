"""`velomux demo` end to end: an engine and two frontend processes, certificates made on demand.

Each test runs the command as a user would (``python -m velomux_quic.programs.cli demo ...
--json``) from a scratch directory, not the checkout: everything the demo runs (the frontends, the
gRPC arm, the impairment proxy) ships in the package. It reads the one JSON object printed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from velomux_quic import runtime_info
from velomux_quic.errors import ConfigurationError
from velomux_quic.programs.demo.impair import parse_impairment

VELOMUX = [sys.executable, "-m", "velomux_quic.programs.cli"]
SMALL = ["--requests", "64", "--tokens", "16", "--timeout", "30"]
LATENCY_FIELDS = (
    "first_token_p50_ms",
    "first_token_p99_ms",
    "inter_token_p50_ms",
    "inter_token_p99_ms",
    "token_latency_p50_ms",
    "token_latency_p99_ms",
)


def run_demo(certs: Path, *arguments: str, timeout: float = 60) -> dict[str, Any]:
    tmp = certs.parent
    result = subprocess.run(
        [*VELOMUX, "demo", "--certs", str(certs), *arguments],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=tmp,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, f"--json prints one line, got {result.stdout!r}"
    document: dict[str, Any] = json.loads(lines[0])
    return document


def check_quic_row(row: dict[str, Any], requests: int, tokens: int) -> None:
    """Every token of every stream arrived, in order, and nothing was left live."""
    assert row["tokens_expected"] == requests * tokens
    assert row["tokens_delivered"] == requests * tokens
    assert row["streams_complete_in_order"] == requests
    assert row["all_complete_in_order"] is True
    assert row["retired"] == ["sent"]
    assert row["live_slots_end"] == 0
    assert row["live_senders_end"] == 0
    for field in LATENCY_FIELDS:
        assert row[field] is not None and row[field] > 0, field
    assert row["first_token_p50_ms"] <= row["first_token_p99_ms"]
    assert row["tokens_per_s"] > 0
    assert row["engine_cpu_us_per_token"] > 0 and row["frontends_cpu_us_per_token"] > 0
    assert row["datagrams_per_token"] > 0


@pytest.mark.timeout(60)
def test_demo_json_every_token_in_order_slots_back_to_zero(tmp_path: Path) -> None:
    document = run_demo(tmp_path / "certs", *SMALL, "--json")
    assert document["ok"] is True
    [row] = document["arms"]
    assert row["arm"] == "mux" and row["transport"] == "messenger-mux-v2"
    assert row["opened_with_tickets"] == 64  # every stream opened with no attach round trip
    check_quic_row(row, 64, 16)
    # 32 streams per frontend, one token each per pass: a wire write carries many records
    assert row["records_per_write"] > 1
    assert (tmp_path / "certs" / "engine" / "node.key").stat().st_mode & 0o777 == 0o600
    info = runtime_info()  # the engine and record path every process of the demo ran
    assert document["runtime"] == {
        "version": info.version,
        "engine": f"{info.quic_engine} {info.quic_engine_version}",
        "record_path": info.record_path,
    }


@pytest.mark.timeout(90)
def test_demo_compare_shows_every_arm_side_by_side(tmp_path: Path) -> None:
    document = run_demo(tmp_path / "certs", *SMALL, "--compare", "--json", timeout=80)
    assert document["ok"] is True
    rows = {row["arm"]: row for row in document["arms"]}
    check_quic_row(rows["mux"], 64, 16)
    check_quic_row(rows["per-stream"], 64, 16)
    assert rows["per-stream"]["transport"] == "quic-stream-v1"
    assert rows["per-stream"]["records_per_write"] is None  # no mux on that arm
    assert rows["per-stream"]["opened_with_tickets"] == 0  # attached: no mux, no ticket
    assert document["ratios"]["per-stream"]["tokens_per_s"] > 0
    if importlib.util.find_spec("grpc") is None:
        assert "grpc" in document["skipped"] and "grpc" not in rows
    else:
        grpc = rows["grpc"]
        assert grpc["tokens_delivered"] == 64 * 16 and grpc["all_complete_in_order"] is True
        assert grpc["streams_complete_in_order"] == 64
        for field in LATENCY_FIELDS:
            assert grpc[field] is not None and grpc[field] > 0, field
        assert grpc["tokens_per_s"] > 0 and grpc["frontends_cpu_us_per_token"] > 0
        assert document["ratios"]["grpc"]["engine_cpu_us_per_token"] is not None


@pytest.mark.timeout(60)
def test_demo_through_lossy_proxy_still_delivers_everything(tmp_path: Path) -> None:
    document = run_demo(tmp_path / "certs", *SMALL, "--impair", "loss=2%,delay=2ms", "--json")
    assert document["ok"] is True
    assert document["config"]["impair"] == {"loss": 0.02, "delay_ms": 2.0, "jitter_ms": 0.0}
    [row] = document["arms"]
    check_quic_row(row, 64, 16)
    # Both directions crossed the proxy, and it really dropped datagrams.
    proxy = row["proxy"]
    assert proxy["client_to_server"]["forwarded"] > 0
    assert proxy["server_to_client"]["forwarded"] > 0
    dropped = proxy["client_to_server"]["dropped_loss"] + proxy["server_to_client"]["dropped_loss"]
    assert dropped > 0


@pytest.mark.timeout(30)
def test_a_bad_impairment_is_a_usage_error_that_says_the_form(tmp_path: Path) -> None:
    result = subprocess.run(
        [*VELOMUX, "demo", "--certs", str(tmp_path),
         "--impair", "loss=lots"],
        capture_output=True, text=True, timeout=25, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "loss=1%,delay=5ms" in result.stderr
    assert not (tmp_path / "ca").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("loss=1%,delay=5ms", (0.01, 5.0, 0.0)),
        ("loss=0.02", (0.02, 0.0, 0.0)),
        ("delay=3ms, jitter=1ms", (0.0, 3.0, 1.0)),
    ],
)
def test_impairment_spec(spec: str, expected: tuple[float, float, float]) -> None:
    found = parse_impairment(spec)
    assert (found.loss, found.delay_ms, found.jitter_ms) == pytest.approx(expected)


@pytest.mark.parametrize("spec", ["", "loss=5ms", "delay=2%", "loss=100%", "speed=fast"])
def test_impairment_spec_refused(spec: str) -> None:
    with pytest.raises(ConfigurationError, match="--impair"):
        parse_impairment(spec)


@pytest.mark.timeout(60)
def test_demo_summary_for_a_person_without_a_terminal_has_no_live_display(tmp_path: Path) -> None:
    result = subprocess.run(
        [*VELOMUX, "demo", "--certs", str(tmp_path / "certs"),
         *SMALL, "--flush", "manual", "--lanes", "2"],
        capture_output=True, text=True, timeout=50, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "\x1b[" not in out  # stdout is a pipe: no progress bars, no escape codes
    assert "1,024 of 1,024 tokens; 64 of 64 streams complete and in order" in out
    assert "2 lanes, flush manual" in out
    info = runtime_info()
    assert f"(engine {info.quic_engine} {info.quic_engine_version}, {info.record_path}" in out
    for label in ("tokens/s", "records per write", "datagrams per token", "first token",
                  "inter-token", "CPU per token", "0 live mux slots, 0 live senders"):  # fmt: skip
        assert label in out, label
    assert out.rstrip().splitlines()[-1].startswith("demo OK in ")


@pytest.mark.timeout(60)
def test_demo_plot_draws_the_latency_cdf(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "cdf.png"
    document = run_demo(tmp_path / "certs", *SMALL, "--plot", str(plot), "--json")
    assert document["ok"] is True and document["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(30)
def test_a_load_beyond_the_memory_bound_is_refused_before_anything_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [*VELOMUX, "demo", "--certs", str(tmp_path),
         "--requests", "100000", "--tokens", "1000"],
        capture_output=True, text=True, timeout=25, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "lower --requests or --tokens" in result.stderr
    assert not (tmp_path / "ca").exists()
