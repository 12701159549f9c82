"""A read-only picture of a transport's connections, for operators and tests.

:meth:`QuicEndpoint.snapshot <velomux_quic.transport.endpoint.QuicEndpoint.snapshot>`
builds one on demand (it walks every connection, so it is not for the hot path). The
values are copies: holding a snapshot keeps nothing alive and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ids import InstanceId
from ..security.rotation import CertificateSummary
from .batched_udp import UdpBatching
from .seam import EngineFeatures

__all__ = ["ConnectionSnapshot", "TransportSnapshot"]


@dataclass(frozen=True, slots=True)
class ConnectionSnapshot:
    """One connection, either direction, at the moment of the snapshot."""

    peer: InstanceId | None
    """The verified peer (the expected one while a dial is still handshaking)."""
    outbound: bool
    """Dialed by this node (it sends on it) rather than accepted (it receives on it)."""
    state: str
    """``handshaking``, ``established``, ``closing`` or ``closed``."""
    open_lanes: tuple[int, ...]
    """Lanes with a stream: written on an outbound connection, read on an inbound one."""
    send_backlog: int
    """Bytes the per-stream streams wrote inside their peer windows, not yet transmitted."""
    blocked_streams: int
    """Outbound streams (lanes and per-stream) with sends waiting in their gates."""
    held_by_peer_window: int
    """Of those, the streams whose waiting send only the peer's reader can release: the
    bytes written beyond the peer's window leave no room for it, whatever is transmitted."""
    extra_streams: int
    """Outbound per-stream streams (not lanes) still open."""
    pending_requests: int
    """Request streams this node opened on the connection, still unanswered."""
    partial_requests: int
    """Request streams the peer opened toward this node, not yet answered."""
    partial_frame_bytes: int = 0
    """Bytes of unfinished frames held across the inbound lanes (``max_partial_frame_bytes``)."""
    stream_openings: int = 0
    """Streams the peer opened toward this node whose opening has not arrived whole yet
    (``max_stream_openings``)."""
    own_certificate_serial: str | None = None
    """Serial (hex) of the certificate this node presented on this connection: the one it
    had when the connection was made, which a credentials reload does not change."""
    peer_certificate_serial: str | None = None
    """Serial (hex) of the certificate the peer presented, once it passed verification."""
    datagram_size: int = 1452
    """The largest datagram (UDP payload) the connection sends now."""
    datagram_mode: str = "base"
    """How that size was chosen: ``pinned``, ``loopback``, ``base`` (discovery off),
    ``searching``, ``complete`` or ``black_hole`` (see :class:`~.pmtu.DatagramMode`)."""
    unacked_bytes: int = 0
    """Bytes admitted to this connection's lanes and per-stream streams that the peer has
    not acknowledged (held to ``max_unacked_bytes``, and with the peer's other connections
    to ``max_unacked_bytes_per_peer``). The per-stream streams' part is counted afresh only
    near the cap, and in between counts what they wrote since: an upper bound."""


@dataclass(frozen=True, slots=True)
class TransportSnapshot:
    """Every connection of one transport (those closed are gone from it)."""

    connections: tuple[ConnectionSnapshot, ...]
    certificate: CertificateSummary | None = None
    """The node certificate new connections present (after the last successful
    ``reload_credentials``, the new one)."""
    trust_roots: tuple[CertificateSummary, ...] = ()
    """The CAs new connections' peers must chain to (several during a CA roll)."""
    engine: EngineFeatures | None = None
    """The QUIC engine every connection runs (``aioquic`` or ``qh3``), its version, and
    what it does where the two differ (see docs/transport.md)."""
    udp: UdpBatching | None = None
    """Whether the node's socket batches datagrams (GSO out, GRO in) and for how many
    destinations the kernel refused it (None before the socket is open)."""

    def to(self, peer: InstanceId) -> ConnectionSnapshot | None:
        """The live outbound connection to ``peer``, if there is one."""
        for connection in self.connections:
            if connection.outbound and connection.peer == peer:
                return connection
        return None

    def inbound_from(self, peer: InstanceId) -> tuple[ConnectionSnapshot, ...]:
        """The connections ``peer`` dialed to this node (more than one while it reconnects)."""
        return tuple(c for c in self.connections if not c.outbound and c.peer == peer)
