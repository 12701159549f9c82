"""Datagram sizes per path: large to this host, discovered across hosts (RFC 8899).

A QUIC packet never spans datagrams, so the datagram size bounds what every packet
carries; per-packet costs (encryption, the system call, the event loop) dominate a bulk
transfer, and a larger size cuts them. But an oversized datagram is dropped, not
fragmented (the socket sets DF), so the size must fit the path, and only the path can say.

:func:`plan_path` decides once per connection, from its two addresses: a pinned size
when configured, the loopback size to a peer on this host, else a search. The search,
:class:`PathMtuSearch`, is Datagram Packetization Layer PMTU Discovery (RFC 8899) without
I/O: it says which probe size to send next and learns from each probe's fate, which the
connection reports. Probes are padded PING packets that the congestion controller never
sees, so a lost probe means "too big", never "congested"; and the size is raised only
when a probe of that size was acknowledged (an ICMP "too big" alone changes nothing).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import StrEnum

from .config import BASE_DATAGRAM_SIZE, TransportConfig

__all__ = [
    "MAX_PROBES",
    "PROBE_STEPS",
    "DatagramMode",
    "DatagramPlan",
    "PathMtuSearch",
    "is_same_host",
    "plan_path",
]

PROBE_STEPS = (4096, 8952, 8972, 16384, 32768)
"""Sizes a search tries, smallest first, then ``pmtu_max`` itself. 8952 and 8972 are the
UDP payloads of a 9000-byte jumbo frame under IPv6 and IPv4; a 1500-byte path fails 4096
and stays at the base."""

MAX_PROBES = 3
"""Probes of one size lost in a row before the size counts as too big (RFC 8899's
MAX_PROBES): a single loss may be congestion, three in a row is the path."""

RAISE_INTERVAL = 600.0
"""After a search ends, try sizes above the current one again this much later (RFC 8899's
PMTU_RAISE_TIMER): the path may have changed."""

BLACK_HOLE_HOLD = 60.0
"""After a black hole fell back to the base, the search starts again this much later."""

SUSPECT_LOSSES = 3
"""Packets larger than the base lost since the last confirmation before a probe of the
current size checks that the path still carries it."""


class DatagramMode(StrEnum):
    """How a connection's datagram size was chosen (``ConnectionSnapshot.datagram_mode``)."""

    PINNED = "pinned"
    """``max_datagram_size`` is set: one size for every connection."""
    LOOPBACK = "loopback"
    """The peer is on this host: ``loopback_datagram_size`` (or the engine's own)."""
    BASE = "base"
    """Across hosts with ``pmtu_discovery`` off: the base size."""
    SEARCHING = "searching"
    """Probing for a larger size."""
    COMPLETE = "complete"
    """The search ended: the largest acknowledged size is in use."""
    BLACK_HOLE = "black_hole"
    """Full-size packets stopped arriving: back at the base for a while."""


@dataclass(frozen=True, slots=True)
class DatagramPlan:
    """What a connection does about its datagram size once established."""

    mode: DatagramMode
    size: int
    """The size to use at once (before the peer's limit), or the base a search starts at."""
    search_max: int | None = None
    """The largest size a search may probe; None: no search."""


def is_same_host(local_host: str, remote_host: str) -> bool:
    """Whether a peer at ``remote_host`` is on this host: a loopback address (127.0.0.0/8,
    ::1, or either mapped into IPv6), or the very address this node's socket is bound to.

    A socket bound to a wildcard address cannot tell its other local addresses from a
    remote host's: such a peer is treated as remote, and the search finds its size.
    """
    try:
        remote = ipaddress.ip_address(remote_host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(remote, ipaddress.IPv6Address) and remote.ipv4_mapped is not None:
        remote = remote.ipv4_mapped
    if remote.is_loopback:
        return True
    try:
        local = ipaddress.ip_address(local_host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(local, ipaddress.IPv6Address) and local.ipv4_mapped is not None:
        local = local.ipv4_mapped
    return not local.is_unspecified and local == remote


def plan_path(
    config: TransportConfig, local_host: str, remote_host: str, engine_loopback: int
) -> DatagramPlan:
    """The datagram plan of one connection, from the settings and its two addresses;
    ``engine_loopback`` is the engine's own size to a peer on this host (what ``"auto"``
    takes)."""
    if config.max_datagram_size is not None:
        return DatagramPlan(DatagramMode.PINNED, config.max_datagram_size)
    loopback = config.loopback_size(engine_loopback)
    if loopback is not None and is_same_host(local_host, remote_host):
        return DatagramPlan(DatagramMode.LOOPBACK, loopback)
    if not config.pmtu_discovery:
        return DatagramPlan(DatagramMode.BASE, BASE_DATAGRAM_SIZE)
    return DatagramPlan(DatagramMode.SEARCHING, BASE_DATAGRAM_SIZE, config.pmtu_max)


@dataclass(slots=True)
class _Probe:
    size: int
    deadline: float


class PathMtuSearch:
    """DPLPMTUD's state machine for one connection, with no I/O and no clock of its own.

    The connection asks :meth:`next_probe` what to send, reports :meth:`probe_sent`,
    :meth:`probe_acked` and :meth:`probe_lost` (from QUIC's loss detection), calls
    :meth:`expire` at :attr:`deadline`, and tells :meth:`large_packets_lost` when
    ordinary packets above the base size were lost. It reads :attr:`size` after each.

    One probe is in flight at a time. A search tries :data:`PROBE_STEPS` above the
    current size and below ``maximum``, then ``maximum``; a size whose probe is lost
    :data:`MAX_PROBES` times in a row is too big, and the search ends below it. Losses of
    full-size packets after a raise make it confirm the current size with a probe; if
    :data:`MAX_PROBES` confirmations are lost, the path has become a black hole for that
    size and the size falls back to ``base``.
    """

    def __init__(
        self,
        base: int,
        maximum: int,
        *,
        max_probes: int = MAX_PROBES,
        steps: tuple[int, ...] = PROBE_STEPS,
        raise_interval: float = RAISE_INTERVAL,
        black_hole_hold: float = BLACK_HOLE_HOLD,
        suspect_losses: int = SUSPECT_LOSSES,
    ) -> None:
        self.base = base
        self.maximum = max(base, maximum)
        self.size = base
        """The size in use: the largest acknowledged (or the base)."""
        self.mode = DatagramMode.SEARCHING if self.maximum > base else DatagramMode.COMPLETE
        self._max_probes = max_probes
        self._steps = steps
        self._raise_interval = raise_interval
        self._black_hole_hold = black_hole_hold
        self._suspect_losses = suspect_losses
        self._too_big = self.maximum + 1
        """The smallest size known not to pass (above ``maximum`` while none is known)."""
        self._failures = 0
        """Probes of the size being searched lost in a row."""
        self._probe: _Probe | None = None
        self._resume_at: float | None = None
        self._suspected = 0
        self._confirm_losses = 0
        self.black_holes = 0
        """Times the size fell back to the base."""

    # -- what to send ----------------------------------------------------------------------

    @property
    def probing(self) -> int | None:
        """The size of the probe in flight, if one is."""
        return self._probe.size if self._probe is not None else None

    @property
    def deadline(self) -> float | None:
        """When :meth:`expire` (or :meth:`next_probe`) has something to do, if ever."""
        if self._probe is not None:
            return self._probe.deadline
        return self._resume_at

    def next_probe(self, now: float) -> int | None:
        """The size to probe now, or None: a probe is in flight, or nothing is left to try."""
        if self._probe is not None:
            return None
        if self._suspected >= self._suspect_losses and self.size > self.base:
            return self.size  # confirm that the path still carries the size in use
        if self._resume_at is not None:
            if now < self._resume_at:
                return None
            self._resume_at = None
            self._too_big = self.maximum + 1
            self._failures = 0
            self.mode = DatagramMode.SEARCHING
        if self.mode is not DatagramMode.SEARCHING:
            return None
        candidate = self._candidate()
        if candidate is None:
            self.mode = DatagramMode.COMPLETE
            self._resume_at = now + self._raise_interval if self.maximum > self.size else None
        return candidate

    def _candidate(self) -> int | None:
        for size in (*self._steps, self.maximum):
            if self.size < size < self._too_big and size <= self.maximum:
                return size
        return None

    # -- what happened -------------------------------------------------------------------

    def probe_sent(self, size: int, now: float, timeout: float) -> None:
        """A probe of ``size`` left; it counts as lost if nothing is heard by ``timeout``."""
        self._probe = _Probe(size, now + timeout)

    def probe_acked(self, size: int) -> bool:
        """A probe of ``size`` was acknowledged: the path carries it. True when this raised
        the size. A late acknowledgement of a probe already given up still counts."""
        if self._probe is not None and self._probe.size == size:
            self._probe = None
        if size == self.size:
            self._suspected = self._confirm_losses = 0
            return False
        if size < self.size or size > self.maximum:
            return False
        self.size = size
        self._failures = 0
        self._suspected = self._confirm_losses = 0
        if size >= self._too_big:  # a late acknowledgement proved a "too big" wrong
            self._too_big = self.maximum + 1
        return True

    def probe_lost(self, size: int, now: float) -> bool:
        """The probe in flight, of ``size``, was declared lost. False when it was not the
        probe in flight (already given up, or already answered): nothing changes."""
        if self._probe is None or self._probe.size != size:
            return False
        self._probe = None
        if size == self.size:
            self._confirmation_lost(now)
        else:
            self._failures += 1
            if self._failures >= self._max_probes:
                self._too_big = min(self._too_big, size)
                self._failures = 0
        return True

    def expire(self, now: float) -> int | None:
        """Declare the probe in flight lost if its deadline passed; its size if so."""
        probe = self._probe
        if probe is None or now < probe.deadline:
            return None
        self.probe_lost(probe.size, now)
        return probe.size

    def large_packets_lost(self, count: int) -> None:
        """``count`` ordinary packets larger than the base size were declared lost."""
        if self.size > self.base:
            self._suspected += count

    def _confirmation_lost(self, now: float) -> None:
        self._confirm_losses += 1
        if self._confirm_losses < self._max_probes:
            return
        # Black hole: the path stopped carrying the size in use. Fall back, and search
        # again later (the path may come back), below the size that failed.
        self._too_big = self.size
        self.size = self.base
        self._failures = 0
        self._suspected = self._confirm_losses = 0
        self.black_holes += 1
        self.mode = DatagramMode.BLACK_HOLE
        self._resume_at = now + self._black_hole_hold
