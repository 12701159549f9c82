"""What a discovery backend is: the pull protocol every backend answers, and the optional
push half of one that hears changes as they happen.

Backends key records by InstanceId only; the messenger's peer registry
(:mod:`velomux_quic.messenger.peers`) applies what they say, and is where a WorkerId
collision is caught. Anything that can publish, withdraw and list records fits
:class:`PeerDiscovery`; three ship in this package (:class:`~.static.StaticPeers`,
:class:`~.directory.DirectoryPeers`, :class:`~.etcd.EtcdPeers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..ids import InstanceId
from .records import PeerRecord

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["PeerDiscovery", "PeerListener", "PeerWatch"]

PeerListener = Callable[[PeerRecord | None, InstanceId], None]
"""Called with ``(record, instance_id)`` after a peer is added or changed, and
``(None, instance_id)`` after it is removed."""


@runtime_checkable
class PeerDiscovery(Protocol):
    """A backend that tells nodes where the other nodes are.

    Backends key records by InstanceId only. WorkerId resolution belongs to the
    messenger's :class:`~velomux_quic.PeerRegistry`, which takes what a backend says,
    because that is where a WorkerId collision is caught; answering WorkerIds in the
    backend would bypass it.
    """

    async def publish(self, record: PeerRecord) -> None:
        """Make ``record`` visible (replacing an earlier one for the same node)."""

    async def withdraw(self, instance_id: InstanceId) -> None:
        """Remove a node's record; withdrawing an unknown node does nothing."""

    async def lookup(self, instance_id: InstanceId) -> PeerRecord | None:
        """One node's current record, None if there is none (or it is unusable)."""

    async def snapshot(self) -> list[PeerRecord]:
        """Every current, readable record."""

    async def close(self) -> None:
        """Release the backend; records published through it are withdrawn, as a
        lease-based backend's would lapse. Publishing afterwards raises ``RuntimeError``."""


@runtime_checkable
class PeerWatch(Protocol):
    """The optional push half of discovery, for a backend that hears changes as they happen.

    :class:`PeerDiscovery` is pull: the messenger loads a snapshot at start and looks up
    a peer it does not know. A backend with a watch (etcd) also implements this, and the
    messenger then uses it instead of the one snapshot: it subscribes a
    :class:`DiscoveryFeed` with :meth:`watch` right after publishing its own record, so
    joins, moves (a node back at a new address) and leaves reach the registry at once.
    ``connected`` is what the node's readiness reads; :meth:`bind_metrics` puts the
    backend's series into the node's Prometheus registry.
    """

    @property
    def connected(self) -> bool:
        """Whether the backend's view is live now (False while its store is unreachable)."""

    def watch(self, listener: PeerListener) -> Callable[[], None]:
        """Call ``listener(record, instance_id)`` for every record the backend knows now
        (synchronously, before returning) and for each change after (``None`` for a
        leave); returns a function that unsubscribes it. Records the backend rejected
        never reach a listener."""

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Export the backend's metrics in ``registry`` (the node's)."""
