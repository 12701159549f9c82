"""The few QUIC packets the endpoint reads or writes itself, outside any connection.

Routing a datagram, refusing a version and asking for address validation happen before a
connection (and so an engine) exists, so the endpoint does them on the wire format of
RFC 8999 and RFC 9000 alone: the long header's invariant fields and an Initial's token
(RFC 9000 section 17.2), Version Negotiation (section 17.2.1) and Retry (section 17.2.5,
with the integrity tag of RFC 9001 section 5.8 and RFC 9369 section 3.3.3). Nothing here
imports an engine, so a node on either engine routes and validates the same way, and a
node on qh3 needs no aioquic.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "MIN_INITIAL_DATAGRAM",
    "LongHeader",
    "PacketType",
    "encode_retry",
    "encode_version_negotiation",
    "parse_long_header",
    "retry_integrity_tag",
    "runs_by_connection",
]

MIN_INITIAL_DATAGRAM = 1200
"""A client's Initial arrives in a datagram of at least this many bytes (RFC 9000 section
14.1); a smaller one is dropped unanswered, so a spoofed source gains no amplification."""

_LONG_HEADER = 0x80
_FIXED_BIT = 0x40
_MAX_CID = 20
_TAG_SIZE = 16
_VERSION_1 = 0x00000001
_VERSION_2 = 0x6B3343CF

_RETRY_SECRETS: dict[int, tuple[bytes, bytes]] = {
    _VERSION_1: (
        bytes.fromhex("be0c690b9f66575a1d766b54e368c84e"),
        bytes.fromhex("461599d35d632bf2239825bb"),
    ),
    _VERSION_2: (
        bytes.fromhex("8fb4b01b56ac48e260fbcbcead7ccc92"),
        bytes.fromhex("d86969bc2d7c6d9990efb04a"),
    ),
}
"""The published key and nonce of each version's Retry integrity tag."""


class PacketType(enum.Enum):
    """The kinds of long-header packet."""

    INITIAL = "initial"
    ZERO_RTT = "0-rtt"
    HANDSHAKE = "handshake"
    RETRY = "retry"
    VERSION_NEGOTIATION = "version_negotiation"


_TYPES_V1 = (PacketType.INITIAL, PacketType.ZERO_RTT, PacketType.HANDSHAKE, PacketType.RETRY)
_TYPES_V2 = (PacketType.RETRY, PacketType.INITIAL, PacketType.ZERO_RTT, PacketType.HANDSHAKE)
"""RFC 9369 section 3.2 permutes the type bits, so a middlebox cannot ossify on them."""


@dataclass(frozen=True, slots=True)
class LongHeader:
    """What the endpoint reads of a long-header packet before any connection owns it."""

    packet_type: PacketType
    version: int
    destination_cid: bytes
    source_cid: bytes
    token: bytes
    """An Initial's token (empty when it has none); empty for the other types."""


Owner = TypeVar("Owner")


def runs_by_connection(
    datagrams: list[bytes], owners: Mapping[bytes, Owner], cid_length: int
) -> list[tuple[Owner | None, list[bytes]]]:
    """Cut the datagrams of one burst into runs, in order: consecutive short-header
    datagrams whose destination connection ID ``owners`` knows, with that owner, or one
    datagram alone with ``None`` (a long header, an unknown ID: the endpoint's
    one-datagram path decides). A burst is usually one connection's, one run; the kernel
    may still join any datagrams of one flow, so one run per connection is never assumed."""
    runs: list[tuple[Owner | None, list[bytes]]] = []
    run: list[bytes] = []
    owner: Owner | None = None
    for data in datagrams:
        found = None
        if data and not data[0] & _LONG_HEADER:
            found = owners.get(data[1 : 1 + cid_length])
        if found is not None and found is owner:
            run.append(data)
            continue
        if run:
            runs.append((owner, run))
        if found is None:
            runs.append((None, [data]))
            run, owner = [], None
        else:
            run, owner = [data], found
    if run:
        runs.append((owner, run))
    return runs


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """A variable-length integer (RFC 9000 section 16) at ``at``: (value, next offset)."""
    if at >= len(data):
        raise ValueError("packet ends inside a variable-length integer")
    length = 1 << (data[at] >> 6)
    end = at + length
    if end > len(data):
        raise ValueError("packet ends inside a variable-length integer")
    value = data[at] & 0x3F
    for byte in data[at + 1 : end]:
        value = (value << 8) | byte
    return value, end


def _cid(data: bytes, at: int, which: str) -> tuple[bytes, int]:
    if at >= len(data):
        raise ValueError(f"packet ends before its {which} connection ID")
    length = data[at]
    if length > _MAX_CID:
        raise ValueError(f"{which} connection ID of {length} bytes (at most {_MAX_CID})")
    end = at + 1 + length
    if end > len(data):
        raise ValueError(f"packet ends inside its {which} connection ID")
    return data[at + 1 : end], end


def parse_long_header(data: bytes) -> LongHeader:
    """Read a long header's invariant fields, and an Initial's token.

    Raises ValueError for anything that is not a well-formed long header (the endpoint
    counts it as malformed and drops it); the packet's protected part is left to the
    connection's engine.
    """
    if len(data) < 7 or not data[0] & _LONG_HEADER:
        raise ValueError("not a long-header packet")
    first = data[0]
    version = int.from_bytes(data[1:5], "big")
    destination_cid, at = _cid(data, 5, "destination")
    source_cid, at = _cid(data, at, "source")
    if version == 0:
        if (len(data) - at) % 4:
            raise ValueError("version negotiation lists a partial version")
        return LongHeader(PacketType.VERSION_NEGOTIATION, version, destination_cid, source_cid, b"")
    if not first & _FIXED_BIT:
        raise ValueError("long header with its fixed bit clear")
    kinds = _TYPES_V2 if version == _VERSION_2 else _TYPES_V1
    packet_type = kinds[(first & 0x30) >> 4]
    token = b""
    if packet_type is PacketType.RETRY:
        if len(data) - at < _TAG_SIZE:
            raise ValueError("retry packet shorter than its integrity tag")
        token = data[at : len(data) - _TAG_SIZE]
        return LongHeader(packet_type, version, destination_cid, source_cid, token)
    if packet_type is PacketType.INITIAL:
        token_length, at = _varint(data, at)
        if at + token_length > len(data):
            raise ValueError("packet ends inside its token")
        token = data[at : at + token_length]
        at += token_length
    rest, at = _varint(data, at)
    if at + rest > len(data):
        raise ValueError("packet payload is truncated")
    return LongHeader(packet_type, version, destination_cid, source_cid, token)


def encode_version_negotiation(
    destination_cid: bytes, source_cid: bytes, supported_versions: list[int]
) -> bytes:
    """A Version Negotiation packet listing ``supported_versions`` (RFC 9000 section 17.2.1).

    Its connection IDs are the client's, swapped: ``destination_cid`` is the client's
    source connection ID and ``source_cid`` the destination it chose.
    """
    first = os.urandom(1)[0] | _LONG_HEADER
    return b"".join(
        (
            bytes((first,)),
            (0).to_bytes(4, "big"),
            bytes((len(destination_cid),)),
            destination_cid,
            bytes((len(source_cid),)),
            source_cid,
            *(version.to_bytes(4, "big") for version in supported_versions),
        )
    )


def encode_retry(
    version: int,
    source_cid: bytes,
    destination_cid: bytes,
    original_destination_cid: bytes,
    token: bytes,
) -> bytes:
    """A Retry packet carrying ``token``, with its integrity tag (RFC 9001 section 5.8).

    ``destination_cid`` is the client's source connection ID, ``source_cid`` the new one
    the server chose, and ``original_destination_cid`` the one the client's Initial was
    sent to, which the tag covers so that a Retry cannot be replayed at another dial.
    """
    if version not in _RETRY_SECRETS:
        raise ValueError(f"no Retry integrity key for QUIC version {version:#x}")
    type_bits = 0 if version == _VERSION_2 else 3
    header = b"".join(
        (
            bytes((_LONG_HEADER | _FIXED_BIT | (type_bits << 4),)),
            version.to_bytes(4, "big"),
            bytes((len(destination_cid),)),
            destination_cid,
            bytes((len(source_cid),)),
            source_cid,
            token,
        )
    )
    return header + retry_integrity_tag(version, original_destination_cid, header)


def retry_integrity_tag(version: int, original_destination_cid: bytes, header: bytes) -> bytes:
    """The tag that ends a Retry whose other bytes are ``header`` (RFC 9001 section 5.8).

    The client drops a Retry whose tag does not match, so a wrong key only ever shows as
    dials that never complete: it is checked against the RFCs' own examples in the tests.
    """
    secrets = _RETRY_SECRETS.get(version)
    if secrets is None:
        raise ValueError(f"no Retry integrity key for QUIC version {version:#x}")
    key, nonce = secrets
    pseudo = bytes((len(original_destination_cid),)) + original_destination_cid + header
    return AESGCM(key).encrypt(nonce, b"", pseudo)
