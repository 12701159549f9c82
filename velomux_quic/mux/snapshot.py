"""A read-only picture of one node's mux, for operators and tests.

:meth:`~velomux_quic.mux.transport.MuxTransport.snapshot` builds a :class:`MuxSnapshot`
from the live batchers, ingress tables, binds and budgets. Everything here is a frozen
value: holding a snapshot keeps no library object alive and changes nothing, and two
snapshots compare equal when the mux was in the same state. Taking one walks every live
slot (O(slots)), so it is for a scrape, a debug endpoint or a test, never for a per-record
path.

The keys of :attr:`MuxSnapshot.egress` and :attr:`MuxSnapshot.ingress` are ``(peer, lane)``:
the peer's InstanceId and the lane index. Egress lanes are this node's batchers *to* the
peer; ingress lanes are the tables applying what the peer sends *to* this node.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from .slots import SlotState

__all__ = [
    "EgressLaneSnapshot",
    "IngressLaneSnapshot",
    "MuxSnapshot",
    "PeerBudgetSnapshot",
]


@dataclass(frozen=True, slots=True)
class EgressLaneSnapshot:
    """One batcher: the streams this node sends to one (peer, lane)."""

    epoch: int
    """The epoch its batches carry now (a new one after every epoch death)."""
    batch_seq: int
    """The ``batch_seq`` of the next batch it writes."""
    live_slots: int
    """Slots open on this lane (every state but CLOSED)."""
    slot_states: Mapping[SlotState, int]
    """Live slots by :class:`~velomux_quic.mux.slots.SlotState` (every state but CLOSED
    listed, zero included)."""
    fenced_slots: int
    """Live slots whose later records wait for a staged singleton's admission."""
    queued_records: int
    """Records waiting with credit, not yet written (a plateau under ``Manual``: a missing
    ``flush_batch``)."""
    withheld_records: int
    """Records waiting for credit (or behind a fence)."""
    queued_bytes: int
    """Bytes of every record waiting in this batcher, with or without credit."""
    queue_limit: int
    """``MuxConfig.peer_queue_bytes``: past it producers with records queued here wait
    (``queued_bytes`` stays below it plus one record per live slot)."""
    parked: bool
    """A written batch waits for transport admission: the lane stops draining its slots."""
    epoch_deaths: int
    """Epochs that died on this batcher since it was made."""


@dataclass(frozen=True, slots=True)
class IngressLaneSnapshot:
    """One ingress table: the streams one peer sends to this node on one lane."""

    epoch: int | None
    """The peer epoch the table follows (None before its first batch)."""
    live_slots: int
    """Slots claimed by an OpenSlot and not yet ended."""
    held_records: int
    """Records that arrived ahead of their ``frame_seq`` and wait for the gap to close."""
    held_bytes: int
    """Bytes of those held records (charged to the peer's budget)."""
    buffered_records: int
    """Records delivered into the slots' buffers and not yet read by their consumers."""
    buffered_bytes: int
    """Bytes of those buffered records (charged to the peer's budget)."""


@dataclass(frozen=True, slots=True)
class PeerBudgetSnapshot:
    """The bytes one peer's streams hold on this node, across all its lanes."""

    used: int
    limit: int


@dataclass(frozen=True, slots=True)
class MuxSnapshot:
    """Everything :meth:`MuxTransport.snapshot` reports; see the module docstring."""

    egress: Mapping[tuple[Hashable, int], EgressLaneSnapshot]
    """This node's batchers, by (peer, lane)."""
    ingress: Mapping[tuple[Hashable, int], IngressLaneSnapshot]
    """This node's ingress tables, by (peer, lane)."""
    pending_binds: int
    """Attach binds answered and waiting for the sender's OpenSlot."""
    unclaimed_prebinds: int
    """Pre-binds (zero-RTT tickets) no OpenSlot or attach has claimed yet."""
    peer_budgets: Mapping[Hashable, PeerBudgetSnapshot]
    """Ingress byte budgets by peer (``MuxConfig.peer_byte_budget``)."""
    lane_loads: Mapping[Hashable, tuple[int, ...]]
    """Streams each peer has placed on each of its lanes here (live slots plus answered,
    unclaimed binds), by peer: what the receiver weighs when it picks a lane."""
    health_checks_running: int = 0
    """Peers whose health-check task runs (one per peer with live producer slots; it ends
    at its first wake-up, ``health_check_interval`` apart, once the peer has none)."""

    def egress_slots(self, peer: Hashable) -> int:
        """Live egress slots to ``peer`` on all its lanes."""
        return sum(lane.live_slots for (to, _), lane in self.egress.items() if to == peer)

    def ingress_slots(self, peer: Hashable) -> dict[int, int]:
        """Live ingress slots from ``peer``, by arrival lane (lanes with none left out)."""
        return {
            lane: table.live_slots
            for (sender, lane), table in self.ingress.items()
            if sender == peer and table.live_slots
        }
