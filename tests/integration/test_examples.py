"""The programs under examples/ run as a user runs them: a separate process, root imports only.

Each test runs one example with the test's interpreter from a scratch directory (not the
source tree, so the package is found the way a user's program finds it) and checks the
lines it prints: the examples check themselves too and end with ``<name> OK``.
"""

from __future__ import annotations

import ast
import re
import selectors
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROGRAMS = sorted(path.name for path in EXAMPLES.glob("*.py"))


def run_example(name: str, tmp_path: Path, *args: str) -> list[str]:
    """Run ``examples/<name>`` to the end; its stdout lines (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        cwd=tmp_path,  # not the source tree: the package is found as a user finds it
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def library_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("velomux_quic")
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("velomux_quic")
    ]


def test_every_example_promised_is_there() -> None:
    assert set(PROGRAMS) >= {
        "quickstart.py",
        "engine.py",
        "frontend.py",
        "mpsc_fan_in.py",
        "keyed_lanes.py",
        "bounded_consumer.py",
        "error_handling.py",
    }
    assert (EXAMPLES / "grpc_to_velomux.md").is_file()
    index = (EXAMPLES / "README.md").read_text()
    for name in [*PROGRAMS, "grpc_to_velomux.md"]:
        assert f"]({name})" in index, f"examples/README.md does not list {name}"


@pytest.mark.parametrize("name", PROGRAMS)
def test_an_example_imports_nothing_but_the_package_root(name: str) -> None:
    assert library_imports(EXAMPLES / name) == ["velomux_quic"]


@pytest.mark.timeout(120)
def test_the_quickstart_streams_a_requests_tokens_and_catches_the_misuses(tmp_path: Path) -> None:
    lines = run_example("quickstart.py", tmp_path, str(tmp_path / "certs"))
    assert "second prebind refused: TicketError" in lines
    assert "engine replied {'sent': 12}; frontend read 12 tokens" in lines
    assert "first {'index': 0, 'text': 'token-0'}, last {'index': 11, 'text': 'token-11'}" in lines
    assert "unknown handler refused: UnknownHandler" in lines
    assert lines[-1] == "quickstart OK"


def first_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The first line ``process`` prints, waiting at most ``timeout`` seconds for it."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise AssertionError(f"no line from {process.args} within {timeout} s")
    return process.stdout.readline().rstrip("\n")


@pytest.mark.timeout(120)
def test_an_engine_process_streams_tokens_to_a_frontend_process(tmp_path: Path) -> None:
    requests, tokens = 12, 20
    certs = tmp_path / "certs"
    engine_args = ["--certs", str(certs), "--exit-after", str(requests)]
    with subprocess.Popen(
        [sys.executable, str(EXAMPLES / "engine.py"), *engine_args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as engine:
        try:
            ready = first_line(engine, 60)
            found = re.fullmatch(
                r"engine ready: python examples/frontend.py --certs (\S+) "
                r"--engine ([0-9a-f-]{36}) --address (127\.0\.0\.1:\d+)",
                ready,
            )
            assert found, ready
            assert found[1] == str(certs)
            lines = run_example(
                "frontend.py",
                tmp_path,
                *("--certs", found[1], "--engine", found[2], "--address", found[3]),
                *("--requests", str(requests), "--tokens", str(tokens)),
            )
            assert (
                f"frontend: {requests} requests x {tokens} tokens from engine {found[2]}" in lines
            )
            everything = (
                rf"delivered {requests * tokens} tokens in [\d.]+ s, "
                r"every stream complete and in order: True"
            )
            assert any(re.fullmatch(everything, line) for line in lines), lines
            assert any(
                re.fullmatch(r"first token p50 [\d.]+ ms, p99 .* ms", line) for line in lines
            )
            assert "live ingress slots after the run: 0" in lines
            assert lines[-1] == "frontend OK"

            rest, engine_err = engine.communicate(timeout=60)
            assert engine.returncode == 0, engine_err
            summary = rest.splitlines()[-1]
            assert summary.startswith(
                f"engine done: {requests} streams, {requests * tokens} tokens"
            )
            assert summary.endswith("live egress slots 0")
        finally:
            if engine.poll() is None:
                engine.kill()


@pytest.mark.timeout(120)
def test_mpsc_fan_in_reads_four_producers_and_their_departures(tmp_path: Path) -> None:
    lines = run_example("mpsc_fan_in.py", tmp_path, str(tmp_path / "certs"))
    assert "4 producers attached, sender ids [1, 2, 3, 4]" in lines
    assert "fifth attach refused: MaxSendersReached" in lines
    assert "collector read 80 items from 4 producers, each in its order: True" in lines
    assert "events: ['detached', 'detached', 'detached', 'dropped', 'sender_error']" in lines
    assert "soft error: a1: one item of the batch was skipped" in lines
    assert lines[-1] == "mpsc fan-in OK"


@pytest.mark.timeout(120)
def test_keyed_lanes_keep_a_key_on_one_lane_and_the_snapshot_agrees(tmp_path: Path) -> None:
    lines = run_example("keyed_lanes.py", tmp_path, str(tmp_path / "certs"))
    lanes = {
        int(m[1]): int(m[2])
        for line in lines
        if (m := re.fullmatch(r"key (\d+): lane (\d+)", line))
    }
    assert set(lanes) == {1, 2, 3} and all(0 <= lane < 4 for lane in lanes.values())
    assert "every key kept to one lane: True" in lines
    assert "snapshot agrees with sender.lane: True" in lines
    loads = next(line for line in lines if line.startswith("consumer's lane loads"))
    assert sum(int(n) for n in re.findall(r"\d+", loads.split(":")[1])) == 10
    assert any(
        line.endswith("producer's live slots after: {0: 0, 1: 0, 2: 0, 3: 0}") for line in lines
    )
    assert lines[-1] == "keyed lanes OK"


@pytest.mark.timeout(120)
def test_a_consumer_that_stops_reading_stalls_only_its_own_producer(tmp_path: Path) -> None:
    lines = run_example("bounded_consumer.py", tmp_path, str(tmp_path / "certs"))
    assert "slow stream: credit 8 before the first send" in lines
    refused = next(line for line in lines if line.startswith("slow stream: send refused"))
    assert refused.endswith(": SendTimeout")
    assert any(
        line.startswith("  message: no room on the stream") and "retry" in line for line in lines
    )
    stalled = next(line for line in lines if line.startswith("slow stream: credit 0, "))
    assert stalled.endswith("8 records buffered at the consumer")
    assert "fast stream, same peer, meanwhile: 200 records delivered: True" in lines
    assert "slow stream's next send still waiting: True" in lines
    assert lines[-1] == "bounded consumer OK"


@pytest.mark.timeout(120)
def test_every_misuse_gets_its_typed_error_and_advice(tmp_path: Path) -> None:
    lines = run_example("error_handling.py", tmp_path, str(tmp_path / "certs"))
    raised = [line.strip() for line in lines if " > " in line]
    classes = [line.split(" > ")[1].split(":")[0] for line in raised]
    assert classes == [
        "ConfigurationError",
        "CredentialsError",
        "AnchorNotFound",
        "WrongHandleKind",
        "TicketError",
        "UnknownHandler",
        "HandlerFailed",
        "ChannelClosed",
        "ReadTimeout",
        "UsageError",
    ]
    assert "TransportError & SendError > ChannelClosed: the stream has ended" in raised
    assert sum(line.startswith("  -> ") for line in lines) == len(classes)
    assert "caught by its branch: except AttachError -> AnchorNotFound" in lines
    assert lines[-1] == "error handling OK"
