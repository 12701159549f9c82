"""Who waits for the peer to acknowledge a lane's bytes, and telling them.

What the mux retires a stream on (:meth:`~.connection.PeerConnection.on_delivered`): a
frame admitted to a lane is only in this node's send buffer, and a connection that closes
before the peer acknowledged it loses it. :class:`Deliveries` keeps, per outbound lane,
the stream offsets callers wait for, in increasing order, and tells each caller once:
True when the peer acknowledged every byte before its offset, False when the lane or the
connection ended first. It holds no engine: the connection says how far each lane is
acknowledged when datagrams arrive (acknowledgements come in them).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

__all__ = ["Deliveries", "DeliveryCallback"]

logger = logging.getLogger(__name__)

DeliveryCallback = Callable[[bool], None]
"""Told True once the peer acknowledged the bytes it waits for, False if it never will."""


class Deliveries:
    """Per lane, (offset, callback) pairs waiting for the peer's acknowledgement."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting: dict[int, deque[tuple[int, DeliveryCallback]]] = {}
        """Lanes with callers waiting (empty: nothing to check when a datagram arrives)."""

    def watch(self, lane: int, offset: int, callback: DeliveryCallback) -> None:
        """Tell ``callback`` once every byte of ``lane`` before ``offset`` is acknowledged."""
        waiting = self.waiting.get(lane)
        if waiting is None:
            waiting = self.waiting[lane] = deque()
        waiting.append((offset, callback))

    def check(self, acknowledged: Callable[[int], int | None]) -> None:
        """Tell the callers whose offsets ``acknowledged(lane)`` reached; a lane for which
        it answers None is gone, and its callers are told False."""
        for lane, waiting in list(self.waiting.items()):
            acked = acknowledged(lane)
            if acked is None:
                self.fail(lane)
                continue
            while waiting and waiting[0][0] <= acked:
                _, callback = waiting.popleft()
                _tell(callback, True)
            if not waiting:
                del self.waiting[lane]

    def fail(self, lane: int | None = None) -> None:
        """The lane (None: every lane) ended: what it still waits for is never acknowledged."""
        lanes = list(self.waiting) if lane is None else [lane]
        for each in lanes:
            waiting = self.waiting.pop(each, None)
            while waiting:
                _, callback = waiting.popleft()
                _tell(callback, False)


def _tell(callback: DeliveryCallback, delivered: bool) -> None:
    try:
        callback(delivered)
    except Exception:  # one watcher's bug must not stop the connection's datagram path
        logger.exception("delivery callback failed")
