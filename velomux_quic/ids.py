"""Identities every layer shares: who a node is, and how a stream names its consumer.

An :class:`InstanceId` is a node's identity, proven by the URI SAN of its certificate.
A :class:`WorkerId` is a fixed 64-bit digest of it, small enough to ride in the upper
half of a :class:`StreamAnchorHandle`, so the mux finds a stream's destination peer
from the handle alone, with no lookup.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, NewType

from .errors import ConfigurationError

__all__ = [
    "MPSC_BIT",
    "InstanceId",
    "StreamAnchorHandle",
    "WorkerId",
    "new_instance_id",
    "worker_id_of",
]

U64_MAX = (1 << 64) - 1
MPSC_BIT = 1 << 63
"""Bit 63 of a handle's local id marks an MPSC anchor (SPSC local ids use 63 bits)."""

WorkerId = NewType("WorkerId", int)
"""A u64 naming a node inside stream handles; see :func:`worker_id_of`."""

_WORKER_ID_PERSON = b"velomux-worker"


@dataclass(frozen=True, slots=True, order=True)
class InstanceId:
    """A node's identity: a UUID carried in its certificate's SPIFFE URI SAN."""

    uuid: uuid.UUID

    def __post_init__(self) -> None:
        # Checked here, not where it is used: a str slipped in works until something
        # reads .uuid.bytes, far from the mistake (an AttributeError inside add_peer).
        if not isinstance(self.uuid, uuid.UUID):
            raise ConfigurationError(
                f"InstanceId takes a uuid.UUID, got {type(self.uuid).__name__} "
                f"{self.uuid!r}: for text, use InstanceId.parse({str(self.uuid)!r})"
            )

    @classmethod
    def parse(cls, text: str) -> InstanceId:
        """Parse the canonical hyphenated UUID text; raises
        :class:`~velomux_quic.errors.ConfigurationError` (a ``ValueError``) on anything else.

        ``uuid.UUID`` also takes braces, a ``urn:uuid:`` prefix or no hyphens; an identity
        compared as text (certificates, peer records) must have exactly one spelling.
        """
        if not isinstance(text, str):
            raise ConfigurationError(
                f"InstanceId.parse takes text, got {type(text).__name__} {text!r}: for a "
                "uuid.UUID use InstanceId(value)"
            )
        try:
            value = uuid.UUID(text)
        except ValueError:
            value = None
        if value is None or str(value) != text.lower():
            raise ConfigurationError(
                f"not an InstanceId: {text!r}; an InstanceId is written as a hyphenated UUID "
                "(8-4-4-4-12 hex digits, e.g. 123e4567-e89b-42d3-a456-426614174000): copy it "
                "from the node's node.json, its 'listening' line or node.instance_id"
            )
        return cls(value)

    @property
    def worker_id(self) -> WorkerId:
        """The node's WorkerId, the upper half of every handle it mints (see
        :func:`worker_id_of`)."""
        return worker_id_of(self)

    def __str__(self) -> str:
        return str(self.uuid)


def new_instance_id() -> InstanceId:
    """A fresh random (version 4) InstanceId."""
    return InstanceId(uuid.uuid4())


def worker_id_of(instance: InstanceId) -> WorkerId:
    """The WorkerId of an InstanceId: BLAKE2b-64 of its 16 bytes, personalised.

    Fixed forever: handles minted by one build are read by every other, so this
    function must never change. A 64-bit digest of a 128-bit id is not strictly
    injective; the peer registry refuses a second InstanceId whose WorkerId it
    already holds, which turns a collision into a clear error instead of misrouting.
    """
    digest = hashlib.blake2b(instance.uuid.bytes, digest_size=8, person=_WORKER_ID_PERSON)
    return WorkerId(int.from_bytes(digest.digest(), "big"))


@dataclass(frozen=True, slots=True, order=True)
class StreamAnchorHandle:
    """A u128 naming one anchor: the consumer node's WorkerId above, a local id below.

    ``unpack()[0]`` is the mux batching key. Local id 0 is reserved; bit 63 of the
    local id marks an MPSC anchor. On the wire (MessagePack and JSON) it is the map
    ``{"hi": u64, "lo": u64}`` because MessagePack has no u128.
    """

    value: int

    def __post_init__(self) -> None:
        if not 0 <= self.value < (1 << 128):
            raise ValueError(f"a StreamAnchorHandle is a u128, got {self.value}")

    @classmethod
    def pack(cls, worker_id: int, local_id: int) -> StreamAnchorHandle:
        """The handle of anchor ``local_id`` on the node with ``worker_id`` (both u64)."""
        if not 0 <= worker_id <= U64_MAX:
            raise ValueError(f"worker_id must be a u64, got {worker_id}")
        if not 0 <= local_id <= U64_MAX:
            raise ValueError(f"local_id must be a u64, got {local_id}")
        return cls((worker_id << 64) | local_id)

    def unpack(self) -> tuple[WorkerId, int]:
        """(WorkerId, local anchor id): the node that owns the anchor, and which one."""
        return WorkerId(self.value >> 64), self.value & U64_MAX

    @property
    def worker_id(self) -> WorkerId:
        """The WorkerId of the node that owns the anchor: the mux batches by it."""
        return WorkerId(self.value >> 64)

    @property
    def local_id(self) -> int:
        """The anchor's id on its node (the lower 64 bits)."""
        return self.value & U64_MAX

    @property
    def is_mpsc(self) -> bool:
        """Whether the handle names an MPSC anchor (attach it with ``attach_mpsc_anchor``)."""
        return bool(self.local_id & MPSC_BIT)

    def to_wire(self) -> dict[str, int]:
        """The MessagePack form ``{"hi": u64, "lo": u64}`` (MessagePack has no u128)."""
        return {"hi": self.value >> 64, "lo": self.value & U64_MAX}

    @classmethod
    def from_wire(cls, obj: Any) -> StreamAnchorHandle:
        """Decode ``{"hi", "lo"}``; raises ``ValueError`` for any other shape."""
        if not isinstance(obj, dict) or set(obj) != {"hi", "lo"}:
            raise ValueError(f"a handle is a map {{hi, lo}}, got {obj!r}")
        hi, lo = obj["hi"], obj["lo"]
        if not (isinstance(hi, int) and isinstance(lo, int)) or bool in (type(hi), type(lo)):
            raise ValueError(f"handle halves must be integers, got {obj!r}")
        return cls.pack(hi, lo)

    def __str__(self) -> str:
        return f"{self.value >> 64:016x}:{self.value & U64_MAX:016x}"
