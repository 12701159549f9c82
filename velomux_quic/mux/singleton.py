"""Records too large for any batch (singletons), and the refusal of a staged one.

A record that cannot fit an empty batch goes alone in a batch of its own: a *singleton*
(with its ``CloseSlot{TerminalSent}`` when the record is the stream's terminal). Whether
the messenger carries it inline or stages it (rendezvous) depends on the eager budget to
the peer, and the two paths differ in what they promise:

* **Inline** (the batch fits the eager budget). It travels on the ordered lane like any
  batch, so it needs nothing more. It carries no ``_mux_slot`` header: it cannot be
  refused for its size, and it may already be at the transport's frame limit.
* **Staged** (over the eager budget). The receiver resolves it in a detached task, outside
  the ordered lane, so it is not ordered against the batches around it. It therefore
  *fences* its slot (the batcher withholds the slot's later records, its close included,
  until the staged send is admitted) and names its stream in the ``_mux_slot`` header
  (``<epoch>:<slot>:<session>``), because a receiver that refuses it for its size
  (``staged_payload_max``) never reads the batch and could not otherwise learn which
  stream failed.

On the receiving node, :func:`apply_staged_refusal` is the messenger's staged-refusal hook,
told of each staged batch the node refused (for its size, past the pull bounds) or could not
pull (the sender no longer held it, the pull timed out): it ends exactly the stream the
header names (its consumer reads a ``TransportError`` saying why, its producer is told
``LifecycleSlot{cancel}``), or leaves the refusal waiting on the stream's bind when the
OpenSlot has not arrived yet, or does nothing when the named stream no longer exists.
Without it a failed pull left a gap that never closed, and the consumer waited for its
stream watchdog.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import MalformedEnvelope
from .contracts import REFUSAL_OUTCOMES, InMemoryBindRegistry, MuxIngressStats
from .credit import PendingRefusal
from .handlers import BATCH_LANES, MUX_SLOT, MuxSlotRef

if TYPE_CHECKING:
    from ..ids import InstanceId
    from ..messenger import StagedRefusal
    from .ingress import IngressTable

__all__ = [
    "REFUSAL_OUTCOMES",
    "PendingRefusal",
    "SingletonCounters",
    "apply_staged_refusal",
    "refusal_message",
    "singleton_headers",
]


class SingletonCounters:
    """Node-wide producer-side counts of singletons and fences (exported at scrape time).

    Shared by every batcher of a node rather than kept per batcher, so the counts survive
    the eviction of an idle batcher and the exported counters never go down.
    """

    __slots__ = ("fences_raised", "inline", "lifecycle_sent", "staged")

    def __init__(self) -> None:
        self.inline = 0
        """Singletons small enough for the eager budget: sent inline, unfenced."""
        self.staged = 0
        """Singletons over the eager budget: staged by the messenger, with a header."""
        self.fences_raised = 0
        """Staged singletons that fenced a slot still open after them (not a terminal)."""
        self.lifecycle_sent = 0
        """LifecycleSlot records written (stops and cancels for the peer's streams)."""


def singleton_headers(epoch: int, slot_id: int, session: int) -> dict[str, str]:
    """The messenger headers of a staged singleton: its stream, as ``_mux_slot`` names it."""
    return MUX_SLOT.write(MuxSlotRef(epoch, slot_id, session))


def refusal_message(size: int, limit: int, reason: str = "too_large", detail: str = "") -> str:
    """What the consumer of a refused stream reads. For a record too large, both sizes, so
    the operator can tell whether the record or the receiver's limit is the one to change;
    for the pull bounds, which bound and its setting; for a failed pull, why it failed."""
    record = f"a staged stream record of {size} bytes"
    if reason == "pull_count":
        return (
            f"{record} was refused by this receiver: the sender already had {limit} staged "
            "payloads being pulled here (max_pulls_per_peer)"
        )
    if reason == "pull_bytes":
        return (
            f"{record} was refused by this receiver: the sender already had staged payloads "
            f"being pulled here up to max_pull_bytes_per_peer ({limit} bytes)"
        )
    if reason == "lost":
        return f"{record} was lost: {detail or 'the pull failed'}"
    return f"{record} was refused by this receiver: it exceeds staged_payload_max ({limit} bytes)"


def apply_staged_refusal(
    refusal: StagedRefusal,
    tables: Mapping[tuple[InstanceId, int], IngressTable],
    binds: InMemoryBindRegistry,
    stats: MuxIngressStats,
) -> str | None:
    """End the stream a refused staged batch names; returns the outcome (None: not a batch).

    The lookup is scoped to the sender's own (peer, lane) table, so a peer can end only
    its own streams; it must match the epoch, the exact slot id *and* the session, so a
    late refusal cannot end a later stream that reuses the slot id (a replaced batcher
    reuses ids, and a reused index's eight-bit generation wraps). The session is this
    node's own never-reused u64. When no live slot matches but the stream's bind still
    waits for its OpenSlot (the refusal comes from the resolver, not along the ordered
    lane, so it can overtake the OpenSlot), the refusal waits on the bind, one per
    (peer, lane): another peer naming the same session can neither replace nor block it.
    """
    lane = BATCH_LANES.get(refusal.handler)
    if lane is None:
        return None  # some other handler's staged payload: not the mux's business
    try:
        ref = MUX_SLOT.read(refusal.headers)
    except MalformedEnvelope:
        ref = None
    if ref is None:
        stats.refusals["malformed"] += 1
        return "malformed"
    message = refusal_message(refusal.size, refusal.limit, refusal.reason, refusal.detail)
    peer = refusal.peer
    table = tables.get((peer, lane))
    if table is not None and table.refuse_staged(ref.epoch, ref.slot, ref.session, message):
        return "applied"  # counted by the table, which also counts a claimed waiting one
    slot = binds.waiting_bind(peer, ref.session)
    if slot is None:
        stats.refusals["stale"] += 1
        return "stale"
    pending = slot.refusals
    if pending is None:
        pending = slot.refusals = {}
    pending[(peer, lane)] = (ref.epoch, ref.slot, message)
    stats.refusals["waiting"] += 1
    return "waiting"
