"""Transport settings, with the defaults the Batched streaming chapter and its reference name."""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from ..errors import ConfigurationError

__all__ = [
    "BASE_DATAGRAM_SIZE",
    "JUMBO_LOOPBACK_DATAGRAM_SIZE",
    "MAX_DATAGRAM_SIZE",
    "MAX_LANES",
    "MIN_DATAGRAM_SIZE",
    "TransportConfig",
]

MAX_LANES = 16
"""Lanes per peer at most: the mux names lanes in the low four bits of a batch's flags."""

BASE_DATAGRAM_SIZE = 1452
"""Every connection starts at this UDP payload size unless pinned: it fits a 1500-byte
Ethernet path under IPv6 (40) and UDP (8) headers, with room for a tunnel's few bytes."""

MIN_DATAGRAM_SIZE = 1200
"""QUIC's smallest allowed maximum datagram size (RFC 9000 section 14)."""

MAX_DATAGRAM_SIZE = 65000
"""Below the UDP payload limits (65507 under IPv4, 65527 under IPv6)."""

KiB = 1024
MiB = 1024 * KiB

JUMBO_LOOPBACK_DATAGRAM_SIZE: Final = 16 * KiB
"""The loopback size of an engine that gains from large datagrams there (aioquic): the
loopback device's MTU is 65536, and larger datagrams cut the CPU spent per byte."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How one node's QUIC endpoint behaves. Every field has a safe default.

    Datagram sizes are chosen per connection (see :mod:`.pmtu`): every connection starts
    at 1452 bytes, which fits a 1500-byte Ethernet path under IPv6 + UDP headers; one to
    a peer on this host then uses ``loopback_datagram_size``, and one across hosts
    searches for the largest size its path carries (``pmtu_discovery``, up to
    ``pmtu_max``). Setting ``max_datagram_size`` pins one size for every connection
    instead, and turns both off.
    """

    lanes: int = 1
    """Ordered lanes to each peer (1 to 16); lane k is the k-th unidirectional stream."""

    engine: str | None = None
    """The QUIC engine: ``aioquic`` (the default) or ``qh3`` (the ``velomux_quic[qh3]``
    extra, a Rust transport core: several times less CPU per datagram). None takes
    ``VELOMUX_QUIC_ENGINE`` from the environment, else aioquic. Both speak QUIC v1 with
    mutual TLS, so nodes of either engine talk to each other; what qh3 does not do is in
    docs/transport.md and the snapshot's ``engine`` (``EngineFeatures``)."""

    max_message_size: int = 16 * MiB
    """Largest frame body accepted or sent; larger inbound lengths close the connection."""

    max_datagram_size: int | None = None
    """The one UDP payload size every connection uses (and asks its peer to use), when set:
    no loopback size, no path discovery. None (the default) chooses per path. An oversized
    datagram is dropped, not fragmented, so pin a large size only where every path carries it."""

    pmtu_discovery: bool = True
    """Across hosts, probe for the largest datagram the path carries (DPLPMTUD, RFC 8899):
    padded PING probes above the current size, raised only when one is acknowledged, never
    counted as congestion; a path that starts losing full-size packets falls back to 1452.
    False keeps every such connection at 1452."""

    pmtu_max: int = 8972
    """The largest size path discovery probes: 8972 is the UDP payload of a 9000-byte jumbo
    frame under IPv4 (8952 under IPv6). Raise it for larger jumbo frames."""

    loopback_datagram_size: int | Literal["auto"] | None = "auto"
    """The size of a connection to a peer on this host (a loopback address, or our own
    bound address), bounded by what the peer accepts (its max_udp_payload_size).
    ``"auto"`` takes the engine's own (``EngineFeatures.loopback_datagram_size``): 16 KiB
    on aioquic, where larger datagrams cut the CPU spent per byte; the base size on qh3,
    whose pacer would hold a new connection's first jumbo datagrams (docs/tuning.md says
    by how much). A size applies on either engine; None treats such a peer like any other
    (path discovery, up to ``pmtu_max``)."""

    idle_timeout: float = 15.0
    """A silent peer is declared dead after this long (QUIC idle timeout)."""

    keep_alive_interval: float = 5.0
    """PING an idle connection this often, so the idle timeout only fires on a dead peer."""

    handshake_timeout: float = 5.0
    """A dial that has not completed its mutual-TLS handshake by then fails."""

    certificate_expiry_warning: float = 14 * 24 * 3600.0
    """Seconds before its certificate, or a CA it trusts, expires from which a node
    warns (a ``certificate_expiring`` lifecycle event at WARNING when it starts and when it
    reloads its credentials), leaving that long to renew before peers refuse it. 0 warns
    never; ``velo_node_certificate_expiry_seconds`` is exported either way, for alerts."""

    max_half_open_handshakes: int = 256
    """Inbound handshakes from validated addresses (an Initial carrying our Retry token)
    that may be in progress at once; further validated Initials are dropped (counted as
    ``handshake_overload``). Each costs the TLS state of one connection. Unvalidated ones
    are bounded by ``retry_threshold`` apart from these."""

    retry_threshold: int = 32
    """From this many inbound handshakes in progress on, a new Initial without a token is
    answered with a QUIC Retry (address validation, RFC 9000 section 8.1) instead of a
    connection: a sender that cannot receive at its source address never gets one, and a
    real peer pays one round trip. Counted as ``handshake_retry``. 0 retries every dial."""

    max_half_open_per_source: int = 32
    """Inbound handshakes one source IP address may have in progress at once, counted
    apart for unvalidated Initials and validated ones (those carrying our Retry token).
    Past it an unvalidated Initial from that source is answered with a Retry and a
    validated one dropped (both counted as ``handshake_per_source``), so a flood of
    unvalidated Initials bearing a peer's address never locks the peer out. Several nodes
    of one host share an address, so this is not one per node."""

    half_open_idle_timeout: float = 2.0
    """An inbound handshake whose peer sent nothing for this long is abandoned: its state
    is dropped at once (``handshake_abandoned``), long before ``handshake_timeout``. A real
    client answers the server's first flight within a round trip or retransmits."""

    lane_window: int = 1 * MiB
    """Receive window per lane: how far a sender runs ahead of a receiver that stopped reading."""

    stream_window: int = 64 * KiB
    """Initial receive window of every stream a peer opens (QUIC's initial_max_stream_data).

    Lanes are raised to ``lane_window`` as soon as they open; a per-stream stream keeps
    this (its receiver manages it from there). Small on purpose: it is what each of a
    thousand concurrent per-stream producers may have in flight before its reader takes
    anything."""

    send_buffer: int = 1 * MiB
    """Bytes a lane may queue locally beyond the peer's window before ``send`` returns Pending."""

    streams_send_buffer: int = 256 * KiB
    """Bytes the per-stream streams of one connection may hold, together, ready to go but
    not yet transmitted, before their sends wait (each stream also has its own bound, set
    by the layer that opens it). Without it a producer writing a thousand streams at full
    rate queues megabytes in the QUIC stack, which then scans every stream per packet."""

    connection_window: int = 16 * MiB
    """Initial connection-wide receive window (aioquic grows it as data arrives)."""

    max_concurrent_streams: int = 4096
    """Streams of each kind a peer may have open at once (aioquic's own default is 128)."""

    max_connections_per_peer: int = 4
    """Inbound connections one peer identity (one certificate) may hold open at once.

    An honest peer has one (it dials us once), plus a replacement while it re-dials after
    a restart, before the old one times out. Past the bound the *oldest* of that peer's
    connections is closed (``connections_per_peer``): the newest one is the one the peer
    just proved it wants, a restarted peer is never locked out by its own dead
    connections, and the connections closed belong to the same certificate, so nobody
    else loses anything."""

    max_unacked_bytes: int = 4 * MiB
    """Bytes one connection's lanes and per-stream streams may hold admitted and not yet
    acknowledged by the peer, whatever flow-control windows the peer grants. Past it sends
    wait in their gates (where the messenger charges and bounds replies), so a peer that
    advertises huge windows and acknowledges nothing cannot make the QUIC stack hold
    without bound. A frame is still admitted alone while the connection is below the cap,
    so the most held is this plus one ``max_message_size`` frame. It caps a connection's
    throughput at about this much per round trip (4 MiB at 50 ms: 80 MiB/s)."""

    max_unacked_bytes_per_peer: int = 8 * MiB
    """The same, summed over every connection of one peer (it may hold
    ``max_connections_per_peer``): what one certificate can make this node hold."""

    peer_turn_bytes: int = 8 * KiB
    """Bytes of lane data one peer's connections may have handled per turn of the event
    loop before the rest waits for the next turn, after every other peer's share: one
    member sending as fast as it can then takes its share of the node, not all of it.
    What waits is not consumed, so the peer's receive window (``lane_window``) bounds it
    and slows the peer down. Smaller is fairer and costs a lone bulk sender more turns."""

    unacked_timeout: float = 30.0
    """A connection whose unacknowledged bytes stay above half of ``max_unacked_bytes``
    for this long is closed (``unacked_stall``): its peer keeps it alive (acknowledging a
    datagram now and then, or never) without taking what it is sent. Checked every
    quarter of it."""

    max_partial_frame_bytes: int | None = None
    """Bytes of unfinished frames one peer's inbound connections may hold together across
    their lanes (a frame's header arrived, not yet all of its body). Each lane holds at
    most one such frame, of at most ``max_message_size``; a peer starting huge frames on
    all 16 lanes of its 4 connections would otherwise make this node hold 1 GiB. Past it
    the connection that passed it is closed (``partial_frame_bytes``). None (the default)
    is twice ``max_message_size`` (32 MiB); a value must be at least ``max_message_size``."""

    partial_frame_timeout: float = 30.0
    """A lane holding an unfinished frame on which nothing arrived for this long (checked
    every ``partial_frame_timeout``, so it fires within twice that) closes its connection
    (``partial_frame_timeout``): the peer began a frame and stopped. A lane this node
    paused is never counted: there the wait is ours."""

    max_stream_openings: int = 256
    """Streams the peer opened toward us (not lanes) whose opening, their first frame, has
    not arrived whole yet, per connection. A new stream beyond it is refused at once
    (STOP_SENDING, ``stream_openings``). An honest per-stream producer's opening is one
    16-byte frame, written with the stream's first bytes."""

    max_stream_opening_size: int = 1 * KiB
    """The largest first frame (its announced length) a stream the peer opens may have; a
    larger one is refused (``stream_opening_size``). With ``max_stream_openings`` this
    bounds what unfinished openings may hold: about 256 x 1 KiB per connection."""

    stream_opening_timeout: float = 10.0
    """A stream whose opening has not arrived whole this long after its first bytes is
    refused (``stream_opening_timeout``), and its receiver told the stream is over."""

    udp_receive_buffer: int = 8 * MiB
    udp_send_buffer: int = 4 * MiB

    gso: bool | None = None
    """Batch datagrams in the kernel on Linux: each transmit's datagrams to one peer leave
    in one ``sendmsg`` (UDP GSO) and the kernel coalesces received ones (UDP GRO). Where
    the kernel or a path refuses, datagrams go one by one (counted). None takes
    ``VELOMUX_UDP_GSO`` from the environment (``0`` turns it off), else on."""

    close_timeout: float = 1.0
    """On close, how long to wait for admitted data to be acknowledged before closing."""

    health_check_timeout: float = 5.0
    """How long ``check_health`` waits for the handshake and a PING answer by default."""

    @property
    def base_datagram_size(self) -> int:
        """The size a connection starts at: ``max_datagram_size`` when pinned, else 1452."""
        if self.max_datagram_size is not None:
            return self.max_datagram_size
        return BASE_DATAGRAM_SIZE

    @property
    def accepted_datagram_size(self) -> int:
        """The largest datagram we ask peers to send us (our ``max_udp_payload_size``):
        the pinned size, else the largest this node would use itself on any path."""
        if self.max_datagram_size is not None:
            return self.max_datagram_size
        loopback = self.loopback_datagram_size
        largest_loopback = JUMBO_LOOPBACK_DATAGRAM_SIZE if loopback == "auto" else loopback
        return max(BASE_DATAGRAM_SIZE, largest_loopback or 0, self.pmtu_max)

    def loopback_size(self, engine_size: int) -> int | None:
        """``loopback_datagram_size`` resolved for an engine whose own loopback size is
        ``engine_size`` (None: a peer on this host is planned like any other)."""
        loopback = self.loopback_datagram_size
        return engine_size if loopback == "auto" else loopback

    @property
    def partial_frame_limit(self) -> int:
        """``max_partial_frame_bytes``, with None resolved (twice ``max_message_size``)."""
        if self.max_partial_frame_bytes is not None:
            return self.max_partial_frame_bytes
        return 2 * self.max_message_size

    def __post_init__(self) -> None:
        if self.engine is not None and self.engine not in ("aioquic", "qh3"):
            raise ConfigurationError(
                f"engine must be 'aioquic' or 'qh3' (or unset), got {self.engine!r}"
            )
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigurationError(f"lanes must be 1 to {MAX_LANES}, got {self.lanes}")
        if self.max_message_size < 1 or self.max_message_size > (1 << 32) - 1:
            raise ConfigurationError("max_message_size must fit the u32 frame length")
        if isinstance(self.loopback_datagram_size, str) and self.loopback_datagram_size != "auto":
            raise ConfigurationError(
                'loopback_datagram_size must be a size in bytes, "auto" (the engine\'s own)'
                f" or None, got {self.loopback_datagram_size!r}"
            )
        for name in ("max_datagram_size", "pmtu_max", "loopback_datagram_size"):
            value = getattr(self, name)
            if value == "auto":
                continue
            if value is not None and not MIN_DATAGRAM_SIZE <= value <= MAX_DATAGRAM_SIZE:
                raise ConfigurationError(
                    f"{name} must be {MIN_DATAGRAM_SIZE} to {MAX_DATAGRAM_SIZE} bytes (a UDP"
                    f" payload QUIC may use), got {value}"
                )
        if self.pmtu_max < BASE_DATAGRAM_SIZE:
            raise ConfigurationError(
                f"pmtu_max must be at least {BASE_DATAGRAM_SIZE} (the size every connection"
                f" starts at), got {self.pmtu_max}; set pmtu_discovery = false instead, or pin"
                " max_datagram_size for a path narrower than that"
            )
        for name in (
            "idle_timeout",
            "keep_alive_interval",
            "handshake_timeout",
            "health_check_timeout",
            "half_open_idle_timeout",
            "stream_opening_timeout",
            "partial_frame_timeout",
            "unacked_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive")
        if self.certificate_expiry_warning < 0:
            raise ConfigurationError(
                "certificate_expiry_warning must be >= 0 seconds (0: never warn), got "
                f"{self.certificate_expiry_warning}"
            )
        if self.keep_alive_interval >= self.idle_timeout:
            raise ConfigurationError("keep_alive_interval must be shorter than idle_timeout")
        if self.lane_window < 4 * KiB or self.stream_window < 4 * KiB or self.send_buffer < 0:
            raise ConfigurationError("lane_window and stream_window >= 4 KiB, send_buffer >= 0")
        if self.peer_turn_bytes < 1:
            raise ConfigurationError(
                f"peer_turn_bytes must be at least 1, got {self.peer_turn_bytes}"
            )
        if self.max_unacked_bytes < 1 or self.max_unacked_bytes_per_peer < self.max_unacked_bytes:
            raise ConfigurationError(
                f"max_unacked_bytes ({self.max_unacked_bytes}) must be at least 1 and at most"
                f" max_unacked_bytes_per_peer ({self.max_unacked_bytes_per_peer})"
            )
        if self.streams_send_buffer < 0:
            raise ConfigurationError("streams_send_buffer must be >= 0")
        if self.max_half_open_handshakes < 1 or self.max_half_open_per_source < 1:
            raise ConfigurationError(
                "max_half_open_handshakes and max_half_open_per_source must be at least 1"
            )
        if not 0 <= self.retry_threshold <= self.max_half_open_handshakes:
            raise ConfigurationError(
                f"retry_threshold must be 0 to max_half_open_handshakes"
                f" ({self.max_half_open_handshakes}), got {self.retry_threshold}"
            )
        if self.max_connections_per_peer < 1 or self.max_stream_openings < 1:
            raise ConfigurationError(
                "max_connections_per_peer and max_stream_openings must be at least 1"
            )
        if (
            self.max_partial_frame_bytes is not None
            and self.max_partial_frame_bytes < self.max_message_size
        ):
            raise ConfigurationError(
                f"max_partial_frame_bytes ({self.max_partial_frame_bytes}) must be at least"
                f" max_message_size ({self.max_message_size}), or no large frame could arrive"
            )
        if self.max_stream_opening_size < 16:
            raise ConfigurationError(
                "max_stream_opening_size must be at least 16 bytes (the per-stream opening)"
            )
        if self.max_concurrent_streams < MAX_LANES:
            raise ConfigurationError(f"max_concurrent_streams must be at least {MAX_LANES}")
