"""The producer side's peer health check: a dead consumer node is epoch death.

A producer whose slots hold no credit sends nothing, so nothing it does would ever fail
if the consumer's node died: its senders would wait on credit forever. While any batcher
to a peer has live slots, one task per peer (not per lane, stream or record) checks the
transport to that peer every ``health_check_interval``: a QUIC PING round trip on the
connection the batches ride, answered by the peer's QUIC stack as soon as the packet
arrives. A failed or late answer is epoch death on every lane to that peer: the slots
close, their producers' cancel and stop tokens fire, their next sends fail. The check does
not change the negotiated transport or permit a fallback. The task ends by itself once no
batcher to the peer has live slots.

Why not a ``_health`` message: it would ride lane 0 behind every batch already queued
there, so a lane that is merely slow (bulk items through a lossy path) would fail the
check and kill healthy streams. A PING is answered at the packet level, ahead of stream
data, so only a peer that stopped answering at all fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from ..ids import InstanceId
from ..messenger import Messenger
from .config import MuxConfig
from .driver import BatcherDriver

__all__ = ["PeerHealth"]

logger = logging.getLogger(__name__)


class PeerHealth:
    """One check task per peer with live producer slots."""

    def __init__(
        self,
        messenger: Messenger,
        config: MuxConfig,
        drivers_of: Callable[[InstanceId], Iterable[BatcherDriver]],
    ) -> None:
        self._messenger = messenger
        self._interval = config.health_check_interval
        self._timeout = config.health_check_timeout
        self._drivers_of = drivers_of
        self._tasks: dict[InstanceId, asyncio.Task[None]] = {}
        self.checks = 0
        self.failures = 0

    @property
    def running(self) -> int:
        """Peers whose check task runs now (each ends at its first wake-up with no live
        slot to that peer, so a node at rest has none)."""
        return len(self._tasks)

    def watch(self, peer: InstanceId) -> None:
        """A slot to ``peer`` opened: make sure its check runs."""
        if peer not in self._tasks and self._interval > 0:
            task = asyncio.get_running_loop().create_task(self._run(peer))
            self._tasks[peer] = task

    def _live(self, peer: InstanceId) -> list[BatcherDriver]:
        return [
            driver
            for driver in self._drivers_of(peer)
            if not driver.closed and driver.batcher.live_slots
        ]

    async def _run(self, peer: InstanceId) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval)  # the check's own period
                if not self._live(peer):
                    return
                self.checks += 1
                try:
                    await self._messenger.transport.check_health(peer, timeout=self._timeout)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.failures += 1
                    drivers = self._live(peer)
                    logger.warning(
                        "mux health check of %s failed (%r): ending %d slots",
                        peer,
                        exc,
                        sum(driver.batcher.live_slots for driver in drivers),
                    )
                    for driver in drivers:
                        driver.peer_lost()
                    return
        finally:
            self._tasks.pop(peer, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
