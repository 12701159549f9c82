"""The messenger's peer registry, and how discovery's news reaches it.

:class:`PeerRegistry` is the in-memory map the messenger routes by: InstanceId to
:class:`~velomux_quic.discovery.PeerRecord`, and WorkerId back to InstanceId, because a
stream handle carries only the 64-bit WorkerId of its consumer node. A discovery backend
(:mod:`velomux_quic.discovery`) fills it: :func:`sync_registry` merges a backend's
snapshot, and a :class:`DiscoveryFeed` applies the joins, moves and leaves a watching
backend pushes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..discovery import PeerDiscovery, PeerListener, PeerRecord
from ..errors import WorkerIdCollision
from ..ids import InstanceId, WorkerId, worker_id_of

__all__ = [
    "DiscoveryFeed",
    "PeerRegistry",
    "SyncReport",
    "sync_registry",
]

_log = logging.getLogger(__name__)


class PeerRegistry:
    """The messenger's map of known peers: InstanceId to record, WorkerId to InstanceId.

    The registry is where WorkerId collisions are caught: it refuses (with
    :class:`WorkerIdCollision`) a record whose WorkerId another InstanceId already
    holds, because a stream handle carries only the WorkerId and must resolve to
    exactly one node. Adding a record for an InstanceId already present replaces it
    (the node moved or republished). ``worker_id`` is the InstanceId-to-WorkerId
    function; it is a parameter so a collision, practically unreachable with the real
    hash, can be produced on purpose.

    The registry belongs to one event loop and is not thread-safe. Listeners run
    synchronously, after the change, in subscription order; one that raises is logged
    and does not stop the others or undo the change.
    """

    def __init__(
        self,
        records: Iterable[PeerRecord] = (),
        *,
        worker_id: Callable[[InstanceId], WorkerId] = worker_id_of,
    ) -> None:
        self._worker_id = worker_id
        self._records: dict[InstanceId, PeerRecord] = {}
        self._by_worker: dict[WorkerId, InstanceId] = {}
        self._listeners: list[PeerListener] = []
        for record in records:
            self.add(record)

    def add(self, record: PeerRecord) -> bool:
        """Add or replace ``record``; True if the registry changed (listeners were told).

        Raises :class:`WorkerIdCollision`, changing nothing, when a different
        InstanceId already holds the record's WorkerId.
        """
        instance_id = record.instance_id
        worker = self._worker_id(instance_id)
        holder = self._by_worker.get(worker)
        if holder is not None and holder != instance_id:
            raise WorkerIdCollision(worker, holder, instance_id)
        if self._records.get(instance_id) == record:
            return False
        self._records[instance_id] = record
        self._by_worker[worker] = instance_id
        self._notify(record, instance_id)
        return True

    def remove(self, instance_id: InstanceId) -> PeerRecord | None:
        """Forget a peer and free its WorkerId; returns its record, None if unknown."""
        record = self._records.pop(instance_id, None)
        if record is None:
            return None
        del self._by_worker[self._worker_id(instance_id)]
        self._notify(None, instance_id)
        return record

    def get(self, instance_id: InstanceId) -> PeerRecord | None:
        """The record of ``instance_id``, or None when the node is not known."""
        return self._records.get(instance_id)

    def by_worker(self, worker_id: WorkerId) -> InstanceId | None:
        """The InstanceId a stream handle's WorkerId names, None if no known peer has it."""
        return self._by_worker.get(worker_id)

    def subscribe(self, callback: PeerListener) -> Callable[[], None]:
        """Call ``callback`` on every change; returns a function that unsubscribes it.

        A listener is told after the registry changed, so it sees the new state if it
        reads the registry. The returned function is idempotent.
        """
        self._listeners.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return unsubscribe

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._records

    def __iter__(self) -> Iterator[PeerRecord]:
        """The current records; a copy, so listeners and callers may change the registry."""
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def _notify(self, record: PeerRecord | None, instance_id: InstanceId) -> None:
        for listener in list(self._listeners):
            try:
                listener(record, instance_id)
            except Exception:
                _log.exception("peer registry listener %r failed for %s", listener, instance_id)


class DiscoveryFeed:
    """Applies what a :class:`PeerWatch` backend pushes to a :class:`PeerRegistry`.

    A join or a change is ``registry.add`` (a WorkerId collision is logged, counted in
    ``collisions`` and kept out, as in :func:`sync_registry`). A leave removes a peer only
    if discovery brought it in and nobody replaced its record since: a peer configured
    statically or added with ``add_peer`` before discovery heard of it may have its
    address updated by discovery, but is never removed by it, and a record the
    application replaced is the application's. The node's own InstanceId is skipped:
    a record naming this node (its own, or a forged one) says nothing it needs.
    ``on_moved(instance_id)`` is called when a known peer's address changed, so the
    messenger can drop a connection to where the peer no longer is.
    """

    def __init__(
        self,
        registry: PeerRegistry,
        *,
        own: InstanceId | None = None,
        on_moved: Callable[[InstanceId], None] | None = None,
    ) -> None:
        self._registry = registry
        self._own = own
        self._on_moved = on_moved
        self._brought: dict[InstanceId, PeerRecord] = {}
        self.collisions = 0
        """Records kept out because another peer holds their WorkerId."""

    def brought_in(self) -> set[InstanceId]:
        """The peers this feed added and would remove on their leave."""
        return set(self._brought)

    def __call__(self, record: PeerRecord | None, instance_id: InstanceId) -> None:
        if instance_id == self._own:
            return
        if record is None:
            brought = self._brought.pop(instance_id, None)
            if brought is not None and self._registry.get(instance_id) == brought:
                self._registry.remove(instance_id)
            return
        previous = self._registry.get(instance_id)
        try:
            self._registry.add(record)
        except WorkerIdCollision as exc:
            self.collisions += 1
            _log.warning("peer %s not added: %s", instance_id, exc)
            return
        if previous is None or instance_id in self._brought:
            self._brought[instance_id] = record
        if previous is not None and previous.address != record.address and self._on_moved:
            self._on_moved(instance_id)


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What :func:`sync_registry` did, by InstanceId, for callers that log or count it."""

    added: tuple[InstanceId, ...] = ()
    updated: tuple[InstanceId, ...] = ()
    removed: tuple[InstanceId, ...] = ()
    collisions: tuple[WorkerIdCollision, ...] = ()


async def sync_registry(
    registry: PeerRegistry, discovery: PeerDiscovery, *, prune: bool = False
) -> SyncReport:
    """Merge a discovery snapshot into ``registry``: add new records, replace changed ones.

    A record whose WorkerId another peer already holds is kept out and logged as a
    warning rather than raised: one colliding node must not stop the rest of the
    cluster from being learnt, and the peer already in the registry keeps its routes.
    With ``prune`` the registry also forgets peers the snapshot no longer has; use it
    only when this discovery is the registry's sole source, since peers registered by
    other means would be forgotten too.
    """
    records = await discovery.snapshot()
    added: list[InstanceId] = []
    updated: list[InstanceId] = []
    removed: list[InstanceId] = []
    collisions: list[WorkerIdCollision] = []
    for record in records:
        known = record.instance_id in registry
        try:
            changed = registry.add(record)
        except WorkerIdCollision as exc:
            _log.warning("peer %s not added: %s", record.instance_id, exc)
            collisions.append(exc)
            continue
        if changed:
            (updated if known else added).append(record.instance_id)
    if prune:
        current = {record.instance_id for record in records}
        for record in registry:
            if record.instance_id not in current:
                registry.remove(record.instance_id)
                removed.append(record.instance_id)
    return SyncReport(tuple(added), tuple(updated), tuple(removed), tuple(collisions))
