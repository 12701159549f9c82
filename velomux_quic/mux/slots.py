"""The egress side's per-stream state and what a poll hands the driver.

:class:`EgressSlot` is one stream on one (peer, lane) as the producing node sees it (its
queue, credit, sequence, fence, retirement guard and owner); :class:`OutgoingBatch` is one
encoded batch and what depends on its admission; :class:`EgressStats` the plain counters.
The state machine that moves records from slots into batches is
:class:`~velomux_quic.mux.egress.EgressBatcher`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import SlotsExhausted
from .protocol import slot_id

__all__ = [
    "RECORDS_PER_BATCH_BUCKETS",
    "EgressSlot",
    "EgressStats",
    "OutgoingBatch",
    "SlotOwner",
    "SlotsExhausted",
]


RECORDS_PER_BATCH_BUCKETS = tuple(2**i for i in range(12))
"""Upper bounds of the records-per-batch histogram: 1 doubling to 2048 (12 buckets)."""


class EgressStats:
    """Plain counters (exported at scrape time by the driver)."""

    __slots__ = (
        "batch_size_buckets",
        "batches_sent",
        "control_refused",
        "credit_exhausted",
        "epoch_deaths",
        "record_types",
        "records_sent",
    )

    def __init__(self) -> None:
        self.batches_sent = 0
        self.records_sent = 0
        self.control_refused = 0
        self.credit_exhausted = 0
        self.epoch_deaths = 0
        self.batch_size_buckets = [0] * len(RECORDS_PER_BATCH_BUCKETS)
        """Cumulative-ready counts per bucket of records per batch (1, 2, 4, ... 2048)."""
        self.record_types = [0] * 6
        """Records sent by RecordType, counted per batch, never per record."""


class SlotOwner(Protocol):
    """Who a slot tells when the consumer or the peer ends it (the sender's state)."""

    def slot_stopped(self) -> None:
        """LifecycleSlot stop: finish gracefully; the slot stays open."""

    def slot_closed(self, reason: object) -> None:
        """The slot closed without its own terminal (cancel, peer close, epoch death).

        ``reason`` is ``LifecycleAction.CANCEL`` for the consumer's cancel, the peer's
        ``CloseReason`` (UNKNOWN_SLOT, PROTOCOL_ERROR) for its close, and
        ``CloseReason.PEER_GONE`` for epoch death. Told once; never for the producer's own
        abort (the producer knows) or its own terminal."""


class EgressSlot:
    """One stream on this (peer, lane), as the producer's node sees it."""

    __slots__ = (
        "anchor_id",
        "budget",
        "credit",
        "exhausted_once",
        "fenced",
        "generation",
        "guard",
        "index",
        "live",
        "next_seq",
        "open_pending",
        "owner",
        "queue",
        "queued_bytes",
        "reserve",
        "session_id",
        "slot_id",
        "terminal_queued",
    )

    def __init__(
        self, index: int, generation: int, anchor_id: int, session_id: int, credit: int, budget: int
    ) -> None:
        self.index = index
        self.generation = generation
        self.slot_id = slot_id(index, generation)
        self.anchor_id = anchor_id
        self.session_id = session_id
        self.credit = credit
        self.reserve = 1
        self.budget = budget
        self.next_seq = 1
        self.queue: deque[tuple[bytes, bool]] = deque()
        self.queued_bytes = 0
        self.open_pending = True
        self.terminal_queued = False
        self.live = True
        self.exhausted_once = False
        self.guard: Any = None
        """Opaque retirement guard handed back with the batch that carries the terminal."""
        self.owner: SlotOwner | None = None
        """The producer's side of the stream, told of stops, cancels and closes."""
        self.fenced = False
        """A staged singleton of this slot awaits admission: its later records wait."""

    @property
    def sendable(self) -> bool:
        """The head of the queue can go now (data with credit, or the terminal)."""
        if not self.queue or self.open_pending or self.fenced:
            return False
        return self.queue[0][1] or self.credit > 0

    def has_room(self) -> bool:
        return self.queued_bytes < self.budget


@dataclass(slots=True)
class OutgoingBatch:
    """One encoded ``_stream_batch`` payload, and what depends on its admission."""

    payload: bytes
    records: int
    carries_data: bool
    guards: list[Any]
    headers: dict[str, str] | None = None
    """Messenger headers: ``_mux_slot`` on a singleton the messenger will stage."""
    fence: EgressSlot | None = None
    """The slot this staged singleton fenced: its admission lifts the fence."""
