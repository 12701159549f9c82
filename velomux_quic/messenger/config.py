"""Messenger settings, with the defaults REFERENCE.md names."""

from __future__ import annotations

from dataclasses import dataclass

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

    max_ordered_backlog: int = 65_536
    """Messages one (handler, sender, lane) queue may hold before the lane stops reading.

    The transport then stops granting that lane flow-control credit, so the sender's sends
    go Pending instead of this node's memory growing without bound.
    """

    def __post_init__(self) -> None:
        if self.default_timeout <= 0 or self.pull_timeout <= 0 or self.staged_ttl <= 0:
            raise ValueError("timeouts must be positive")
        if self.staging_threshold < 1 * KiB:
            raise ValueError("staging_threshold must be at least 1 KiB")
        if self.staged_payload_max < 0 or self.max_staged_bytes < 0:
            raise ValueError("staging limits must be non-negative")
        if self.max_ordered_backlog < 2:
            raise ValueError("max_ordered_backlog must be at least 2")
