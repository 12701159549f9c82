"""Discovery from a fixed list: the peers a node is configured with."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ConfigurationError, UsageError
from ..ids import InstanceId
from .records import PeerRecord

__all__ = ["StaticPeers"]


class StaticPeers:
    """Discovery from a fixed list, typically the peers section of the node config.

    Nobody else can see what this node publishes, so :meth:`publish` and
    :meth:`withdraw` only change this object's own view; that still lets a node hand
    its own record to the same code path as everyone else's. Listing one InstanceId
    twice is a configuration error and raises ``ValueError``.
    """

    def __init__(self, records: Iterable[PeerRecord] = ()) -> None:
        self._records: dict[InstanceId, PeerRecord] = {}
        self._published: set[InstanceId] = set()
        self._closed = False
        for record in records:
            if record.instance_id in self._records:
                raise ConfigurationError(
                    f"peer {record.instance_id} is listed twice: list each node once"
                )
            self._records[record.instance_id] = record

    async def publish(self, record: PeerRecord) -> None:
        """Add or replace ``record`` in the list."""
        if self._closed:
            raise UsageError("StaticPeers is closed: make a new one")
        self._records[record.instance_id] = record
        self._published.add(record.instance_id)

    async def withdraw(self, instance_id: InstanceId) -> None:
        """Drop the record of ``instance_id``, if any."""
        self._records.pop(instance_id, None)
        self._published.discard(instance_id)

    async def lookup(self, instance_id: InstanceId) -> PeerRecord | None:
        """The record of ``instance_id``, or None."""
        return self._records.get(instance_id)

    async def snapshot(self) -> list[PeerRecord]:
        """Every record in the list."""
        return sorted(self._records.values(), key=lambda record: record.instance_id)

    async def close(self) -> None:
        """Withdraw the records this object published."""
        self._closed = True
        for instance_id in list(self._published):
            await self.withdraw(instance_id)
