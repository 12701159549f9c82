"""The sender's half of rendezvous: payloads held until their receiver pulls them.

A payload too large to travel inline is *staged*: kept here under a random u64 id while a
16-byte descriptor travels on the lane. The receiver pulls it over a request stream of its
own (see ``velomux_quic.transport.requests``), so the lane never waits for the transfer.
Every staged payload is released exactly once: when pulled (single use), when the receiver
refuses it, or when nobody pulled it within ``ttl``. Only the peer it was staged for may
pull or release it. Total bytes held are bounded by ``max_bytes``.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from enum import IntEnum

from ..errors import StagingFull
from ..ids import InstanceId

__all__ = ["PullOp", "ReleaseCallback", "StagingStore", "decode_pull", "encode_pull"]

_PULL = struct.Struct(">BQ")


class PullOp(IntEnum):
    """What a request stream asks of the node that staged a payload."""

    PULL = 1
    RELEASE = 2


def encode_pull(op: PullOp, staged_id: int) -> bytes:
    """The 9-byte body of a pull or release request for ``staged_id``."""
    return _PULL.pack(op, staged_id)


def decode_pull(request: bytes) -> tuple[PullOp, int]:
    """Raises ValueError on anything but a well-formed 9-byte pull request."""
    if len(request) != _PULL.size:
        raise ValueError(f"a pull request is {_PULL.size} bytes, got {len(request)}")
    op, staged_id = _PULL.unpack(request)
    return PullOp(op), staged_id


ReleaseCallback = Callable[[str], None]
"""Told the reason one staged payload was released: ``pulled``, ``refused``, ``expired``,
``closed`` or ``unsent``."""


class _Staged:
    __slots__ = ("on_release", "payload", "peer", "timer")

    def __init__(
        self,
        payload: bytes,
        peer: InstanceId,
        timer: asyncio.TimerHandle,
        on_release: ReleaseCallback | None,
    ) -> None:
        self.payload = payload
        self.peer = peer
        self.timer = timer
        self.on_release = on_release


class StagingStore:
    """Staged payloads by id; see the module docstring."""

    def __init__(
        self, *, max_bytes: int, ttl: float, on_release: Callable[[str, int], None] | None = None
    ) -> None:
        self._max_bytes = max_bytes
        self._ttl = ttl
        self._on_release = on_release or (lambda reason, size: None)
        self._items: dict[int, _Staged] = {}
        self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._items)

    def stage(
        self, payload: bytes, peer: InstanceId, on_release: ReleaseCallback | None = None
    ) -> int:
        """Hold ``payload`` for ``peer`` under a fresh random id; StagingFull past ``max_bytes``.
        ``on_release`` is told why it was released, once (what the mux retires a stream
        whose record went staged on: only a pulled payload reached its consumer)."""
        size = len(payload)
        if self.bytes_held + size > self._max_bytes:
            raise StagingFull(
                f"staging {size} bytes would hold {self.bytes_held + size}, "
                f"over max_staged_bytes {self._max_bytes}"
            )
        staged_id = int.from_bytes(os.urandom(8), "big") or 1
        while staged_id in self._items:
            staged_id = int.from_bytes(os.urandom(8), "big") or 1
        timer = asyncio.get_running_loop().call_later(self._ttl, self._expire, staged_id)
        self._items[staged_id] = _Staged(payload, peer, timer, on_release)
        self.bytes_held += size
        return staged_id

    def take(self, staged_id: int, peer: InstanceId) -> bytes | None:
        """Hand the payload over (single use); None if unknown or staged for someone else."""
        item = self._pop(staged_id, peer, "pulled")
        return item.payload if item is not None else None

    def release(self, staged_id: int, peer: InstanceId, reason: str = "refused") -> bool:
        """Drop a payload staged for ``peer`` (``reason`` goes to the release hook); False if
        unknown."""
        return self._pop(staged_id, peer, reason) is not None

    def _pop(self, staged_id: int, peer: InstanceId | None, reason: str) -> _Staged | None:
        item = self._items.get(staged_id)
        if item is None or (peer is not None and item.peer != peer):
            return None
        del self._items[staged_id]
        item.timer.cancel()
        self.bytes_held -= len(item.payload)
        self._on_release(reason, len(item.payload))
        if item.on_release is not None:
            item.on_release(reason)
        return item

    def _expire(self, staged_id: int) -> None:
        self._pop(staged_id, None, "expired")

    def close(self) -> None:
        """Release everything still held (``closed``)."""
        for staged_id in list(self._items):
            self._pop(staged_id, None, "closed")
