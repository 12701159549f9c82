"""The consumer side's binds: who may claim each, on which lane it counts, when it expires.

An attach (or a pre-bind) creates the stream's :class:`IngressSlot` before any record
arrives; the OpenSlot in the sender's first batch claims it. Between the two the bind
waits here, keyed by (anchor id, routing session). Three things hang off a bind:

* **Who may claim it.** An attach names its sender, and only that peer's OpenSlot claims
  the bind. A pre-bind (a zero-RTT ticket) names nobody until an OpenSlot claims it or an
  ordinary attach adopts it.
* **Its lane load.** The stream counts on its chosen lane from the bind until its slot
  ends or the bind is given back (:mod:`.placement`).
* **Its accept window.** ``MuxConfig.prebind_timeout`` after the bind, an unclaimed bind is
  reaped: its consumer reads ``Dropped``. The deadlines share one queue, an
  insertion-ordered dict (every window is the same length, so insertion order is deadline
  order) from which a claim or a release deletes its entry at once, walked on the credit
  sweep tick: no timer per bind, memory only for binds still waiting, and a window closes
  at most one sweep interval late.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from .contracts import InMemoryBindRegistry
from .credit import IngressSlot
from .placement import LaneLoads, Placement

if TYPE_CHECKING:
    from ..streaming.anchor import AnchorEntry, RemoteSender

__all__ = ["Bind", "BindBook"]

BindKey = tuple[int, int]
"""(anchor local id, routing session id)."""


class Bind:
    """One stream's bind, from attach or pre-bind until its anchor lets go of it."""

    __slots__ = ("arrival", "entry", "placement", "remote", "slot")

    def __init__(
        self, entry: AnchorEntry, remote: RemoteSender, slot: IngressSlot, placement: Placement
    ) -> None:
        self.entry = entry
        self.remote = remote
        self.slot = slot
        self.placement = placement
        self.arrival: tuple[Hashable, int] | None = None
        """(peer, lane) the claiming OpenSlot arrived on: where replies about it go."""


class BindBook(InMemoryBindRegistry):
    """Every bind of this node's mux; also the :class:`BindRegistry` its ingress claims from."""

    __slots__ = ("_accept", "_book", "_window", "loads")

    def __init__(self, accept_window: float) -> None:
        super().__init__()
        self.loads = LaneLoads()
        self._book: dict[BindKey, Bind] = {}
        self._accept: dict[BindKey, float] = {}
        self._window = accept_window

    def add(
        self,
        entry: AnchorEntry,
        remote: RemoteSender,
        slot: IngressSlot,
        *,
        lanes: int,
        now: float,
    ) -> Bind:
        """Place and register a new bind; ``remote.node`` None makes it a pre-bind."""
        key = (entry.local_id, remote.session_id)
        placement = self.loads.place(remote.node, remote.lane_key, lanes)
        self.bind(entry.local_id, remote.session_id, slot, peer=remote.node)
        bind = self._book[key] = Bind(entry, remote, slot, placement)
        slot.on_end = lambda: self.loads.release(placement)
        self._accept[key] = now + self._window
        return bind

    def get(self, anchor_id: int, session_id: int) -> Bind | None:
        return self._book.get((anchor_id, session_id))

    def adopt(self, bind: Bind, peer: Hashable) -> None:
        """An ordinary attach took over an unclaimed pre-bind: only ``peer`` may claim it now."""
        key = (bind.entry.local_id, bind.remote.session_id)
        if self.release(*key) is not None:
            self.bind(*key, bind.slot, peer=peer)
        self.loads.assign(bind.placement, peer)

    def claim(
        self, peer: Hashable, lane: int, anchor_id: int, session_id: int
    ) -> IngressSlot | None:
        slot = super().claim(peer, lane, anchor_id, session_id)
        if slot is not None:
            self._accept.pop((anchor_id, session_id), None)
            bind = self._book.get((anchor_id, session_id))
            if bind is not None:
                bind.arrival = (peer, lane)
                self.loads.assign(bind.placement, peer)
                self._claimed(bind, peer)
        return slot

    @staticmethod
    def _claimed(bind: Bind, peer: Hashable) -> None:
        """A pre-bind met its sender: from now on it is an attached stream like any other."""
        remote = bind.remote
        if remote.prebound:
            remote.node = peer  # type: ignore[assignment]  # an InstanceId on every real path
            remote.prebound = False
            entry = bind.entry
            if entry.prebind is remote:
                entry.prebind = None
            entry.attached = True

    def remove(self, anchor_id: int, session_id: int) -> Bind | None:
        """The anchor let go of the stream: give back an unclaimed bind and its lane load."""
        bind = self._book.pop((anchor_id, session_id), None)
        self._accept.pop((anchor_id, session_id), None)
        self.release(anchor_id, session_id)
        if bind is not None:
            self.loads.release(bind.placement)
        return bind

    def expired(self, now: float, reap: Callable[[Bind], None]) -> int:
        """Reap every bind whose accept window closed unclaimed; returns how many."""
        accept = self._accept
        due: list[BindKey] = []
        for key, deadline in accept.items():
            if deadline > now:
                break
            due.append(key)
        reaped = 0
        for key in due:
            del accept[key]
            bind = self._book.get(key)
            if bind is not None and not bind.slot.opened:
                reaped += 1
                reap(bind)
        return reaped

    @property
    def waiting(self) -> int:
        """Binds registered and not yet claimed."""
        return len(self)

    def waiting_by_kind(self) -> tuple[int, int]:
        """(attach binds, pre-binds) not yet claimed. O(binds): for snapshots only."""
        attaches = prebinds = 0
        for bind in self._book.values():
            if bind.slot.opened:
                continue
            if bind.remote.prebound:
                prebinds += 1
            else:
                attaches += 1
        return attaches, prebinds
