"""What ``/readyz`` answers: whether a node can do its job, and why not.

A node is ready when its endpoint is bound, its discovery backend is connected (for a
backend that reports it), and every peer it was configured with is reachable: a live
outbound connection, or a ``_health`` answer within ``OpsConfig.health_fresh_seconds``;
otherwise a health check bounded by ``OpsConfig.readiness_timeout`` is made. The policy
reads the node through callables and a health checker, so it holds no layer of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import VelomuxError
from ..ids import InstanceId
from .config import OpsConfig

__all__ = ["HealthChecker", "PeerReadiness", "ReadinessReport"]


@dataclass(frozen=True, slots=True)
class ReadinessReport:
    """The answer of one readiness evaluation (the ``/readyz`` body)."""

    ready: bool
    checks: dict[str, Any] = field(default_factory=dict)
    """Each check's name and result: ``"ok"`` or the reason it is not."""
    not_ready: tuple[str, ...] = ()
    """The names of the checks that failed."""

    def to_json(self) -> dict[str, Any]:
        """The JSON body ``/readyz`` answers."""
        return {
            "status": "ready" if self.ready else "not ready",
            "not_ready": list(self.not_ready),
            "checks": self.checks,
        }


class HealthChecker(Protocol):
    """What readiness needs from the node's messenger (its ``check_health``)."""

    async def check_health(self, peer: InstanceId, timeout: float | None = None) -> None:
        """Raise when ``peer`` does not answer a health check in ``timeout`` seconds."""


class PeerReadiness:
    """The readiness of one node: bound, discovery connected, configured peers reachable.

    ``endpoint_bound`` says whether the QUIC endpoint still listens;
    ``discovery_connected`` is None for a node without discovery, else says whether its
    backend is connected; ``connected_peers`` names the peers with a live outbound
    connection (from the node's snapshot). Peers not connected get one health check,
    all of them at once, bounded by ``OpsConfig.readiness_timeout``; one evaluation runs
    at a time and concurrent probes share it, so a flood of probes costs one round.
    """

    def __init__(
        self,
        *,
        required_peers: Iterable[InstanceId],
        health: HealthChecker,
        endpoint_bound: Callable[[], bool],
        connected_peers: Callable[[], set[InstanceId]],
        discovery_connected: Callable[[], bool] | None,
        config: OpsConfig,
    ) -> None:
        self.required_peers = tuple(required_peers)
        self._health = health
        self._endpoint_bound = endpoint_bound
        self._connected_peers = connected_peers
        self._discovery_connected = discovery_connected
        self._config = config
        self._last_healthy: dict[InstanceId, float] = {}
        self._running: asyncio.Future[ReadinessReport] | None = None

    async def evaluate(self) -> ReadinessReport:
        """Evaluate readiness (or join the evaluation in progress)."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._evaluate())
        return await asyncio.shield(self._running)

    def forget(self, peer: InstanceId) -> None:
        """``peer`` was found dead: its last good health answer no longer counts."""
        self._last_healthy.pop(peer, None)

    async def close(self) -> None:
        """Cancel an evaluation in progress (the node is closing)."""
        if self._running is not None and not self._running.done():
            self._running.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._running

    async def _evaluate(self) -> ReadinessReport:
        checks: dict[str, Any] = {}
        bound = self._endpoint_bound()
        checks["endpoint"] = "ok" if bound else "not bound"
        if self._discovery_connected is not None:
            checks["discovery"] = "ok" if self._discovery_connected() else "not connected"
        peers: dict[str, str] = {}
        if bound:
            connected = self._connected_peers()
            now = time.monotonic()
            pending: list[InstanceId] = []
            for peer in self.required_peers:
                fresh = (
                    now - self._last_healthy.get(peer, -1e18) < self._config.health_fresh_seconds
                )
                if peer in connected or fresh:
                    peers[str(peer)] = "ok"
                else:
                    pending.append(peer)
            if pending:
                results = await asyncio.gather(
                    *(self._check(peer) for peer in pending), return_exceptions=False
                )
                for peer, result in zip(pending, results, strict=True):
                    peers[str(peer)] = result
        else:
            peers = {str(peer): "endpoint not bound" for peer in self.required_peers}
        if peers:
            checks["peers"] = peers
        not_ready = [name for name in ("endpoint", "discovery") if checks.get(name, "ok") != "ok"]
        not_ready += [f"peer {peer}" for peer, result in peers.items() if result != "ok"]
        return ReadinessReport(ready=not not_ready, checks=checks, not_ready=tuple(not_ready))

    async def _check(self, peer: InstanceId) -> str:
        timeout = self._config.readiness_timeout
        try:
            async with asyncio.timeout(timeout):
                await self._health.check_health(peer, timeout=timeout)
        except TimeoutError:
            return f"no health answer within {timeout:g}s"
        except VelomuxError as error:
            return f"unreachable: {type(error).__name__}: {error}"
        self._last_healthy[peer] = time.monotonic()
        return "ok"
