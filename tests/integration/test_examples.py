"""The programs under examples/ run as a user runs them: a separate process, root imports only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_quickstart_imports_nothing_but_the_package_root() -> None:
    tree = ast.parse((EXAMPLES / "quickstart.py").read_text())
    library_imports = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("velomux_quic")
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("velomux_quic")
    ]
    assert library_imports == ["velomux_quic"]


@pytest.mark.timeout(120)
def test_the_quickstart_streams_a_requests_tokens_and_catches_the_misuses(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), str(tmp_path / "certs")],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        cwd=tmp_path,  # not the source tree: the package is found as a user finds it
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "second prebind refused: TicketError" in lines
    assert "engine replied {'sent': 12}; frontend read 12 tokens" in lines
    assert "first {'index': 0, 'text': 'token-0'}, last {'index': 11, 'text': 'token-11'}" in lines
    assert "unknown handler refused: UnknownHandler" in lines
    assert lines[-1] == "quickstart OK"
