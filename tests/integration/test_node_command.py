"""`velomux node --config node.toml` as a real process: a stream into its sink, then SIGTERM.

The test starts the command as an operator would (``python -m velomux_quic.programs.cli node``),
reads its structured event lines, reaches it from a node of its own over mutual-TLS QUIC
(both certificates from one CA), streams into the sink and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from velomux_quic import (
    InstanceId,
    NodeCredentials,
    StreamAnchorHandle,
    StreamOpenTicket,
    open_node,
)

CHECKOUT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "velomux_quic.programs.cli", "node"]


def parse_event(line: str) -> dict[str, str]:
    """The key=value pairs of one event line (quoted values are JSON strings)."""
    fields: dict[str, str] = {}
    rest = line.strip()
    while rest:
        key, _, rest = rest.partition("=")
        if rest.startswith('"'):
            value, end = json.JSONDecoder().raw_decode(rest)
            rest = rest[end:].lstrip()
        else:
            value, _, rest = rest.partition(" ")
        fields[key] = value
    return fields


class ServiceProcess:
    """A running `velomux node` and the events it printed so far."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.events: list[dict[str, str]] = []

    async def next_event(self, name: str, timeout: float = 20.0) -> dict[str, str]:
        """Read lines until an event of that name arrives (no sleep: the pipe is the event)."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await self.process.stdout.readline()
                assert line, f"the node exited before {name}: {self.events}"
                event = parse_event(line.decode())
                self.events.append(event)
                if event.get("event") == name:
                    return event


@asynccontextmanager
async def velomux_node(config: Path, *options: str) -> AsyncIterator[ServiceProcess]:
    process = await asyncio.create_subprocess_exec(
        *COMMAND, "--config", str(config), *options,
        cwd=CHECKOUT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield ServiceProcess(process)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.timeout(30)
def test_a_bad_configuration_exits_2_with_one_line_naming_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text("[transport]\nlanes = 40\n")
    result = subprocess.run(
        [*COMMAND, "--config", str(config)],
        capture_output=True, text=True, timeout=25, check=False, cwd=CHECKOUT,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(config) in lines[0] and "transport.lanes" in lines[0]
    assert result.stdout == ""


@pytest.mark.timeout(30)
def test_missing_credentials_exit_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ncredentials = "{tmp_path / "absent"}"\n')
    result = subprocess.run(
        [*COMMAND, "--config", str(config)],
        capture_output=True, text=True, timeout=25, check=False, cwd=CHECKOUT,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "absent" in lines[0], result.stderr


@pytest.mark.timeout(30)
def test_a_deprecated_variable_is_read_and_says_what_replaces_it(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ncredentials = "{tmp_path / "absent"}"\n')
    result = subprocess.run(
        [*COMMAND, "--config", str(config)],
        capture_output=True, text=True, timeout=25, check=False, cwd=CHECKOUT,
        env={**os.environ, "VELOMUX_MUX_DISABLE": "1"},
    )  # fmt: skip
    assert result.returncode == 2  # the credentials are missing: the loader ran first
    warning, error = result.stderr.strip().splitlines()
    fields = parse_event(warning)
    assert (fields["event"], fields["level"], fields["logger"]) == ("log", "warning", "py.warnings")
    assert "VELOMUX_MUX_DISABLE is deprecated" in fields["message"]
    assert "VELOMUX_MUX_ENABLED=false" in fields["message"]
    assert "absent" in error


def http_get(host: str, port: int, path: str) -> tuple[int, str]:
    """One GET with the standard library, as an operator's scraper would send it."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.timeout(60)
@pytest.mark.one_loop
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
async def test_a_stream_into_the_sink_then_a_stop_signal_exits_0(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials], stop_signal: signal.Signals
) -> None:
    service_dir = make_credentials("sink").save(tmp_path / "sink")
    async with open_node(make_credentials("producer")) as producer:
        config = tmp_path / "node.toml"
        host, port = producer.address
        config.write_text(
            f'[node]\ncredentials = "{service_dir}"\nname = "sink-0"\n\n'
            f'[[peers]]\ninstance_id = "{producer.instance_id}"\n'
            f'address = "{host}:{port}"\nname = "producer"\n\n'
            "[transport]\nlanes = 2\n"
        )
        async with velomux_node(config, "--drain-timeout", "2") as service:
            listening = await service.next_event("listening")
            assert listening["name"] == "sink-0" and listening["lanes"] == "2"
            sink = InstanceId.parse(listening["instance"])
            sink_host, _, sink_port = listening["address"].rpartition(":")
            producer.add_peer(sink, (sink_host, int(sink_port)), "sink-0")

            reply = json.loads(await producer.call(sink, "velomux.sink", b"", timeout=20))
            assert reply["ticket"] is not None  # the mux runs: a zero-RTT ticket
            sender = await producer.open_anchor_stream(
                StreamAnchorHandle(reply["handle"]),
                StreamOpenTicket.decode(bytes.fromhex(reply["ticket"])),
            )
            for token in range(200):
                await sender.send({"token": token})
            await sender.finalize()
            ended = await service.next_event("stream_end")
            assert ended == {**ended, "records": "200", "outcome": "complete"}
            assert ended["peer"] == str(producer.instance_id)

            # The service's own operations endpoints (on by default in `velomux node`).
            ops_host, _, ops_port = listening["ops"].rpartition(":")
            metrics = await asyncio.to_thread(http_get, ops_host, int(ops_port), "/metrics")
            assert metrics[0] == 200
            assert "velo_streaming_mux_records_total" in metrics[1]
            assert "velomux_sink_records_total 200.0" in metrics[1]
            ready = await asyncio.to_thread(http_get, ops_host, int(ops_port), "/readyz")
            assert ready[0] == 200, ready

            # A second stream is still open when the node is told to stop.
            second = json.loads(await producer.call(sink, "velomux.sink", b"", timeout=20))
            open_sender = await producer.attach_anchor(StreamAnchorHandle(second["handle"]))
            await open_sender.send({"token": 0})

            service.process.send_signal(stop_signal)
            stopping = await service.next_event("stopping")
            assert stopping == {**stopping, "signal": stop_signal.name, "open_streams": "1"}
            await service.next_event("stopped")
            async with asyncio.timeout(10):
                assert await service.process.wait() == 0
            ends = [e for e in service.events if e.get("event") == "stream_end"]
            assert len(ends) == 2, service.events
            assert ends[1] == {**ends[1], "records": "1", "outcome": "cut_by_shutdown"}
            stopped = service.events[-1]
            assert stopped == {**stopped, "event": "stopped", "drained": "False"}
