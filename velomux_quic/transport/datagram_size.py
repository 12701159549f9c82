"""One connection's datagram size: the plan for its path, the search, and their counts.

Once a connection is established its path's plan (:func:`~.pmtu.plan_path`) picks the size:
pinned, the loopback size, the base size, or a path MTU search (:class:`~.pmtu.PathMtuSearch`)
fed with the fates of its probes. :class:`DatagramSize` does that on the connection's
engine and keeps ``velo_transport_datagram_size`` and the probe counters current. It is
sans-IO like the search: it is given ``now``, sends its probes through the function it was
given, and answers with the time it next wants to :meth:`~DatagramSize.step`, which the
connection keeps as its :attr:`~.deadlines.Deadline.PMTU` deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .config import TransportConfig
from .metrics import TransportStats
from .pmtu import DatagramMode, PathMtuSearch, plan_path
from .seam import NetworkAddress, QuicEngine

__all__ = ["DatagramSize"]

logger = logging.getLogger(__name__)

MIN_PROBE_TIMEOUT = 0.1
"""A path MTU probe unanswered for three probe timeouts, and at least this long, is lost."""


class DatagramSize:
    """The datagram size of one connection's path (see the module docstring)."""

    __slots__ = ("_black_holes", "_counted", "_quic", "_search", "_sendto", "_stats", "mode")

    def __init__(
        self,
        quic: QuicEngine,
        stats: TransportStats,
        config: TransportConfig,
        sendto: Callable[[bytes, NetworkAddress], None],
    ) -> None:
        self._quic = quic
        self._stats = stats
        self._sendto = sendto
        self._search: PathMtuSearch | None = None
        self._black_holes = 0
        self._counted: int | None = None
        """The size this connection adds to ``stats.datagram_sizes`` (None: none yet)."""
        self.mode = (
            DatagramMode.PINNED if config.max_datagram_size is not None else DatagramMode.BASE
        )
        """What the size is: pinned, loopback, base, searching, complete (the snapshot's)."""
        quic.accepted_datagram_size = config.accepted_datagram_size

    def start(
        self, config: TransportConfig, local_host: str, remote_host: str, now: float, path: str
    ) -> float | None:
        """Established: choose the size for this path; the time of the first step, if any."""
        quic = self._quic
        plan = plan_path(config, local_host, remote_host, quic.features.loopback_datagram_size)
        limit = quic.peer_max_udp_payload_size
        self.mode = plan.mode
        if not quic.features.live_datagram_size:
            # The engine was made at the plan's size and keeps it; a search stays at its
            # base (EngineFeatures.mtu_probes), which the mode says.
            if plan.search_max is not None:
                self.mode = DatagramMode.BASE
            self._use(quic.datagram_size)
            return None
        if plan.search_max is None:
            self._use(min(plan.size, limit))
            return None
        search = PathMtuSearch(min(plan.size, limit), min(plan.search_max, limit))
        self._search = search
        self.mode = search.mode
        quic.large_packet_threshold = search.base
        self._use(search.size)
        return self.step(now, path)

    def probe_answered(self, size: int, acked: bool, now: float) -> bool:
        """The engine's loss detection decided a probe's fate; True: step soon."""
        search = self._search
        if search is None:
            return False
        if acked:
            self._stats.pmtu_probes["acked"] += 1
            search.probe_acked(size)
        elif search.probe_lost(size, now):
            self._stats.pmtu_probes["lost"] += 1
        return True

    def large_packets_lost(self, count: int) -> bool:
        """Ordinary packets above the base size were lost; True: step soon."""
        search = self._search
        if search is not None and search.size > search.base:
            search.large_packets_lost(count)
            return True
        return False

    def step(self, now: float, path: str) -> float | None:
        """Give up on an overdue probe, send the next one, follow the search's size; the
        time of the next step. ``path`` names the connection in the black-hole log line."""
        search = self._search
        if search is None:
            return None
        stats = self._stats
        if search.expire(now) is not None:
            stats.pmtu_probes["lost"] += 1
        retry_at: float | None = None
        size = search.next_probe(now)
        if size is not None:
            datagrams = self._quic.send_mtu_probe(size, now)
            if datagrams:
                for data, addr in datagrams:
                    self._sendto(data, addr)
                stats.datagrams_out += len(datagrams)
                stats.pmtu_probes["sent"] += 1
                timeout = max(3 * self._quic.probe_timeout, MIN_PROBE_TIMEOUT)
                search.probe_sent(size, now, timeout)
            else:  # no 1-RTT keys to send with yet: try again shortly
                retry_at = now + MIN_PROBE_TIMEOUT
        if search.size != self._counted:
            self._use(search.size)
        self.mode = search.mode
        if search.black_holes != self._black_holes:
            stats.pmtu_black_holes += search.black_holes - self._black_holes
            self._black_holes = search.black_holes
            logger.info(
                "connection %s: full-size datagrams are lost; back to %d bytes", path, search.size
            )
        return search.deadline if retry_at is None else retry_at

    def forget(self) -> None:
        """The connection ended: no more search, and its size no longer counted."""
        self._search = None
        if self._counted is not None:
            sizes = self._stats.datagram_sizes
            sizes[self._counted] -= 1
            if not sizes[self._counted]:
                del sizes[self._counted]
            self._counted = None

    def _use(self, size: int) -> None:
        if size != self._quic.datagram_size:
            self._quic.set_datagram_size(size)
        sizes = self._stats.datagram_sizes
        if self._counted is not None:
            sizes[self._counted] -= 1
            if not sizes[self._counted]:
                del sizes[self._counted]
        sizes[size] += 1
        self._counted = size
