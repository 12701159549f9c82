"""The messenger mux: many streams to one peer carried as batches of records.

Streams to a peer share one ordered active-message handler per lane instead of owning a
connection each, so sockets and batchers scale with peers, not streams. The cores are
sans-IO, tested and fuzzed with bytes and explicit clocks alone:

* the wire codec: :mod:`.protocol` (the framing of batches) with :mod:`.records` (what
  each record means);
* the sending side: :mod:`.egress` (:class:`~.egress.EgressBatcher`, one class: the slot
  table, offers, credit, replies, flush policy and packing) and :mod:`.slots` (a slot's
  state, its :class:`~.slots.SlotState` lifecycle and the one transition table);
* the receiving side: :mod:`.ingress` (:class:`~.ingress.IngressTable`, one class: the
  arrival rules, a slot's life and the credit that goes back), :mod:`.credit` (the slot
  buffer a consumer reads), :mod:`.contracts` (the narrow interfaces around a table) and
  :mod:`.binds` (the binds OpenSlots claim);
* the lane rules: :mod:`.lanes` and :mod:`.placement`;
* :mod:`.singleton` (records too large for a batch) and :mod:`.config`.

:mod:`.driver` and :mod:`.transport` put them on the event loop and the messenger,
:mod:`.health` covers peers that stop answering, and :mod:`.snapshot` is the read-only
view operators and tests take of it all (:meth:`MuxTransport.snapshot`).
"""

from .config import AutoFlush, FlushPolicy, Manual, MuxConfig
from .slots import SLOT_TRANSITIONS, SlotEvent, SlotState
from .snapshot import EgressLaneSnapshot, IngressLaneSnapshot, MuxSnapshot, PeerBudgetSnapshot

__all__ = [
    "SLOT_TRANSITIONS",
    "AutoFlush",
    "EgressLaneSnapshot",
    "FlushPolicy",
    "IngressLaneSnapshot",
    "Manual",
    "MuxConfig",
    "MuxSnapshot",
    "PeerBudgetSnapshot",
    "SlotEvent",
    "SlotState",
]
