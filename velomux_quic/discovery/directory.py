"""Discovery through a directory of record files, for the processes of one host."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigurationError, PeerRecordError, UsageError
from ..ids import InstanceId
from ..security._files import write_public
from .records import PEER_RECORD_MAX_BYTES, PeerRecord

__all__ = ["PEER_DIRECTORY_MODE", "DirectoryPeers"]

_log = logging.getLogger(__name__)

PEER_DIRECTORY_MODE = 0o755
"""Mode of a peer directory we create: other users' processes on the host may read it."""

_RECORD_SUFFIX = ".json"


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
