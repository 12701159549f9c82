"""Type stubs of the compiled record path of the mux (``_compiled.pyx``).

Each name has the API of the pure-Python definition it twins (see velomux_quic.recordpath);
tests/unit/test_recordpath.py checks that the compiled classes expose the same public names.
"""

from collections.abc import Sequence
from typing import Any

from .credit import IngressSlot
from .protocol import BatchHeader, OwnedRecord, Record
from .slots import EgressSlot, OutgoingBatch

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

__all__ = [
    "EgressBatcher__pack_ready",
    "EgressBatcher_offer",
    "IngressTable__reconcile",
    "IngressTable__reconcile_dirty",
    "IngressTable_handle_batch",
    "_Route",
]
