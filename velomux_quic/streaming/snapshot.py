"""A point-in-time view of a node's streaming state, for operators and tests.

:meth:`AnchorManager.snapshot() <velomux_quic.streaming.manager.AnchorManager.snapshot>`
builds one on demand (nothing is kept up to date for it): the anchors this node owns, the
producers writing to them from other nodes, this node's own senders with their flow state,
and the attaches still waiting for an answer. Every value is a copy; holding a snapshot
keeps nothing alive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..ids import InstanceId, StreamAnchorHandle
from .sender import SenderStateName

__all__ = [
    "AnchorSnapshot",
    "BoundSenderSnapshot",
    "PerStreamSnapshot",
    "SenderSnapshot",
    "StreamingSnapshot",
]


@dataclass(frozen=True, slots=True)
class AnchorSnapshot:
    """One live anchor of this node (the consumer's end)."""

    handle: StreamAnchorHandle
    kind: Literal["spsc", "mpsc"]
    attached: bool
    """A single-sender anchor has a live sender (for MPSC: any sender is attached)."""
    senders: int
    """Live senders: remote ones, an unclaimed pre-bind, and this node's own."""
    buffered_records: int
    """Records waiting in the anchor's own channel (same-node senders, sentinels); what
    waits in a transport's per-stream buffer is the transport's to report."""
    prebound: bool
    """A zero-RTT pre-bind waits for its ticket's first batch."""
    finished: bool
    cancelled: bool


@dataclass(frozen=True, slots=True)
class BoundSenderSnapshot:
    """A producer on another node bound to one of this node's anchors."""

    handle: StreamAnchorHandle
    sender_id: int
    node: InstanceId | None
    """The producer's node; None while the stream is an unclaimed pre-bind."""
    transport_key: str
    lane: int
    routing_session_id: int
    """The session the attach answer (or the pre-bind's ticket) named for this stream."""


@dataclass(frozen=True, slots=True)
class SenderSnapshot:
    """One of this node's senders (the producer's end), live or ended."""

    handle: StreamAnchorHandle
    sender_id: int
    state: SenderStateName
    target: InstanceId | None
    """The anchor's node; None for an anchor on this node."""
    transport_key: str | None
    """The negotiated transport key; None for an anchor on this node."""
    credit: int | None
    """Records it may send now without waiting (see ``StreamSender.credit``)."""
    queued_bytes: int
    """Bytes sent into its channel and not on the wire yet."""
    lane: int | None
    """The mux lane its stream rides (see ``StreamSender.lane``); None off the mux."""


@dataclass(frozen=True, slots=True)
class PerStreamSnapshot:
    """What the per-stream path holds on the consumer's side, at the moment of the call."""

    binds: int
    """Binds made by attaches whose stream has not arrived (or been refused) yet."""
    receivers: int
    """Streams arriving now: matched to an anchor, or still waiting for their opening."""
    buffered_bytes: int
    """Bytes those streams decoded that their anchors have not taken yet."""


@dataclass(frozen=True, slots=True)
class StreamingSnapshot:
    """Everything above, for one node at one moment."""

    anchors: tuple[AnchorSnapshot, ...]
    bound_senders: tuple[BoundSenderSnapshot, ...]
    senders: tuple[SenderSnapshot, ...]
    """This node's live senders; one is forgotten as it ends (``StreamSender.state`` then
    says how)."""
    pending_attaches: int
    """Attach requests this node sent that have no answer yet."""
    attaches_served: int
    """Attach requests this node's anchors answered (Ok or refused) since it started."""
    heartbeat_task_running: bool
    """Whether the task that heartbeats remote senders runs (it stops when none is left)."""
    senders_per_transport: Mapping[str, int]
    """This node's live senders by transport key (``local`` for same-node anchors)."""
    bound_per_transport: Mapping[str, int]
    """Remote senders bound to this node's anchors, by transport key."""
    per_stream: PerStreamSnapshot | None
    """The per-stream path's consumer side; None on a mux-only node."""
