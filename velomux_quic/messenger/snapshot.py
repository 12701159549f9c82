"""A point-in-time view of one messenger, for operators and tests (:meth:`Messenger.snapshot`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..discovery import PeerRecord

__all__ = ["MessengerSnapshot"]


@dataclass(frozen=True, slots=True)
class MessengerSnapshot:
    """What one messenger holds at one moment. Cheap to take; not for a per-message path."""

    handlers: tuple[str, ...]
    """Every registered handler name, sorted (the system's ``_`` names included)."""
    reserved_headers: tuple[str, ...]
    """Header names the layers above registered a codec for, sorted."""
    pending_calls: int
    """``am_sync`` and ``unary`` calls waiting for their answer."""
    ordered_queues: int
    """Live ordered (handler, sender, lane) queues."""
    ordered_depth: int
    """Messages in those queues, not yet handled."""
    staged_count: int
    """Payloads this node staged for peers that have not pulled them yet."""
    staged_bytes: int
    """Their bytes."""
    pulls_outstanding: int
    """Staged payloads of peers this node accepted and has not delivered yet."""
    pull_bytes_outstanding: int
    """The bytes their descriptors state."""
    releases_outstanding: int
    """Requests in flight asking peers to release payloads refused for their size
    (bounded per peer by ``max_releases_per_peer``)."""
    pending_reply_bytes: int
    """Bytes of replies waiting for peers' lanes (bounded per peer by
    ``max_pending_reply_bytes``)."""
    peers: tuple[PeerRecord, ...]
    """The peers this node knows where to reach, by InstanceId."""
    closed: bool
    """Whether the messenger has been closed."""
