"""`velomux probe` as a real process against a real `velomux node` process.

Each test writes TOML files as an operator would, starts the sink with
``python -m velomux_quic.programs.cli node``, reads its ``listening`` line for its address and
InstanceId, then runs ``python -m velomux_quic.programs.cli probe`` to completion and reads its
output and exit status. Both processes speak mutual-TLS QUIC over loopback.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from velomux_quic import InstanceId, NodeCredentials
from velomux_quic.ids import new_instance_id
from velomux_quic.security.certs import CertificateAuthority, issue_node_certificate

from .test_node_command import parse_event

CHECKOUT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "velomux_quic.programs.cli"]
SECTIONS = ("identity", "throughput", "latency", "delivery", "errors")


@dataclass
class Sink:
    """A running `velomux node`: who and where it is, and the events it printed."""

    process: asyncio.subprocess.Process
    instance_id: InstanceId
    address: str
    ops: str

    async def metric(self, sample: str) -> float | None:
        """One sample's value from the sink's /metrics, None when it is absent."""
        text = await asyncio.to_thread(_get, f"http://{self.ops}/metrics")
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return None

    async def events_until(
        self, name: str, count: int, timeout: float = 20.0
    ) -> list[dict[str, str]]:
        """Read event lines until ``count`` events called ``name`` arrived (the pipe is
        the event: no sleep)."""
        assert self.process.stdout is not None
        found: list[dict[str, str]] = []
        async with asyncio.timeout(timeout):
            while len(found) < count:
                line = await self.process.stdout.readline()
                assert line, f"the sink exited before {count} {name} events: {found}"
                event = parse_event(line.decode())
                if event.get("event") == name:
                    found.append(event)
        return found


@asynccontextmanager
async def velomux_node(
    tmp_path: Path, credentials: NodeCredentials, ops: str = "off", node_keys: str = ""
) -> AsyncIterator[Sink]:
    directory = credentials.save(tmp_path / f"sink-{credentials.instance_id}")
    config = tmp_path / "sink.toml"
    config.write_text(f'[node]\ncredentials = "{directory}"\nname = "sink-0"\n{node_keys}')
    process = await asyncio.create_subprocess_exec(
        *CLI, "node", "--config", str(config), "--ops", ops,
        cwd=CHECKOUT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        async with asyncio.timeout(20):
            line = await process.stdout.readline()
        listening = parse_event(line.decode())
        assert listening.get("event") == "listening", line
        yield Sink(
            process, InstanceId.parse(listening["instance"]), listening["address"], listening["ops"]
        )
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    return text


def probe_config(
    tmp_path: Path, credentials: NodeCredentials, peers: str = "", node_keys: str = ""
) -> Path:
    directory = credentials.save(tmp_path / "probe")
    config = tmp_path / "probe.toml"
    config.write_text(f'[node]\ncredentials = "{directory}"\n{node_keys}\n{peers}')
    return config


def peer_entry(instance_id: InstanceId, address: str, name: str = "sink-0") -> str:
    return f'[[peers]]\ninstance_id = "{instance_id}"\naddress = "{address}"\nname = "{name}"\n'


async def wait_for_open_streams(sink: Sink, count: int) -> None:
    """Bounded polling of the sink's own gauge: a probe prints nothing until it ends, and
    the sink prints nothing when a stream opens."""
    async with asyncio.timeout(30):
        while await sink.metric("velomux_sink_open_streams") != count:
            await asyncio.sleep(0.05)


async def wait_for_records(sink: Sink, at_least: int) -> None:
    """Bounded polling of the sink's record counter: a stream opens before its first record
    is written, so open streams alone do not say the probe has sent anything yet."""
    async with asyncio.timeout(30):
        while (await sink.metric("velomux_sink_records_total") or 0.0) < at_least:
            await asyncio.sleep(0.05)


async def run_probe(*arguments: str, timeout: float = 40.0) -> tuple[int, str, str]:
    """One `velomux probe` run to its end: (exit status, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        *CLI, "probe", *arguments,
        cwd=CHECKOUT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.timeout(90)
@pytest.mark.one_loop
async def test_a_probe_to_a_sink_verifies_it_and_loses_nothing(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    async with velomux_node(tmp_path, make_credentials("sink")) as sink:
        config = probe_config(
            tmp_path, make_credentials("probe"), peer_entry(sink.instance_id, sink.address)
        )

        # By name, as a person runs it: every section, and the verdict.
        status, out, err = await run_probe(
            "sink-0", "--config", str(config), "--records", "300", "--streams", "3"
        )
        assert status == 0, out + err
        lines = out.splitlines()
        for section in SECTIONS:
            assert any(line.startswith(section) for line in lines), (section, out)
        assert str(sink.instance_id) in out
        assert "3 of 3 completed whole" in out
        assert lines[-1] == "result: ok"
        ends = await sink.events_until("stream_end", 3)
        assert all(e["records"] == "300" and e["outcome"] == "complete" for e in ends), ends

        # By InstanceId, for a script: one JSON object, paced, with nothing lost.
        status, out, err = await run_probe(
            str(sink.instance_id), "--config", str(config), "--json",
            "--duration", "0.5", "--rate", "2000", "--streams", "2", "--payload-bytes", "100",
        )  # fmt: skip
        assert status == 0, out + err
        report = json.loads(out)
        assert report["ok"] is True and report["exit_code"] == 0
        identity = report["identity"]
        assert identity["verified"] is True and identity["refusal"] is None
        assert identity["instance_id"] == str(sink.instance_id)
        assert identity["certificate"]["checked"] is True
        # The serial the sink reports is the one it presented in this handshake.
        assert identity["certificate"]["presented_serial"] == identity["certificate"]["serial"]
        assert identity["handshake_seconds"] > 0
        delivery = report["delivery"]
        assert delivery["records_sent"] > 0
        assert delivery["records_sent"] == delivery["records_received_by_peer"]
        assert delivery["records_sent"] == delivery["records_echoed"]
        assert delivery["records_lost"] == 0 and delivery["checksum_mismatches"] == 0
        assert delivery["streams_completed"] == delivery["streams"] == 2
        assert report["errors"] == {}
        assert report["transport"]["negotiated"] == "mux"
        latency = report["latency"]
        assert latency["samples"] == delivery["records_sent"]
        assert 0 < latency["min_ms"] <= latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
        throughput = report["throughput"]
        assert throughput["records"] == delivery["records_sent"]
        assert throughput["bytes"] == 100 * delivery["records_sent"]
        assert throughput["records_per_write"] is not None and throughput["records_per_write"] > 0

        # host:port naming another InstanceId: the certificate says who is there.
        other = new_instance_id()
        status, out, err = await run_probe(
            sink.address, "--peer-id", str(other), "--config", str(config), "--json"
        )
        assert status == 1, out + err
        refused = json.loads(out)["identity"]
        assert refused["verified"] is False
        assert refused["refusal"]["reason"] == "identity_mismatch"
        assert str(sink.instance_id) in refused["refusal"]["message"]


@pytest.mark.timeout(60)
@pytest.mark.one_loop
async def test_a_sink_whose_certificate_another_ca_issued_is_refused_with_the_reason(
    tmp_path: Path,
    make_credentials: Callable[..., NodeCredentials],
    other_ca: CertificateAuthority,
) -> None:
    foreign = issue_node_certificate(other_ca, new_instance_id(), name="foreign")
    async with velomux_node(tmp_path, foreign) as sink:
        config = probe_config(
            tmp_path, make_credentials("probe"), peer_entry(sink.instance_id, sink.address)
        )
        status, out, err = await run_probe("sink-0", "--config", str(config), "--records", "10")
        assert status == 1, out + err
        assert "REFUSED        untrusted_chain" in out
        assert "not issued by a CA this node trusts" in out
        assert out.splitlines()[-1].startswith("result: FAILED")


@pytest.mark.timeout(60)
@pytest.mark.one_loop
async def test_an_unknown_peer_or_a_bad_configuration_exits_2_with_one_line(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    config = probe_config(tmp_path, make_credentials("probe"))
    unknown = new_instance_id()
    bad = tmp_path / "bad.toml"
    bad.write_text("[transport]\nlanes = 40\n")
    for arguments, expected in (
        (["nosuch", "--config", str(config)], "unknown peer 'nosuch'"),
        ([str(unknown), "--config", str(config)], f"unknown peer {unknown}"),
        (["127.0.0.1:9", "--config", str(config)], "give its InstanceId with --peer-id"),
        (["nosuch", "--config", str(config), "--streams", "0"], "--streams must be 1"),
        (["nosuch", "--config", str(bad)], "transport.lanes"),
    ):
        status, out, err = await run_probe(*arguments)
        assert status == 2, (arguments, out, err)
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (arguments, err)


@pytest.mark.timeout(90)
@pytest.mark.one_loop
async def test_a_probe_killed_mid_run_leaves_the_sink_ready_for_the_next_one_at_once(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    """The sink adds a probe it does not know as a peer for its echo streams. A probe
    killed mid-run leaves those streams open until their watchdogs; the next probe (same
    certificate, another port) must be answered at once, not at the old address."""
    async with velomux_node(tmp_path, make_credentials("sink"), ops="127.0.0.1:0") as sink:
        config = probe_config(
            tmp_path, make_credentials("probe"), peer_entry(sink.instance_id, sink.address)
        )
        first = await asyncio.create_subprocess_exec(
            *CLI, "probe", "sink-0", "--config", str(config), "--duration", "60", "--rate", "400",
            cwd=CHECKOUT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await wait_for_open_streams(sink, 4)
            first.send_signal(signal.SIGKILL)
        finally:
            if first.returncode is None:
                first.kill()
            await first.wait()
        status, out, err = await run_probe(
            "sink-0", "--config", str(config), "--records", "50", "--json", "--timeout", "10"
        )
        assert status == 0, out + err
        report = json.loads(out)
        assert report["delivery"]["records_echoed"] == 4 * 50
        assert report["identity"]["verified"] is True


@pytest.mark.timeout(90)
@pytest.mark.one_loop
async def test_a_probe_finds_a_discovered_peer_by_name_and_ctrl_c_ends_its_window_cleanly(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    """PEER names a record the probe's discovery loaded (no [[peers]] at all); SIGINT then
    ends the streaming window early: the report still comes, whole, and every stream the
    sink read ended complete (finalized, not cut)."""
    shared = tmp_path / "peers"
    shared.mkdir()
    directory_key = f'peer_directory = "{shared}"\n'
    async with velomux_node(
        tmp_path, make_credentials("sink"), ops="127.0.0.1:0", node_keys=directory_key
    ) as sink:
        config = probe_config(tmp_path, make_credentials("probe"), node_keys=directory_key)
        process = await asyncio.create_subprocess_exec(
            *CLI, "probe", "sink-0", "--config", str(config), "--json",
            "--duration", "60", "--rate", "400", "--streams", "3",
            cwd=CHECKOUT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            await wait_for_open_streams(sink, 3)
            await wait_for_records(sink, 3)
            process.send_signal(signal.SIGINT)
            async with asyncio.timeout(30):
                out, err = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 0, out.decode() + err.decode()
        report = json.loads(out)
        assert report["interrupted"] is True and report["ok"] is True
        assert report["identity"]["instance_id"] == str(sink.instance_id)
        delivery = report["delivery"]
        assert 0 < delivery["records_sent"] == delivery["records_echoed"]
        assert delivery["records_sent"] == delivery["records_received_by_peer"]
        ends = await sink.events_until("stream_end", 3)
        assert [e["outcome"] for e in ends] == ["complete"] * 3, ends
        assert sum(int(e["records"]) for e in ends) == delivery["records_sent"]
