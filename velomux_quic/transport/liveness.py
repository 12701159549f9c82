"""The liveness of a node's static peers: a peer that died is found within a bound.

A QUIC connection to a peer that was killed (SIGKILL, a host that lost power) looks
established until its idle timeout (15 s by default), and a node that only listens for
frames never learns sooner; neither would ``/readyz``. For the peers a node was started
with (its configured, static peers), :class:`StaticPeerLiveness` proves every
``keep_alive_interval`` that each one with a connection this node dialed still answers: a
QUIC PING round trip, answered by the peer's QUIC stack ahead of any stream data. A peer
that does not answer within ``health_check_timeout`` is lost: its connections are closed
(the transport then logs ``peer_lost`` once, and a later send dials again), and the
``lost`` callback is told (readiness forgets its last good health answer). So a dead
static peer is reported within ``keep_alive_interval + health_check_timeout`` (10 s at
the defaults).

One task per node, one PING per static peer per interval: peers found through discovery
are not watched here (the mux's own health check covers those it streams to).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from ..ids import InstanceId
from .endpoint import QuicEndpoint

__all__ = ["StaticPeerLiveness"]

logger = logging.getLogger(__name__)


class StaticPeerLiveness:
    """Prove every interval that each static peer with a dialed connection answers."""

    def __init__(
        self,
        transport: QuicEndpoint,
        peers: Iterable[InstanceId],
        *,
        lost: Callable[[InstanceId], None] = lambda peer: None,
    ) -> None:
        self._transport = transport
        self._peers = tuple(peers)
        self._lost = lost
        self._interval = transport.config.keep_alive_interval
        self._timeout = transport.config.health_check_timeout
        self._task: asyncio.Task[None] | None = None
        self.checks = 0
        self.failures = 0

    def start(self) -> None:
        """Start watching (nothing to watch: nothing starts)."""
        if self._peers and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)  # the check's own period
            connected = [
                peer for peer in self._peers if self._transport.is_connected(peer, outbound=True)
            ]
            if connected:
                await asyncio.gather(*(self._check(peer) for peer in connected))

    async def _check(self, peer: InstanceId) -> None:
        self.checks += 1
        try:
            await self._transport.check_health(peer, timeout=self._timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._transport.closing:
                return
            self.failures += 1
            reason = f"no answer within {self._timeout:g} s ({type(exc).__name__})"
            self._transport.disconnect(peer, reason=reason)
            self._lost(peer)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
