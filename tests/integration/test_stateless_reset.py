"""Stateless resets between real processes: a connection whose peer lost it ends at once.

The peer (``tests.procs.resettable``) is SIGKILLed and restarted with the same
credentials on the same port, so it holds no state for the connection the test's
transport still has. That transport has a 60 s idle timeout and PINGs every 0.2 s: its
next PING reaches the restarted peer, which answers with a stateless reset (its reset key
comes from its private key, so the restarted process issues the same tokens), and the
connection must end on it, far sooner than the idle timeout would end it. Both roles: the
test's end as the client (it dialed) and as the server (which first moved to a
connection ID of the client's that carries a reset token).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import needs_derived_reset_tokens
from tests.procs.resettable import Watcher
from velomux_quic.ids import InstanceId
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport import QuicEndpoint, TransportConfig

CHECKOUT = Path(__file__).resolve().parents[2]


class Peer:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self, timeout: float = 20.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            raw = await self.process.stdout.readline()
        assert raw, "the peer process exited early"
        return dict(json.loads(raw))


@asynccontextmanager
async def peer_process(credentials: Path, *options: str) -> AsyncIterator[Peer]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.procs.resettable", "--credentials", str(credentials),
        *options, cwd=CHECKOUT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield Peer(process)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.timeout(60)
@pytest.mark.one_loop
@pytest.mark.parametrize(
    "our_role",
    ["client", pytest.param("server", marks=needs_derived_reset_tokens)],
)
async def test_a_peer_restarted_without_state_resets_the_connection_at_once(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials], our_role: str
) -> None:
    peer_dir = make_credentials("restarted").save(tmp_path / "restarted")
    watcher = Watcher()
    config = TransportConfig(idle_timeout=60.0, keep_alive_interval=0.2)
    async with await QuicEndpoint.start(
        make_credentials("survivor"), config=config, handler=watcher
    ) as survivor:
        host, port = survivor.address
        dial = ("--dial", str(survivor.instance_id), host, str(port))
        async with peer_process(peer_dir, *(dial if our_role == "server" else ())) as first:
            ready = await first.line()
            peer, peer_port = InstanceId.parse(ready["instance"]), int(ready["address"][1])
            if our_role == "client":
                survivor.register_peer(peer, (host, peer_port))
                await survivor.connect(peer)
            else:
                assert (await first.line())["event"] == "connected"
            await watcher.up.wait()
            first.process.kill()  # no CONNECTION_CLOSE: the state is simply gone
            await first.process.wait()
        assert survivor.stats.stateless_resets_received == 0
        assert len(survivor.snapshot().connections) == 1

        async with peer_process(peer_dir, "--port", str(peer_port)) as restarted:
            await restarted.line()
            async with asyncio.timeout(20):  # the idle timeout is 60 s away
                await watcher.down.wait()
        assert survivor.stats.stateless_resets_received == 1
        assert survivor.snapshot().connections == ()
