"""`velomux demo` end to end: two processes, certificates made on demand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_demo_streams_every_token_in_order_between_two_processes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "velomux_quic.cli", "demo", "--certs", str(tmp_path / "certs"),
         "--streams", "32", "--tokens", "20", "--timeout", "60"],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo OK" in result.stdout
    assert "640 tokens" in result.stdout and "every stream in order: True" in result.stdout
    assert "opened 32 streams (32 with zero-RTT tickets)" in result.stdout
    assert (tmp_path / "certs" / "node-a" / "node.key").stat().st_mode & 0o777 == 0o600
