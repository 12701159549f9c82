"""Where a node listens: the peer record every discovery backend publishes and reads.

A :class:`PeerRecord` says where one node listens (identity, UDP address, label, lane
count, when it last vouched for it). It is the unit of discovery: a backend publishes a
node's own record and reads the others', and the messenger's peer registry holds them.
Construction validates every field and :meth:`PeerRecord.from_bytes` reads stored bytes
as hostile, because a shared store can hold anything.

A record only ever says where a node claims to be. Who answers at that address is
decided by the mutual-TLS handshake, which proves the InstanceId from the certificate,
so a wrong or forged record can misdirect a dial but never impersonate a peer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ..errors import ConfigurationError, PeerRecordError
from ..ids import InstanceId
from ..transport.config import MAX_LANES

__all__ = ["PEER_RECORD_MAX_BYTES", "PeerRecord", "peer_address"]

PEER_RECORD_MAX_BYTES = 64 * 1024
"""Largest record file read; anything bigger is junk, and reading it would waste memory."""

_MAX_HOST_LENGTH = 255


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
