"""A lossy link between two sans-IO QUIC connections of the same test, on a seeded RNG.

Each step moves what both sides have to send: a datagram is lost with probability
``loss``, held back one step with probability ``late`` (so it arrives after later ones),
and delivered at once otherwise. The draws come from the test's own ``random.Random``, in
a fixed order, so a seed replays the same link.
"""

from __future__ import annotations

import random
from typing import Any

CLIENT = ("127.0.0.1", 1111)
SERVER = ("127.0.0.1", 2222)


class LossyLink:
    """Moves datagrams between ``client`` (at :data:`CLIENT`) and ``server`` (at
    :data:`SERVER`), either engine's connection or qh3's own."""

    def __init__(self, rng: random.Random, *, loss: float, late: float) -> None:
        self._rng = rng
        self._loss = loss
        self._late = loss + late
        self._held: tuple[list[bytes], list[bytes]] = ([], [])

    def step(self, client: Any, server: Any, now: float, *, lossy: bool = True) -> None:
        """One step: what was held back arrives, then this step's datagrams (without loss
        or delay when ``lossy`` is False, drawing nothing)."""
        arriving, self._held = self._held, ([], [])
        for side, sender in enumerate((client, server)):
            for data, _ in sender.datagrams_to_send(now):
                fate = self._rng.random() if lossy else 1.0
                if fate >= self._loss:
                    (self._held[side] if fate < self._late else arriving[side]).append(data)
        for data in arriving[0]:
            server.receive_datagram(data, CLIENT, now)
        for data in arriving[1]:
            client.receive_datagram(data, SERVER, now)

    @staticmethod
    def fire_timers(client: Any, server: Any, now: float) -> None:
        """Handle each side's timer if it is due by ``now`` (the step's clock moved)."""
        for connection in (client, server):
            timer = connection.get_timer()
            if timer is not None and timer <= now:
                connection.handle_timer(now)
