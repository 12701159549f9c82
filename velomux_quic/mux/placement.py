"""Where the receiver puts each new stream: the lane loads it chooses by.

The receiver picks a stream's lane once, when it binds the slot (an attach or a pre-bind),
and the stream counts on that lane from the bind until its slot closes or its bind is
given back. Two views of the same counts are kept, because the two unkeyed choices ask
different questions:

* an attach knows its sender, and asks which lane carries the least *from that sender*
  (its live slots plus the binds answered and not yet claimed by an OpenSlot: without the
  unclaimed ones, attaches answered together would all pick lane 0);
* a pre-bind knows no sender, and asks which lane carries the least *on this node*, live
  slots from every peer included (a frontend's tickets are claimed within milliseconds
  and then live for seconds, so counting only unclaimed pre-binds would see empty lanes).

A load counts on the chosen lane, never on the arrival lane: a sender with fewer lanes
sends lane k on k modulo its own count, and counting arrivals would leave the upper lanes
looking empty forever.
"""

from __future__ import annotations

from collections.abc import Hashable

from .lanes import lane_for_key, least_loaded
from .protocol import MAX_LANES

__all__ = ["LaneLoads", "Placement"]


class Placement:
    """One bound stream's place: its lane, and the peer it counts for once one is known."""

    __slots__ = ("lane", "live", "peer")

    def __init__(self, lane: int, peer: Hashable | None) -> None:
        self.lane = lane
        self.peer = peer
        self.live = True


class LaneLoads:
    """Per-peer and node-wide lane loads; every count changes through a :class:`Placement`."""

    __slots__ = ("_by_peer", "_node")

    def __init__(self) -> None:
        self._node = [0] * MAX_LANES
        self._by_peer: dict[Hashable, list[int]] = {}

    @property
    def peers(self) -> frozenset[Hashable]:
        """The peers with at least one stream counted (a peer with none is forgotten)."""
        return frozenset(self._by_peer)

    def node_loads(self, lanes: int) -> list[int]:
        return self._node[:lanes]

    def peer_loads(self, peer: Hashable, lanes: int) -> list[int]:
        loads = self._by_peer.get(peer)
        return [0] * lanes if loads is None else loads[:lanes]

    def choose(self, peer: Hashable | None, key: int | None, lanes: int) -> int:
        """The lane for a new bind: the key's hash lane, else the least loaded (ties low).

        ``peer`` None is a pre-bind: it weighs the node's loads instead of one sender's.
        """
        lanes = max(1, min(lanes, MAX_LANES))
        if lanes == 1:
            return 0
        if key is not None:
            return lane_for_key(key, lanes)
        loads = self.node_loads(lanes) if peer is None else self.peer_loads(peer, lanes)
        return least_loaded(loads)

    def place(self, peer: Hashable | None, key: int | None, lanes: int) -> Placement:
        placement = Placement(self.choose(peer, key, lanes), None)
        self._node[placement.lane] += 1
        if peer is not None:
            self.assign(placement, peer)
        return placement

    def assign(self, placement: Placement, peer: Hashable) -> None:
        """A pre-bind met its sender (an OpenSlot claimed it, or an attach adopted it)."""
        if placement.peer is not None or not placement.live:
            return
        placement.peer = peer
        loads = self._by_peer.get(peer)
        if loads is None:
            loads = self._by_peer[peer] = [0] * MAX_LANES
        loads[placement.lane] += 1

    def release(self, placement: Placement) -> None:
        """The slot closed or the bind was given back; idempotent."""
        if not placement.live:
            return
        placement.live = False
        self._node[placement.lane] -= 1
        peer = placement.peer
        if peer is None:
            return
        loads = self._by_peer[peer]
        loads[placement.lane] -= 1
        if not any(loads):
            del self._by_peer[peer]
