"""Who the other nodes are and where to reach them: peer records, the registry, discovery.

A :class:`PeerRecord` says where a node listens. :class:`PeerRegistry` is the in-memory
map the messenger routes by: InstanceId to record, and WorkerId back to InstanceId,
because a stream handle carries only the 64-bit WorkerId of its consumer node. A
:class:`PeerDiscovery` backend fills the registry; two ship here, a static list from
the node configuration (:class:`StaticPeers`) and a directory of record files shared
by the processes of one host (:class:`DirectoryPeers`); a third, on etcd, is
:class:`~velomux_quic.messenger.etcd.EtcdPeers` in its own module. Anything that can
publish, withdraw and list records fits the same protocol. A backend that also hears
changes as they happen (a watch) implements the optional :class:`PeerWatch` too; the
messenger then applies its joins, moves and leaves through a :class:`DiscoveryFeed`
instead of pulling a snapshot once.

Discovery only ever says where a node claims to be. Who answers at that address is
decided by the mutual-TLS handshake, which proves the InstanceId from the certificate,
so a wrong or forged record can misdirect a dial but never impersonate a peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

from velomux_quic.errors import (
    ConfigurationError,
    PeerRecordError,
    UsageError,
    WorkerIdCollision,
)
from velomux_quic.ids import InstanceId, WorkerId, worker_id_of
from velomux_quic.security._files import write_public
from velomux_quic.transport.config import MAX_LANES

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "PEER_DIRECTORY_MODE",
    "PEER_RECORD_MAX_BYTES",
    "DirectoryPeers",
    "DiscoveryFeed",
    "PeerDiscovery",
    "PeerListener",
    "PeerRecord",
    "PeerRecordError",
    "PeerRegistry",
    "PeerWatch",
    "StaticPeers",
    "SyncReport",
    "WorkerIdCollision",
    "peer_address",
    "sync_registry",
]

_log = logging.getLogger(__name__)

PEER_DIRECTORY_MODE = 0o755
"""Mode of a peer directory we create: other users' processes on the host may read it."""

PEER_RECORD_MAX_BYTES = 64 * 1024
"""Largest record file read; anything bigger is junk, and reading it would waste memory."""

_MAX_HOST_LENGTH = 255
_RECORD_SUFFIX = ".json"


# -- PeerRecord -----------------------------------------------------------------


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; ``"lanes": true`` is junk, not one lane.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_host(host: object) -> str:
    if not isinstance(host, str):
        raise PeerRecordError(f"host must be a string, got {type(host).__name__}")
    # Printable ASCII without spaces covers DNS names (IDNs in their punycode form),
    # IPv4 and IPv6 literals with zone ids; anything else is a corrupt record.
    if not 1 <= len(host) <= _MAX_HOST_LENGTH:
        raise PeerRecordError(f"host must be 1 to {_MAX_HOST_LENGTH} characters")
    if not (host.isascii() and host.isprintable()) or " " in host:
        raise PeerRecordError(f"host must be printable ASCII without spaces: {host!r}")
    return host


def _check_port(port: object) -> int:
    if not _is_int(port):
        raise PeerRecordError(f"port must be an integer, got {port!r}")
    # Port 0 means "any port" when binding; nobody can be dialled there.
    if not 1 <= port <= 65535:
        raise PeerRecordError(f"port must be 1 to 65535, got {port}")
    return port


def peer_address(address: object) -> tuple[str, int]:
    """A peer's address given as ``(host, port)`` or as the text ``"host:port"`` (the form
    TOML and ``velomux probe`` use; ``"[::1]:7000"`` for IPv6), checked.

    Raises :class:`~velomux_quic.errors.ConfigurationError`: this is what a caller
    passed, not bytes from a peer.
    """
    if isinstance(address, str):
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigurationError(
                f"a peer address is (host, port) or 'host:port', got {address!r}: "
                "write it as 'node-b.example.com:7000' or ('node-b.example.com', 7000)"
            )
        address = (host.strip("[]"), int(port))
    if not isinstance(address, tuple) or len(address) != 2:
        raise ConfigurationError(
            f"a peer address is (host, port) or 'host:port', got {address!r}: "
            "write it as 'node-b.example.com:7000' or ('node-b.example.com', 7000)"
        )
    try:
        return _check_host(address[0]), _check_port(address[1])
    except PeerRecordError as error:
        raise ConfigurationError(f"peer address {address!r}: {error}") from None


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """Where one node listens: its identity, UDP address, label and lane count.

    ``updated_at`` (unix seconds) is when the node last vouched for the record; a
    reader may treat records older than some age as left behind by a crashed node.
    It defaults to now, so a node builds its own record with no clock at hand.
    Construction validates every field, so a record in hand is always usable.
    """

    instance_id: InstanceId
    address: tuple[str, int]
    name: str = ""
    lanes: int = 1
    updated_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.instance_id, InstanceId):
            raise PeerRecordError(
                f"instance_id must be an InstanceId, got {type(self.instance_id).__name__}"
            )
        if not isinstance(self.address, tuple) or len(self.address) != 2:
            raise PeerRecordError(f"address must be a (host, port) tuple, got {self.address!r}")
        _check_host(self.address[0])
        _check_port(self.address[1])
        if not isinstance(self.name, str):
            raise PeerRecordError(f"name must be a string, got {type(self.name).__name__}")
        if not _is_int(self.lanes) or not 1 <= self.lanes <= MAX_LANES:
            raise PeerRecordError(f"lanes must be an integer 1 to {MAX_LANES}, got {self.lanes!r}")
        updated = self.updated_at
        if not isinstance(updated, (int, float)) or isinstance(updated, bool):
            raise PeerRecordError(f"updated_at must be a number, got {updated!r}")
        try:
            # JSON gives back ``5`` for ``5.0``; keep one type so equal records compare equal.
            seconds = float(updated)
        except OverflowError:
            # An integer past a float's range (JSON integers have any length).
            raise PeerRecordError("updated_at must be finite, got an integer past 1e308") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise PeerRecordError(f"updated_at must be finite and not negative, got {updated!r}")
        object.__setattr__(self, "updated_at", seconds)

    def refreshed(self, now: float | None = None) -> PeerRecord:
        """The same record stamped ``now`` (default: the current time), for republishing."""
        return dataclasses.replace(self, updated_at=time.time() if now is None else now)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; the address is a map so fields can be added to it later."""
        host, port = self.address
        return {
            "instance_id": str(self.instance_id),
            "address": {"host": host, "port": port},
            "name": self.name,
            "lanes": self.lanes,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_json(cls, obj: object) -> PeerRecord:
        """Validate and decode what :meth:`to_json` made; raises :class:`PeerRecordError`.

        Keys this version does not know are ignored, at the top level and inside
        ``address``: nodes of different versions share one directory (or one etcd
        prefix) during a rolling upgrade, and a newer node adding a field, say a
        certificate fingerprint, must not make older nodes drop its record and lose
        the route to it. A missing ``name`` or ``lanes`` takes the dataclass default;
        ``instance_id``, ``address`` and ``updated_at`` are required.
        """
        if not isinstance(obj, dict):
            raise PeerRecordError(f"a peer record is a JSON object, got {type(obj).__name__}")
        for key in ("instance_id", "address", "updated_at"):
            if key not in obj:
                raise PeerRecordError(f"peer record has no {key!r}")
        text = obj["instance_id"]
        if not isinstance(text, str):
            raise PeerRecordError(f"instance_id must be a string, got {text!r}")
        try:
            instance_id = InstanceId.parse(text)
        except ValueError as exc:
            raise PeerRecordError(f"instance_id is not a canonical UUID: {text!r}") from exc
        address = obj["address"]
        if not isinstance(address, dict) or "host" not in address or "port" not in address:
            raise PeerRecordError(f"address must be a map with host and port, got {address!r}")
        host = _check_host(address["host"])
        port = _check_port(address["port"])
        name = obj.get("name", "")
        lanes = obj.get("lanes", 1)
        updated_at = obj["updated_at"]
        # name, lanes and updated_at are checked by __post_init__, like any constructor call.
        return cls(instance_id, (host, port), name=name, lanes=lanes, updated_at=updated_at)

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerRecord:
        """Decode a record as stored (UTF-8 JSON, what a record file or a key-value store
        holds); raises :class:`PeerRecordError`, and nothing else, for any other bytes.

        The bytes come from whoever could write to the shared store, so every failure to
        parse them (bad UTF-8, bad JSON, nesting past the parser's depth, a number too
        long to read) is a malformed record, as much as a record with a bad field.
        """
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:
            # ValueError covers bad UTF-8, bad JSON (a partial write by a tool that does
            # not rename) and integers past the digit limit; RecursionError deep nesting.
            raise PeerRecordError(f"a peer record is UTF-8 JSON: {exc}") from None
        return cls.from_json(obj)


# -- PeerRegistry -------------------------------------------------------------------

PeerListener = Callable[[PeerRecord | None, InstanceId], None]
"""Called with ``(record, instance_id)`` after a peer is added or changed, and
``(None, instance_id)`` after it is removed."""


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


# -- Discovery ----------------------------------------------------------------------


@runtime_checkable
class PeerDiscovery(Protocol):
    """A backend that tells nodes where the other nodes are.

    Backends key records by InstanceId only. WorkerId resolution belongs to
    :class:`PeerRegistry`, after :func:`sync_registry`, because that is where a
    WorkerId collision is caught; answering WorkerIds in the backend would bypass it.
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


class DirectoryPeers:
    """Discovery through a directory of record files, for the processes of one host.

    Each node owns ``<instance-uuid>.json``. It is written to a temporary name in the
    same directory, flushed to disk and renamed over the old one, so a reader sees a
    whole record or the previous one, never a torn write; the temporary names start
    with a dot and do not end in ``.json``, so a scan never picks them up. (The
    directory itself is not fsynced: records describe live processes, and after a
    power loss every one of them is stale anyway.)

    Reading is forgiving because the directory is shared and a crashed or foreign
    process may leave anything in it: files that are unreadable, too large, not a
    record, or whose record names a different node than the file name are skipped and
    logged at debug level. With ``stale_after`` set, a record whose ``updated_at`` is
    more than that many seconds behind ``clock()`` is skipped too; since every reader
    is on the same host there is no clock skew to allow for, and a node that wants
    to stay visible republishes with :meth:`PeerRecord.refreshed` more often than
    that. Skipped files are never deleted: they may belong to a process that is about
    to fix them.

    File work runs in a worker thread (``asyncio.to_thread``) so a slow disk or a
    large directory does not stall the event loop. A missing directory is created
    with mode 0755 (narrowed by the umask); an existing one is left as it is.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        stale_after: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if stale_after is not None and not (math.isfinite(stale_after) and stale_after > 0):
            raise ConfigurationError(
                f"stale_after must be a positive number of seconds: {stale_after}"
            )
        self._directory = Path(directory)
        self._stale_after = stale_after
        self._clock = clock
        self._published: dict[InstanceId, PeerRecord] = {}
        self._closed = False
        # Once, at construction, so a directory we may not create fails here and not on
        # a later publish; a single mkdir is too quick to matter to the event loop.
        self._directory.mkdir(PEER_DIRECTORY_MODE, parents=True, exist_ok=True)

    @property
    def directory(self) -> Path:
        """The directory the records are files in."""
        return self._directory

    def path_of(self, instance_id: InstanceId) -> Path:
        """The file holding ``instance_id``'s record."""
        return self._directory / f"{instance_id}{_RECORD_SUFFIX}"

    async def publish(self, record: PeerRecord) -> None:
        """Write ``record`` as this node's file, atomically (withdrawn again at close)."""
        if self._closed:
            raise UsageError("DirectoryPeers is closed: make a new one")
        data = (json.dumps(record.to_json(), sort_keys=True) + "\n").encode()
        await asyncio.to_thread(write_public, self.path_of(record.instance_id), data)
        self._published[record.instance_id] = record

    async def withdraw(self, instance_id: InstanceId) -> None:
        """Remove the file of ``instance_id``, if any."""
        self._published.pop(instance_id, None)
        await asyncio.to_thread(self.path_of(instance_id).unlink, missing_ok=True)

    async def lookup(self, instance_id: InstanceId) -> PeerRecord | None:
        """The record in the file of ``instance_id``, or None when missing or unusable."""
        return await asyncio.to_thread(self._read, self.path_of(instance_id), instance_id)

    async def snapshot(self) -> list[PeerRecord]:
        """Every usable record in the directory (unreadable or stale files skipped)."""
        return await asyncio.to_thread(self._scan)

    async def close(self) -> None:
        """Withdraw what this object published, unless another writer replaced it since.

        A node restarted under the same identity may already have written a newer
        record; the comparison keeps this (older) object's close from deleting it.
        """
        self._closed = True
        published, self._published = self._published, {}
        for instance_id, record in published.items():
            await asyncio.to_thread(self._remove_if_unchanged, instance_id, record)

    def _remove_if_unchanged(self, instance_id: InstanceId, record: PeerRecord) -> None:
        path = self.path_of(instance_id)
        # Not staleness-filtered: our own old record is still ours to remove.
        if self._read(path, instance_id, skip_stale=False) == record:
            path.unlink(missing_ok=True)
        else:
            _log.debug("leaving %s: replaced since this process published it", path)

    def _scan(self) -> list[PeerRecord]:
        records = []
        with os.scandir(self._directory) as entries:
            for entry in entries:
                instance_id = _instance_of_file_name(entry.name)
                if instance_id is None:
                    continue
                record = self._read(Path(entry.path), instance_id)
                if record is not None:
                    records.append(record)
        records.sort(key=lambda record: record.instance_id)
        return records

    def _read(
        self, path: Path, instance_id: InstanceId, *, skip_stale: bool = True
    ) -> PeerRecord | None:
        try:
            data = _read_regular_file(path, PEER_RECORD_MAX_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            _log.debug("skipping peer record %s: %s", path, exc)
            return None
        try:
            record = PeerRecord.from_bytes(data)
        except PeerRecordError as exc:
            _log.debug("skipping malformed peer record %s: %s", path, exc)
            return None
        if record.instance_id != instance_id:
            _log.debug("skipping peer record %s: it describes %s", path, record.instance_id)
            return None
        if skip_stale and self._stale_after is not None:
            age = self._clock() - record.updated_at
            if age > self._stale_after:
                _log.debug("skipping stale peer record %s (%.1f s old)", path, age)
                return None
        return record


def _instance_of_file_name(name: str) -> InstanceId | None:
    """The InstanceId a record file is named for; None for any other name.

    Only the exact name :meth:`DirectoryPeers.path_of` writes counts: ``InstanceId.parse``
    also takes upper case, and two spellings would let two files describe one node.
    """
    if not name.endswith(_RECORD_SUFFIX):
        return None
    stem = name[: -len(_RECORD_SUFFIX)]
    try:
        instance_id = InstanceId.parse(stem)
    except ValueError:
        return None
    return instance_id if str(instance_id) == stem else None


def _read_regular_file(path: Path, limit: int) -> bytes:
    """Read at most ``limit`` bytes of a regular file, raising ``OSError`` otherwise.

    Non-blocking open plus a type check after it: a FIFO someone left under a record's
    name would otherwise hang the scan forever, and a device could be endless.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data


# -- Registry sync --------------------------------------------------------------------


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
