"""What an ingress table talks to, and what it counts: its contracts with the rest of the mux.

An :class:`~velomux_quic.mux.ingress.IngressTable` is sans-IO; everything outside it comes in
through these small interfaces, so tests can stand in for any of them:

* :class:`BindRegistry`: the binds (attach or pre-bind) that OpenSlot records claim;
  :class:`InMemoryBindRegistry` is the dictionary the node's bind book builds on;
* :class:`ReplySink`: credit, closes and lifecycle for the *peer's* slots, written by this
  node's egress batcher of the same (peer, lane), with the capped :class:`RejectLane` for
  OpenSlots that were never admitted;
* :class:`EgressControl`: the peer's control about *this* node's slots, handed to egress;
* :class:`MuxIngressStats`: the plain counters exported at scrape time.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final, Protocol

from .credit import IngressSlot
from .protocol import CloseReason, LifecycleAction

__all__ = [
    "DROP_NOTICE_OUTCOMES",
    "DROP_REASONS",
    "REFUSAL_OUTCOMES",
    "BindRegistry",
    "EgressControl",
    "InMemoryBindRegistry",
    "MuxIngressStats",
    "RejectLane",
    "ReplySink",
]

DROP_REASONS: Final = (
    "stale_epoch",
    "generation",
    "unknown_slot",
    "closed_slot",
    "slot_collision",
    "withheld_overflow",
    "stale_singleton",
    "duplicate",
    "lane_mismatch",
)
"""The ``reason`` labels of ``velo_streaming_mux_records_dropped_total``. ``withheld_overflow``
is kept for dashboards and never counted; ``stale_singleton`` counts the records of a staged
singleton that resolved after its slot had ended."""

DROP_NOTICE_OUTCOMES: Final = ("answered", "limited")
"""The ``outcome`` labels of ``velo_streaming_mux_drop_notices_total``: records of a slot the
table does not have (never opened here, or ended here) that were answered with a drop notice
(``answered``), or dropped unanswered because that slot's notices reached
``drop_notice_limit`` or the last one is younger than its backoff (``limited``)."""

REFUSAL_OUTCOMES: Final = ("applied", "waiting", "stale", "malformed")
"""The ``outcome`` labels of ``velo_streaming_mux_staged_refusals_total``.

``applied``: a stream ended (at once, or when the OpenSlot a refusal waited for arrived);
``waiting``: parked on a bind whose OpenSlot had not arrived; ``stale``: the named stream
no longer exists (nothing done); ``malformed``: a refused batch without a readable
``_mux_slot`` header (nothing done). See :mod:`.singleton`."""


# -- metrics ------------------------------------------------------------------------------


class MuxIngressStats:
    """Plain integer counters of the ingress side (exported at scrape time).

    One object may be shared by every table of a node; the gauges (``held_records``,
    ``live_slots``) are then node-wide sums. Counts are added per batch where the batch
    is dropped whole, and per record only on the rare paths (drops, failures).
    """

    __slots__ = (
        "batch_seq_gaps",
        "batches_received",
        "control_refused",
        "drain_visits",
        "drop_notices",
        "drops",
        "generation_mismatch",
        "held_records",
        "hold_overflow",
        "lifecycle_received",
        "live_slots",
        "malformed_records",
        "protocol_errors",
        "reader_stall",
        "records_received",
        "refusals",
        "refusals_forgotten",
        "refused_slots",
        "slot_limit",
    )

    def __init__(self) -> None:
        self.drops: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.reader_stall = 0
        self.generation_mismatch = 0
        self.hold_overflow = 0
        self.batch_seq_gaps = 0
        self.batches_received = 0
        self.records_received = 0
        self.control_refused = 0
        self.drain_visits = 0
        self.protocol_errors = 0
        """Slots closed with MalformedBatch (over credit, hold overflow, reader stall)."""
        self.malformed_records = 0
        """Control records whose body did not decode (only without decode_batch in front)."""
        self.slot_limit = 0
        """OpenSlots refused because their index is past ``max_slots_per_table``."""
        self.refused_slots = 0
        """Refused slot ids remembered now (a gauge; at most ``max_refused_slots`` a table)."""
        self.refusals_forgotten = 0
        """Refused slot ids forgotten past ``max_refused_slots`` (oldest first)."""
        self.lifecycle_received = 0
        """LifecycleSlot records (stop or cancel) about this side's own slots."""
        self.drop_notices: dict[str, int] = dict.fromkeys(DROP_NOTICE_OUTCOMES, 0)
        """Records of a slot the table does not have, answered with a drop notice again or
        left unanswered by its bound (see :data:`DROP_NOTICE_OUTCOMES`)."""
        self.refusals: dict[str, int] = dict.fromkeys(REFUSAL_OUTCOMES, 0)
        """Staged singletons this node refused for their size, by what came of it."""
        self.held_records = 0
        self.live_slots = 0


# -- the interfaces around a table --------------------------------------------------------


class BindRegistry(Protocol):
    """Where the consumer side left the slots that OpenSlot records claim.

    The consumer's attach (or pre-bind) already created the :class:`IngressSlot`, with its
    credit C, and installed it as the anchor's feed; ingress only claims it. ``peer`` and
    ``lane`` are the batch's own, for a registry that checks who may claim a bind. A bind
    is not tied to its arrival lane: a sender with fewer lanes sends lane k on lane k
    modulo its own count, and every lane is correct for every stream.
    """

    def claim(
        self, peer: Hashable, lane: int, anchor_id: int, session_id: int
    ) -> IngressSlot | None:
        """The bound slot for this pair, taken out of the registry; None if none waits."""
        ...


class InMemoryBindRegistry:
    """A dictionary of binds keyed by (anchor_id, session_id): tests and simple embeddings.

    A bind may name the peer it expects (an attach knows its sender); a pre-bind names
    none and may be claimed by any peer. A claim by the wrong peer leaves the bind alone.
    """

    __slots__ = ("_binds", "_sessions")

    def __init__(self) -> None:
        self._binds: dict[tuple[int, int], tuple[IngressSlot, Hashable | None]] = {}
        self._sessions: dict[int, tuple[int, int]] = {}
        """Session to bind key: a staged refusal names only the session (:meth:`waiting_bind`)."""

    def bind(
        self, anchor_id: int, session_id: int, slot: IngressSlot, *, peer: Hashable | None = None
    ) -> None:
        key = (anchor_id, session_id)
        if key in self._binds:
            raise ValueError(f"a bind for {key} already waits")
        self._binds[key] = (slot, peer)
        self._sessions[session_id] = key

    def release(self, anchor_id: int, session_id: int) -> IngressSlot | None:
        """Give an unclaimed bind back (detach, expiry, a dropped request)."""
        entry = self._binds.pop((anchor_id, session_id), None)
        if entry is None:
            return None
        self._forget_session(anchor_id, session_id)
        return entry[0]

    def _forget_session(self, anchor_id: int, session_id: int) -> None:
        if self._sessions.get(session_id) == (anchor_id, session_id):
            del self._sessions[session_id]

    def waiting_bind(self, peer: Hashable, session_id: int) -> IngressSlot | None:
        """The unclaimed bind of ``session_id`` that ``peer`` may claim, if one waits.

        A staged refusal can overtake the OpenSlot it concerns; it then waits on this
        bind. A bind that names another peer is not this peer's to fail."""
        key = self._sessions.get(session_id)
        entry = self._binds.get(key) if key is not None else None
        if entry is None:
            return None
        slot, expected = entry
        if expected is not None and expected != peer:
            return None
        return slot

    def claim(
        self, peer: Hashable, lane: int, anchor_id: int, session_id: int
    ) -> IngressSlot | None:
        key = (anchor_id, session_id)
        entry = self._binds.get(key)
        if entry is None:
            return None
        slot, expected = entry
        if expected is not None and expected != peer:
            return None
        del self._binds[key]
        self._forget_session(anchor_id, session_id)
        return slot

    def __len__(self) -> int:
        return len(self._binds)


class EgressControl(Protocol):
    """The peer's control about *this* side's egress slots, as it arrives in a batch.

    The egress batcher validates every key against what it allocated (refusing and
    counting an index it never opened, dropping a retired generation silently), so
    ingress hands these over without looking them up.
    """

    def credits(self, grants: list[tuple[int, int]]) -> None:
        """A batch's CreditUpdates, ``(slot_id, delta)`` in order; the batch's other
        records about these slots come after the grants that preceded them."""
        ...

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None: ...

    def lifecycle(self, session: int, action: LifecycleAction) -> None: ...


class ReplySink(Protocol):
    """Replies about the peer's slots, for the egress batcher of the same (peer, lane).

    ``credit`` and ``close`` are for slots this table admitted; they are never refused
    (the batcher coalesces them per slot, a close superseding credit). ``reject`` is for
    an OpenSlot that was never admitted and goes on a separate lane with a hard cap
    (:class:`RejectLane`): it returns False when that lane is full, and the table counts
    the refusal. A dropped rejection costs no credit, which is why a cap is safe there.
    """

    def credit(self, slot_id: int, delta: int) -> None: ...

    def close(self, slot_id: int, reason: CloseReason) -> None: ...

    def reject(self, slot_id: int, reason: CloseReason) -> bool: ...

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        """LifecycleSlot for the peer's stream ``session``: coalesced per session, cancel
        beating stop, and urgent like a close. It names the session, not the slot id, so a
        late one cannot stop or cancel a later stream that reuses the id."""
        ...


class RejectLane:
    """The bounded lane of rejections of OpenSlots that ingress never admitted.

    Keyed by slot id (a second rejection of one id replaces the first, in place), in
    arrival order, at most ``cap`` entries (``MuxConfig.reject_lane_cap``, 8,192). An
    egress batcher embeds one per (peer, lane) behind :meth:`ReplySink.reject` and
    :meth:`drain` s it into its next batch.
    """

    __slots__ = ("_cap", "_entries")

    def __init__(self, cap: int = 8_192) -> None:
        if cap <= 0:
            raise ValueError("the reject lane cap must be positive")
        self._cap = cap
        self._entries: dict[int, CloseReason] = {}

    @property
    def cap(self) -> int:
        return self._cap

    def offer(self, slot_id: int, reason: CloseReason) -> bool:
        entries = self._entries
        if slot_id not in entries and len(entries) >= self._cap:
            return False
        entries[slot_id] = reason
        return True

    def drain(self) -> list[tuple[int, CloseReason]]:
        entries = list(self._entries.items())
        self._entries.clear()
        return entries

    def __len__(self) -> int:
        return len(self._entries)
