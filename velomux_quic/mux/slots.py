"""The egress side's per-stream state and what a poll hands the driver.

:class:`EgressSlot` is one stream on one (peer, lane) as the producing node sees it (its
lifecycle state, queue, credit, sequence, fence, retirement guard and owner);
:class:`OutgoingBatch` is one encoded batch and what depends on its admission;
:class:`EgressStats` the plain counters. The batcher that moves records from slots into
batches is :class:`~velomux_quic.mux.egress.EgressBatcher`.

A slot's lifecycle is explicit, in the habit of h11's ``_state.py``: a :class:`SlotState`,
the :class:`SlotEvent` s that move it, and one table, :data:`SLOT_TRANSITIONS`, that says
which event takes which state where. :meth:`EgressSlot.advance` is the only way a state
changes, and an event the table does not list for the current state raises
:class:`~velomux_quic.errors.UsageError` instead of leaving the slot half-changed::

    OPENING ──open written──▶ OPEN ──terminal queued──▶ ENDING ──terminal written──▶ CLOSED
       │                                                  ▲
       └──terminal queued──▶ ENDING_UNOPENED ──open written┘
    (every state but CLOSED) ──closed──▶ CLOSED

The fence of a staged singleton is not a state: it pauses a slot's later records while
leaving its lifecycle where it is (an OPEN slot and an ENDING one can both be fenced), so
it stays a flag beside the state.

Every record staged and packed reads and writes its slot, so this module is one of the
record path's compiled modules (velomux_quic.recordpath): where built, this same file is
compiled, and :class:`EgressSlot`'s fields are the C fields of ``slots.pxd``, which the
compiled batcher (``egress.pxd``) cimports; otherwise it runs as it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from types import MappingProxyType
from typing import Any, Final, Protocol, final

from ..errors import SlotsExhausted, UsageError
from .protocol import slot_id

__all__ = [
    "RECORDS_PER_BATCH_BUCKETS",
    "SLOT_TRANSITIONS",
    "EgressSlot",
    "EgressStats",
    "OutgoingBatch",
    "QueuedRecord",
    "QueuedTerminal",
    "SlotEvent",
    "SlotOwner",
    "SlotState",
    "SlotsExhausted",
    "next_slot_state",
]


class SlotState(IntEnum):
    """Where an egress slot is in its life.

    Ordered by progress: a state above OPEN takes no more records."""

    OPENING = 0
    """Allocated; its OpenSlot is not written yet. Takes records, which wait behind it."""
    OPEN = 1
    """Its OpenSlot is written. Takes records."""
    ENDING_UNOPENED = 2
    """Its terminal is queued before its OpenSlot was written. Takes nothing more."""
    ENDING = 3
    """Its terminal is queued (not yet written). Takes nothing more; sends what it holds."""
    CLOSED = 4
    """Freed: its terminal and close were written, or it closed without them."""


class SlotEvent(Enum):
    """What moves an egress slot from one :class:`SlotState` to the next."""

    OPEN_WRITTEN = "open_written"
    """Its OpenSlot was packed into a batch."""
    TERMINAL_QUEUED = "terminal_queued"
    """The producer offered its terminal (finalize, detach, error)."""
    TERMINAL_WRITTEN = "terminal_written"
    """Its terminal and ``CloseSlot{TerminalSent}`` were packed into a batch."""
    CLOSED = "closed"
    """It ended without its own terminal: the producer aborted, the consumer cancelled, the
    peer closed it, or its epoch died."""

    # Each transition looks its event up in SLOT_TRANSITIONS. Enum's own hash is Python
    # code (the hash of the member's name); a member is a singleton compared by identity,
    # so the identity hash finds the same entries, in C.
    __hash__ = object.__hash__


_State = SlotState
_Event = SlotEvent

# The members read per record and per transition, bound once. An enum member read off its
# class (``SlotState.OPEN``) runs through the enum type's attribute hook on Python 3.11,
# compiled or not; a module global is a dictionary look-up.
_OPENING: Final = SlotState.OPENING
_OPEN: Final = SlotState.OPEN
_ENDING_UNOPENED: Final = SlotState.ENDING_UNOPENED
_ENDING: Final = SlotState.ENDING
_CLOSED: Final = SlotState.CLOSED

SLOT_TRANSITIONS: Final[Mapping[SlotState, Mapping[SlotEvent, SlotState]]] = MappingProxyType(
    {
        _State.OPENING: {
            _Event.OPEN_WRITTEN: _State.OPEN,
            _Event.TERMINAL_QUEUED: _State.ENDING_UNOPENED,
            _Event.CLOSED: _State.CLOSED,
        },
        _State.OPEN: {
            _Event.TERMINAL_QUEUED: _State.ENDING,
            _Event.CLOSED: _State.CLOSED,
        },
        _State.ENDING_UNOPENED: {
            _Event.OPEN_WRITTEN: _State.ENDING,
            _Event.CLOSED: _State.CLOSED,
        },
        _State.ENDING: {
            _Event.TERMINAL_WRITTEN: _State.CLOSED,
            _Event.CLOSED: _State.CLOSED,
        },
        _State.CLOSED: {},
    }
)
"""Every legal transition of an egress slot, and nothing else: state -> event -> next state."""


def next_slot_state(state: SlotState, event: SlotEvent) -> SlotState:
    """The state ``event`` takes ``state`` to; UsageError when the table has no such move.

    An illegal move is a bug in the caller (a record offered to a closed slot, a second
    terminal, a slot freed twice): failing loudly keeps one stream's bug from corrupting
    the table's accounting for every other stream on the lane."""
    target = SLOT_TRANSITIONS[state].get(event)
    if target is None:
        raise UsageError(
            f"an egress slot in state {state.name} cannot take {event.name}: "
            "the slot is closed or ending; open a new stream instead"
        )
    return target


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
        "queue_full",
        "record_types",
        "records_sent",
    )

    def __init__(self) -> None:
        self.batches_sent = 0
        self.records_sent = 0
        self.control_refused = 0
        self.credit_exhausted = 0
        self.epoch_deaths = 0
        self.queue_full = 0
        """Records refused because the lane queue bound (``peer_queue_bytes``) was full."""
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


@final
class QueuedTerminal:
    """A stream's terminal in its slot's queue, where it is always the last entry.

    A data record waits in the queue as its body alone, so staging one allocates nothing
    beyond its bytes: no object the cyclic collector counts, which by the thousand (a
    pass, or records withheld for credit) would set off collections every pass. Only the
    terminal, once per stream, is wrapped, to tell it apart; nothing derives from it, so
    the packing tells it apart by its exact type, the cheapest check there is."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body


QueuedRecord = bytes | QueuedTerminal
"""An entry of an :class:`EgressSlot`'s queue: a data record's body, or the terminal."""


class EgressSlot:
    """One stream on this (peer, lane), as the producer's node sees it."""

    __slots__ = (
        "_append",
        "_in_ready",
        "_popleft",
        "anchor_id",
        "budget",
        "credit",
        "exhausted_once",
        "fenced",
        "generation",
        "guard",
        "index",
        "next_seq",
        "owner",
        "queue",
        "queued_bytes",
        "reserve",
        "session_id",
        "slot_id",
        "state",
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
        self.queue: deque[QueuedRecord] = deque()
        self.queued_bytes = 0
        # Bound once for the compiled batcher, which stages and packs through them once per
        # record: the queue's two methods. The queue never changes after this.
        self._append = self.queue.append
        self._popleft = self.queue.popleft
        self._in_ready = False
        """In the batcher's ready list: kept by the batcher, which owns that list."""
        self.state = _OPENING
        """Where the slot is in its life; moved only by :meth:`advance`."""
        self.exhausted_once = False
        self.guard: Any = None
        """Opaque retirement guard handed back with the batch that carries the terminal."""
        self.owner: SlotOwner | None = None
        """The producer's side of the stream, told of stops, cancels and closes."""
        self.fenced = False
        """A staged singleton of this slot awaits admission: its later records wait."""

    def advance(self, event: SlotEvent) -> SlotState:
        """Move the slot by ``event`` through :data:`SLOT_TRANSITIONS`; returns the new
        state. Raises UsageError (and changes nothing) for a move the table does not have."""
        state = self.state = next_slot_state(self.state, event)
        return state

    @property
    def live(self) -> bool:
        """Not closed yet (its index and generation still belong to it)."""
        return self.state is not _CLOSED

    @property
    def open_pending(self) -> bool:
        """Its OpenSlot is not written yet."""
        state = self.state
        return state is _OPENING or state is _ENDING_UNOPENED

    @property
    def terminal_queued(self) -> bool:
        """It takes no more records: its terminal is queued, or it is closed."""
        return self.state > _OPEN

    @property
    def sendable(self) -> bool:
        """The head of the queue can go now (data with credit, or the terminal)."""
        if not self.queue or self.fenced:
            return False
        state = self.state
        if state is not _OPEN and state is not _ENDING:
            return False  # not announced yet, or closed
        return type(self.queue[0]) is QueuedTerminal or self.credit > 0

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
