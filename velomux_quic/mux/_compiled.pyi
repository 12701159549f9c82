"""Type stubs of the compiled record path of the mux (``_compiled.pyx``).

Each name has the API of the pure-Python definition it twins (see velomux_quic.recordpath);
tests/unit/test_recordpath.py checks that the compiled classes expose the same public names.
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .credit import PendingRefusal
from .protocol import BatchHeader, OwnedRecord, Record
from .slots import EgressSlot, OutgoingBatch, SlotOwner

class PeerBudget:
    limit: int
    used: int
    def __init__(self, limit: int) -> None: ...
    def room(self, size: int) -> bool: ...
    def charge(self, size: int) -> None: ...
    def release(self, size: int) -> None: ...

class DirtySet:
    def __init__(self, capacity: int, doorbell: Callable[[], None] | None = None) -> None: ...
    @property
    def capacity(self) -> int: ...
    def mark(self, index: int) -> bool: ...
    def drain(self) -> list[int]: ...
    def __contains__(self, index: int) -> bool: ...
    def __len__(self) -> int: ...

class IngressSlot:
    bytes_buffered: int
    capacity: int
    closed: bool
    credit: int
    data_delivered: int
    drained: int
    gap_waiting: bool
    granted: int
    held_bytes: int
    held_data: int
    held_records: int
    index: int
    last_arrival: float
    on_end: Callable[[], None] | None
    on_terminal: Callable[[bytes], None] | None
    opened: bool
    refusals: dict[tuple[Hashable, int], PendingRefusal] | None
    return_below: int
    slot_byte_budget: int
    slot_id: int
    terminal: bool
    withdrawn: bool
    def __init__(
        self,
        credit: int,
        slot_byte_budget: int,
        *,
        wake: Callable[[], None] | None = None,
        return_below: int | None = None,
    ) -> None: ...
    def open(
        self, slot_id: int, dirty: DirtySet, peer_budget: PeerBudget | None, now: float
    ) -> None: ...
    def deliver(self, body: bytes) -> bool: ...
    def deliver_terminal(self, body: bytes) -> bool: ...
    def end(self, inject: bytes | None = None) -> None: ...
    def reconcile(self) -> int: ...
    @property
    def withheld_credit(self) -> int: ...
    @property
    def outstanding_credit(self) -> int: ...
    @property
    def sender_has_credit(self) -> bool: ...
    def __len__(self) -> int: ...
    def take(self) -> bytes | None: ...
    @property
    def exhausted(self) -> bool: ...
    def withdraw(self) -> None: ...

class BatcherFields:
    _room: int
    _ready: dict[int, EgressSlot]
    _staged_since: float | None

def EgressBatcher_offer(self: Any, slot: EgressSlot, body: bytes, now: float) -> bool: ...
def EgressBatcher__pack_ready(
    self: Any, out: list[OutgoingBatch], guards: list[Any], carries_data: bool
) -> tuple[list[Any], bool]: ...

class _Route:
    close_reason: int
    close_seq: int
    expected: int
    held_terminal: bool
    hold: dict[int, tuple[int, bytes]] | None
    hold_bytes: int
    index: int
    session_id: int
    slot: IngressSlot
    slot_id: int
    touched: int
    def __init__(self, slot_id: int, slot: IngressSlot, expected: int, session_id: int) -> None: ...

def IngressTable_handle_batch(
    self: Any, header: BatchHeader, records: Sequence[Record | OwnedRecord], now: float
) -> None: ...
def IngressTable__reconcile(self: Any, touched: list[_Route]) -> None: ...
def IngressTable__reconcile_dirty(self: Any) -> int: ...

class MuxChannel:
    def __init__(self, driver: Any, slot: EgressSlot) -> None: ...
    @property
    def slot(self) -> EgressSlot: ...
    @property
    def session_id(self) -> int: ...
    @property
    def credit(self) -> int: ...
    @property
    def queued_bytes(self) -> int: ...
    @property
    def lane(self) -> int: ...
    def watch(self, owner: SlotOwner) -> None: ...
    @property
    def closed(self) -> bool: ...
    def try_send(self, body: bytes) -> bool: ...
    async def send(self, body: bytes) -> None: ...
    def send_terminal(self, body: bytes, done: Any) -> None: ...
    def end_now(self, body: bytes, done: Any) -> None: ...
    def abort(self) -> None: ...

__all__ = [
    "DirtySet",
    "EgressBatcher__pack_ready",
    "EgressBatcher_offer",
    "IngressSlot",
    "IngressTable__reconcile",
    "IngressTable__reconcile_dirty",
    "IngressTable_handle_batch",
    "MuxChannel",
    "PeerBudget",
    "_Route",
]
