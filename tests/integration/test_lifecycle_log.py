"""A node's own account of its life, read from its log at INFO: start, the address it
listens on, a static peer connected, an attach it refused, that peer lost (SIGKILL) within
the health-check bound with /readyz saying so, drain and close; each event exactly once,
and no warning on the way (an orderly close after a peer died says nothing alarming)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_node_command import http_get, velomux_node
from velomux_quic import InstanceId, NodeCredentials, PeerRecord, StreamAnchorHandle
from velomux_quic.errors import HandlerFailed
from velomux_quic.node import Node
from velomux_quic.programs.sink import ECHO_HANDLER, INFO_HANDLER
from velomux_quic.transport import TransportConfig

INTERVAL = 0.5
"""keep_alive_interval: how often the node proves its static peers answer."""
TIMEOUT = 0.5
"""health_check_timeout: how long a proof may take."""

EVENTS = (
    "node_start",
    "node_listening",
    "peer_connected",
    "attach_refused",
    "peer_lost",
    "node_drain",
    "node_close",
)


def _events(records: list[logging.LogRecord]) -> list[tuple[str, dict[str, object]]]:
    return [
        (record.event, record.fields)  # type: ignore[attr-defined]
        for record in records
        if record.name.startswith("velomux_quic")
        and record.levelno >= logging.INFO
        and hasattr(record, "event")
    ]


@pytest.mark.timeout(60)
@pytest.mark.one_loop
async def test_a_nodes_log_tells_its_life_once_per_event(
    tmp_path: Path,
    make_credentials: Callable[..., NodeCredentials],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="velomux_quic")
    make_credentials("peer").save(tmp_path / "peer")
    config = tmp_path / "peer.toml"
    config.write_text(f'[node]\ncredentials = "{tmp_path / "peer"}"\n')
    loop = asyncio.get_running_loop()
    async with velomux_node(config, "--ops", "off") as peer_process:
        listening = await peer_process.next_event("listening")
        peer = InstanceId.parse(listening["instance"])
        host, _, port = listening["address"].rpartition(":")
        node = await Node.start(
            make_credentials("node"),
            peers=[PeerRecord(peer, (host, int(port)))],
            transport=TransportConfig(keep_alive_interval=INTERVAL, health_check_timeout=TIMEOUT),
        )
        try:
            ops_host, ops_port = await node.serve_ops()
            assert json.loads(await node.call(peer, INFO_HANDLER, b"{}", timeout=10))
            # The peer attaches to an anchor this node never had: refused here.
            missing = StreamAnchorHandle.pack(node.worker_id, 12345)
            request = {
                "run": "r",
                "stream": 0,
                "handle": missing.value,
                "ticket": None,
                "reply_to": f"{node.address[0]}:{node.address[1]}",
            }
            with pytest.raises(HandlerFailed):
                await node.call(peer, ECHO_HANDLER, json.dumps(request).encode(), timeout=10)
            code, _ = await loop.run_in_executor(None, http_get, ops_host, ops_port, "/readyz")
            assert code == 200

            peer_process.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            async with asyncio.timeout(10):
                while "peer_lost" not in [event for event, _ in _events(caplog.records)]:
                    await asyncio.sleep(0.05)  # the log has no event to await
            detected = time.monotonic() - killed
            code, body = await loop.run_in_executor(None, http_get, ops_host, ops_port, "/readyz")
            assert code == 503 and str(peer) in body
            assert await node.drain(1.0)
        finally:
            await node.close()
    events = _events(caplog.records)
    names = [event for event, _ in events]
    print(f"\npeer_lost {detected:.2f} s after SIGKILL; events: {names}")
    for name in EVENTS:
        assert names.count(name) == 1, (name, names)
    fields = dict(events)
    assert fields["peer_connected"]["peer"] == peer
    assert fields["peer_connected"]["address"] == f"{host}:{port}"
    assert fields["peer_lost"]["peer"] == peer
    assert fields["node_listening"]["address"] == f"{node.address[0]}:{node.address[1]}"
    assert fields["attach_refused"]["peer"] == peer
    # Within the bound: one interval to the next check, then the check's timeout (and the
    # loop's own scheduling, on a loaded machine).
    assert detected <= INTERVAL + TIMEOUT + 1.0, detected
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("velomux_quic") and r.levelno >= logging.WARNING
    ]
    assert warnings == []
