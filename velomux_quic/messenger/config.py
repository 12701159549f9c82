"""Messenger settings, with the defaults REFERENCE.md names."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["MessengerConfig"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, slots=True)
class MessengerConfig:
    """How one node's messenger behaves. Every field has a safe default."""

    default_timeout: float = 30.0
    """Timeout of ``am_sync`` and ``unary`` calls that give none."""

    staging_threshold: int = 256 * KiB
    """Payloads larger than this (or than the transport's frame limit) are staged and pulled."""

    staged_payload_max: int = 64 * MiB
    """Largest staged payload this node will pull; a larger descriptor is refused unread."""

    max_staged_bytes: int = 1024 * MiB
    """Bytes this node may hold staged for peers at once; beyond it a send fails (StagingFull)."""

    staged_ttl: float = 60.0
    """A staged payload nobody pulled is released after this long."""

    pull_timeout: float = 60.0
    """How long a receiver waits for one staged payload to arrive."""

    release_timeout: float = 10.0
    """How long a receiver keeps trying to tell the sender to release a payload it refused.

    Best effort: if the sender does not hear it, the payload expires after its
    ``staged_ttl`` there anyway.
    """

    max_pulls_per_peer: int = 1024
    """Staged payloads of one peer this node may have accepted and not delivered yet.

    Each costs a waiting pull (descriptors of one lane are pulled one after another), so a
    peer sending descriptors faster than their payloads arrive would otherwise make this
    node hold a task per descriptor. Past the bound a descriptor is refused as one past
    ``staged_payload_max`` is (a waiting caller gets RemoteRefused, the refusal hooks run)
    and counted in ``velo_messenger_staged_pulls_refused_total{reason="count"}``.
    """

    max_releases_per_peer: int = 16
    """Requests to release a refused staged payload that may be outstanding to one peer.

    A descriptor refused for its size (past ``staged_payload_max``) makes this node ask its
    sender, over a request stream, to drop the payload. Past this many such requests in
    flight to that peer, a refused descriptor is still refused and counted, but no release
    is asked for (the payload expires after the sender's ``staged_ttl``), so a flood of
    oversized descriptors costs no task or stream each. Counted in
    ``velo_messenger_staged_releases_skipped_total``.
    """

    max_pull_bytes_per_peer: int = 256 * MiB
    """Bytes (as their descriptors state) of one peer's accepted, undelivered staged payloads.

    Checked only while that peer has a pull outstanding, so one payload up to
    ``staged_payload_max`` is always accepted; refusals are counted with
    ``reason="bytes"``.
    """

    max_pending_reply_bytes: int = 4 * MiB
    """Replies to one peer this node may hold waiting for that peer's lanes, in bytes.

    A reply (response, acknowledgement, error) to a peer that stops reading waits in the
    transport's admission gate once the lane's window and send buffer are full. Past this
    bound (each reply charged its payload plus ``REPLY_OVERHEAD``, 512 bytes, for its frame
    and bookkeeping: what an empty one really holds)
    further replies to that peer are dropped, not queued: its callers time out, and the
    drops are counted in ``velo_messenger_replies_dropped_total{reason="peer_not_reading"}``.
    """

    health_check_timeout: float = 5.0
    """Timeout of ``check_health`` calls that give none."""

    max_ordered_backlog: int = 65_536
    """Messages one (handler, sender, lane) queue may hold before the lane stops reading.

    The transport then stops granting that lane flow-control credit, so the sender's sends
    go Pending instead of this node's memory growing without bound.
    """

    def __post_init__(self) -> None:
        for name in (
            "default_timeout",
            "pull_timeout",
            "staged_ttl",
            "release_timeout",
            "health_check_timeout",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigurationError(f"MessengerConfig.{name} must be positive, got {value!r}")
        if self.staging_threshold < 1 * KiB:
            raise ConfigurationError(
                f"MessengerConfig.staging_threshold must be at least 1 KiB,"
                f" got {self.staging_threshold}"
            )
        if self.staged_payload_max < 0 or self.max_staged_bytes < 0:
            raise ConfigurationError(
                "MessengerConfig.staged_payload_max and max_staged_bytes must be non-negative"
            )
        if self.max_pulls_per_peer < 1 or self.max_pull_bytes_per_peer < 1:
            raise ConfigurationError(
                "MessengerConfig.max_pulls_per_peer and max_pull_bytes_per_peer must be at"
                f" least 1, got {self.max_pulls_per_peer} and {self.max_pull_bytes_per_peer}:"
                " a node that accepts no staged payload sets staged_payload_max=0 instead"
            )
        if self.max_releases_per_peer < 0:
            raise ConfigurationError(
                "MessengerConfig.max_releases_per_peer must be non-negative,"
                f" got {self.max_releases_per_peer}: 0 never asks a sender to release"
            )
        if self.max_pending_reply_bytes < 0:
            raise ConfigurationError(
                "MessengerConfig.max_pending_reply_bytes must be non-negative,"
                f" got {self.max_pending_reply_bytes}"
            )
        if self.max_ordered_backlog < 2:
            raise ConfigurationError(
                f"MessengerConfig.max_ordered_backlog must be at least 2,"
                f" got {self.max_ordered_backlog}"
            )
