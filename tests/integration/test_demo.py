"""`velomux demo` end to end: two processes, certificates made on demand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_demo_runs_two_nodes_and_reports_every_lane_in_order(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "velomux_quic.cli",
            "demo",
            "--certs",
            str(tmp_path / "certs"),
            "--frames",
            "4000",
            "--lanes",
            "3",
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo OK" in result.stdout
    assert result.stdout.count("in order: True") == 3
    assert (tmp_path / "certs" / "node-a" / "node.key").stat().st_mode & 0o777 == 0o600
