"""Type stubs of the compiled record path of the mux (``_compiled.pyx``).

Each name has the API of the pure-Python definition it twins (see velomux_quic.recordpath);
tests/unit/test_recordpath.py checks that the compiled classes expose the same public names.
"""

from collections.abc import Sequence
from typing import Any

from .credit import IngressSlot
from .protocol import BatchHeader, OwnedRecord, Record
from .slots import EgressSlot, SlotOwner

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
    "IngressTable__reconcile",
    "IngressTable__reconcile_dirty",
    "IngressTable_handle_batch",
    "MuxChannel",
    "_Route",
]
