"""`velomux node` reloads its credentials on SIGHUP, as a real process: a renewed
certificate is taken for new connections, a garbled one is refused and the node keeps
running on what it had."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_node_command import http_get, velomux_node
from velomux_quic.ids import InstanceId, new_instance_id
from velomux_quic.node import Node, open_node
from velomux_quic.programs.cli import main
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)


def serial(directory: Path) -> str:
    return f"{NodeCredentials.load(directory).certificate.serial_number:x}"


async def presented_by(producer: Node, sink: InstanceId) -> str | None:
    """Call the sink over a NEW connection; the serial of the certificate it presented.

    Only the producer's dialed connection is replaced: the sink answers on the one it
    dialed back, which must stay up (an answer sent on a connection being closed is lost).
    """
    producer.messenger.transport.disconnect(sink, inbound=False)
    async with asyncio.timeout(20):
        while producer.snapshot().transport.to(sink) is not None:
            await asyncio.sleep(0.01)  # no event for "the old connection is gone"
        await producer.call(sink, "velomux.sink", b"", timeout=20)
    connection = producer.snapshot().transport.to(sink)
    assert connection is not None and connection.state == "established"
    return connection.peer_certificate_serial


@pytest.mark.timeout(90)
@pytest.mark.one_loop
async def test_sighup_takes_a_renewed_certificate_and_survives_a_garbled_one(
    tmp_path: Path, ca: CertificateAuthority, make_credentials: Callable[..., NodeCredentials]
) -> None:
    ca.save(tmp_path / "ca")
    sink_dir = issue_node_certificate(ca, new_instance_id(), name="sink").save(tmp_path / "sink")
    async with open_node(make_credentials("producer")) as producer:
        config = tmp_path / "node.toml"
        host, port = producer.address
        config.write_text(
            f'[node]\ncredentials = "{sink_dir}"\nname = "sink-0"\n\n'
            f'[[peers]]\ninstance_id = "{producer.instance_id}"\n'
            f'address = "{host}:{port}"\nname = "producer"\n'
        )
        async with velomux_node(config, "--drain-timeout", "2") as service:
            listening = await service.next_event("listening")
            sink = InstanceId.parse(listening["instance"])
            sink_host, _, sink_port = listening["address"].rpartition(":")
            producer.add_peer(sink, (sink_host, int(sink_port)), "sink-0")
            old = serial(sink_dir)
            assert await presented_by(producer, sink) == old

            # A renewed certificate, then SIGHUP: new connections present it.
            assert (
                main(["certs", "renew", "--ca", str(tmp_path / "ca"), "--node-dir", str(sink_dir)])
                == 0
            )
            new = serial(sink_dir)
            service.process.send_signal(signal.SIGHUP)
            reloaded = await service.next_event("credentials_reloaded")
            assert reloaded["serial"] == new != old
            expected_end = NodeCredentials.load(sink_dir).certificate.not_valid_after_utc
            assert reloaded["not_after"] == expected_end.strftime("%Y-%m-%dT%H:%M:%SZ")
            assert await presented_by(producer, sink) == new

            # A garbled certificate file: refused, one line, the node keeps running on `new`.
            (sink_dir / "node.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\ngarbage\n")
            service.process.send_signal(signal.SIGHUP)
            failed = await service.next_event("credentials_reload_failed")
            assert "node.pem" in failed["reason"]
            assert "keeps its current credentials" in failed["reason"]
            assert service.process.returncode is None
            assert await presented_by(producer, sink) == new

            ops_host, _, ops_port = listening["ops"].rpartition(":")
            status, metrics = await asyncio.to_thread(http_get, ops_host, int(ops_port), "/metrics")
            assert status == 200
            assert (
                'velo_transport_credential_reloads_total{outcome="ok",transport="quic"} 1.0'
                in metrics
            )
            assert (
                'velo_transport_credential_reloads_total{outcome="refused",transport="quic"} 1.0'
                in metrics
            )

            service.process.send_signal(signal.SIGTERM)
            await service.next_event("stopped")
            async with asyncio.timeout(10):
                assert await service.process.wait() == 0
