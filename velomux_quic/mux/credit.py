"""Receive-side credit: the slot buffer a consumer reads, and how its credit goes back.

Credit is issued against a buffer the mux owns, never against the anchor's own channel:
that channel has other writers (a same-worker sender, the watchdog's ``Dropped``, control
handlers), so no proof of "C credits against a C-deep channel" survives there. Each bound
stream gets an :class:`IngressSlot` of depth C + 1 (C data records, plus one place that
only a terminal sentinel may take), and the anchor reads it directly as its feed.

Credit returns when the consumer *takes* a record, not when it enters the buffer, so a
consumer that stops reading holds its sender to the window C. Taking a record bumps an
exact count on the slot (the drain signal) and lists the slot in its table's
:class:`DirtySet`; three paths then return the credit (the arrival of the peer's next
batch, a doorbell visit, a periodic walk). Each path calls :meth:`IngressSlot.reconcile`,
which swaps the count to zero, so the paths can overlap freely: a redundant visit finds
zero and grants nothing. A stale listing costs a visit, never credit.

Frame credit proves that no head-of-line blocking occurs; byte budgets bound memory. The
two can disagree (C records of 1 MiB against a 1 MiB slot budget), and the byte side wins
by *withholding the next grant* while the slot is over its budget. A record whose frame
credit was already granted is never refused for its bytes; only the ingress hold refuses
on bytes (see :mod:`.ingress`). Bytes are charged to the slot and to the
:class:`PeerBudget` that all the lanes of one peer share.

Everything here runs on one event loop: the consumer's ``take`` and the ingress handler
never run at the same time, so the drain count and the bitmap need no lock, and the
consumer's path takes none and allocates nothing per record.

A slot's ``deliver`` and ``take``, the mark a take makes and a visit's ``reconcile`` run
once per record, so this module is one of the record path's compiled modules
(velomux_quic.recordpath): where built, this same file is compiled, with the C types of
``credit.pxd``, and the mux's compiled ingress reads the slots' fields in C; otherwise it
runs as it is.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from ..streaming.inbox import Feed

__all__ = ["DirtySet", "IngressSlot", "PeerBudget", "PendingRefusal"]

PendingRefusal = tuple[int, int, str]
"""A staged refusal waiting on a bind (:attr:`IngressSlot.refusals`): (sender epoch, full
slot id, the consumer's error message). See :mod:`.singleton`."""


class PeerBudget:
    """The bytes one peer's ingress holds, across all its lanes (``peer_byte_budget``).

    One object per peer, shared by that peer's tables, so the bound for a peer is the same
    at any lane count on either side and does not depend on when each table was made.
    Buffered bytes are charged here without refusal (their credit was already granted);
    the ingress hold asks :meth:`room` first, because it is the one place that may refuse.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("a peer byte budget must be positive")
        self.limit = limit
        self.used = 0

    def room(self, size: int) -> bool:
        """Whether ``size`` more bytes stay within the budget."""
        return self.used + size <= self.limit

    def charge(self, size: int) -> None:
        self.used += size

    def release(self, size: int) -> None:
        self.used -= size


class DirtySet:
    """The slot indices of one (peer, lane) table whose consumers took records since the
    last visit: the drain side of the credit return.

    The set carries indices and no quantity; the quantity is each slot's own drain count.
    It is a ``bytearray`` bitmap, one bit per index, plus a list of the indices whose bit
    is set. A ``bytearray`` rather than an ``int``: an ``int`` is immutable, so setting a
    bit would allocate a whole new integer (8 KiB for an index near 65,535) on the
    consumer's path, while writing one byte of a ``bytearray`` allocates nothing. The list
    makes :meth:`drain` cost the number of listed slots, not the size of the table; it
    grows only when a bit is newly set, at most once per index between two drains.

    Only the mark that sets a bit posts the doorbell, so a busy consumer touches nothing
    shared after its first take until the next visit. The set is per table and not per
    peer (as the chapter words it) because slot indices are scoped to one (peer, lane):
    the same index on two lanes names two streams.
    """

    __slots__ = ("_bits", "_doorbell", "_listed")

    def __init__(self, capacity: int, doorbell: Callable[[], None] | None = None) -> None:
        if capacity <= 0:
            raise ValueError("a dirty set needs room for at least one index")
        self._bits = bytearray((capacity + 7) >> 3)
        self._listed: list[int] = []
        self._doorbell = doorbell

    @property
    def capacity(self) -> int:
        return len(self._bits) << 3

    def mark(self, index: int) -> bool:
        """List ``index``; True only for the mark that set its bit (and posted the doorbell)."""
        bits = self._bits
        byte = index >> 3
        mask = 1 << (index & 7)
        current = bits[byte]
        if current & mask:
            return False
        bits[byte] = current | mask
        self._listed.append(index)
        doorbell = self._doorbell
        if doorbell is not None:
            doorbell()
        return True

    def drain(self) -> list[int]:
        """Take every listed index and clear the set (the next mark posts again)."""
        listed = self._listed
        if not listed:
            return listed
        self._listed = []
        bits = self._bits
        for index in listed:
            # Every set bit is listed, so clearing whole bytes loses nothing.
            bits[index >> 3] = 0
        return listed

    def __contains__(self, index: int) -> bool:
        return bool(self._bits[index >> 3] & (1 << (index & 7)))

    def __len__(self) -> int:
        return len(self._listed)


class IngressSlot:
    """The C + 1 deep buffer of one bound stream, and the anchor's feed for it.

    The consumer's attach (or pre-bind) creates it with the negotiated credit C and slot
    byte budget and installs it as the anchor's feed; ingress claims it when the
    stream's OpenSlot arrives (:meth:`open`) and from then on delivers into it.

    Invariant: at most C data records sit in the buffer, and a terminal takes the one
    extra place. Ingress admits a data record only within the sender's credit
    (``data_delivered < granted``) and credit comes back only for records taken, so the
    data in the buffer never exceeds C; :meth:`deliver` refusing is a reader stall, which
    is a bug and not a tuning signal. Because only one terminal is ever admitted, the
    reserved place is always free for it, and equally for an injected ``Dropped`` when
    the stream ends without one.

    The receiver's credit account, read by the stream watchdog:

    * ``granted``: all data credit the sender was given (C at open, plus every grant);
    * ``data_delivered``: data records delivered in order into the buffer;
    * ``held_data``: data records waiting in the ingress hold (they spent credit too);
    * :attr:`outstanding_credit`: what the sender can still send, as far as this side
      knows. A grant lost on the way back stays counted here, which is what lets the
      watchdog end a slot whose grant was lost.
    """

    __slots__ = (
        "_append",
        "_buffer",
        "_dirty",
        "_peer",
        "_popleft",
        "_wake",
        "_withheld",
        "bytes_buffered",
        "capacity",
        "closed",
        "credit",
        "data_delivered",
        "drained",
        "gap_waiting",
        "granted",
        "held_bytes",
        "held_data",
        "held_records",
        "index",
        "last_arrival",
        "on_end",
        "on_terminal",
        "opened",
        "refusals",
        "return_below",
        "slot_byte_budget",
        "slot_id",
        "terminal",
        "withdrawn",
    )

    def __init__(
        self,
        credit: int,
        slot_byte_budget: int,
        *,
        wake: Callable[[], None] | None = None,
        return_below: int | None = None,
    ) -> None:
        if credit <= 0:
            raise ValueError("a mux slot needs a positive credit window")
        if slot_byte_budget <= 0:
            raise ValueError("a mux slot needs a positive byte budget")
        self.credit = credit
        self.return_below = credit if return_below is None else max(1, min(return_below, credit))
        """Grant drained credit only once the sender holds fewer data credits than this (by
        this side's count). ``credit`` (the default) grants at every drain; a lower mark
        batches the grants, so a consumer that keeps up returns one CreditUpdate per
        ``credit - return_below + 1`` records instead of one per record."""
        self.capacity = credit + 1
        self.slot_byte_budget = slot_byte_budget
        self._buffer: deque[bytes] = deque()
        # Bound once: compiled, a deque's method called by name is looked up on its type
        # at every call, and these run once per record (its delivery and its take).
        self._append = self._buffer.append
        self._popleft = self._buffer.popleft
        self._wake = wake
        self._dirty: DirtySet | None = None
        self._peer: PeerBudget | None = None
        self._withheld = 0
        self.index = -1
        self.slot_id = -1
        self.opened = False
        self.drained = 0
        self.granted = credit
        self.data_delivered = 0
        self.held_data = 0
        self.held_records = 0
        self.held_bytes = 0
        self.bytes_buffered = 0
        self.gap_waiting = False
        self.terminal = False
        self.closed = False
        self.withdrawn = False
        self.last_arrival = 0.0
        self.on_terminal: Callable[[bytes], None] | None = None
        """Told the terminal as it arrives (before the consumer reads it)."""
        self.on_end: Callable[[], None] | None = None
        """Told once when the slot ends (its lane load is released then)."""
        self.refusals: dict[tuple[Hashable, int], PendingRefusal] | None = None
        """Staged refusals that arrived before the OpenSlot claiming this bind, one per
        (peer, lane); the claiming OpenSlot applies the one from its own (peer, lane)."""

    # -- ingress side ------------------------------------------------------------------------

    def open(
        self, slot_id: int, dirty: DirtySet, peer_budget: PeerBudget | None, now: float
    ) -> None:
        """The stream's OpenSlot claimed this bind: from now on ingress delivers into it.

        The slot opens already holding its window C: no CreditUpdate is sent on the claim,
        so the sender never holds 2C credit against a C + 1 buffer. Heartbeat detection
        starts here, so the claim counts as an arrival.
        """
        if self.opened:
            raise UsageError("an ingress slot is opened once; a second OpenSlot needs a new bind")
        self.opened = True
        self.slot_id = slot_id
        self.index = slot_id >> 8
        self._dirty = dirty
        self._peer = peer_budget
        self.last_arrival = now

    def deliver(self, body: bytes) -> bool:
        """Put one data record into space its credit reserved (``try_send``).

        False means the buffer already holds C data records: a reader stall, which the
        credit check in front of this call makes impossible unless something is broken.
        A slot whose consumer withdrew swallows the record (nobody will read it).
        """
        buffer = self._buffer
        if self.withdrawn:
            self.data_delivered += 1
            return True
        if len(buffer) >= self.credit or self.closed or self.terminal:
            return False
        self._append(body)
        self.data_delivered += 1
        size = len(body)
        self.bytes_buffered += size
        peer = self._peer
        if peer is not None:
            peer.used += size
        if len(buffer) == 1:
            wake = self._wake
            if wake is not None:
                wake()
        return True

    def deliver_terminal(self, body: bytes) -> bool:
        """Put the stream's terminal into the reserved place; False if one was delivered.

        The terminal spends the reserved credit, never data credit, so it always fits.
        """
        if self.terminal or self.closed:
            return False
        self.terminal = True
        if self.on_terminal is not None:
            self.on_terminal(body)
        if self.withdrawn:
            return True
        self._append(body)
        size = len(body)
        self.bytes_buffered += size
        peer = self._peer
        if peer is not None:
            peer.used += size
        wake = self._wake
        if wake is not None:
            wake()
        return True

    def end(self, inject: bytes | None = None) -> None:
        """No more deliveries: the sender closed the slot, or ingress retired it.

        ``inject`` (``Dropped``, or a ``TransportError`` for a protocol violation) goes
        into the reserved place when the stream has not delivered a terminal, so the
        consumer reads every record that arrived and then learns how the stream ended.
        After a terminal the buffer simply closes once the terminal is read.
        """
        if self.closed:
            return
        if inject is not None and not self.terminal:
            self.deliver_terminal(inject)
        self.closed = True
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()
        self.gap_waiting = False
        wake = self._wake
        if wake is not None:
            wake()

    def reconcile(self) -> int:
        """The credit to grant now: the records taken since the last call, exactly once.

        Swaps the drain count to zero, so concurrent paths (arrival, doorbell, periodic
        walk) never double count. While the slot is over its byte budget the credit is
        withheld, kept here, and granted by a later call once the consumer has read the
        slot back under its budget. A slot whose stream has ended grants nothing: its
        sender has freed the slot and would drop the grant anyway.
        """
        owed = self._withheld + self.drained
        self.drained = 0
        if not owed:
            return 0
        if self.closed or self.terminal or self.withdrawn:
            self._withheld = 0
            return 0
        if (
            self.bytes_buffered + self.held_bytes > self.slot_byte_budget
            or self.granted - self.data_delivered - self.held_data >= self.return_below
        ):
            self._withheld = owed
            return 0
        self._withheld = 0
        self.granted += owed
        return owed

    # -- watchdog-facing state ---------------------------------------------------------------

    @property
    def withheld_credit(self) -> int:
        """Credit owed to the sender but held back by the byte budget (or not yet visited)."""
        return self._withheld + self.drained

    @property
    def outstanding_credit(self) -> int:
        """Data credit the sender still holds, per this side's account (0 after a terminal)."""
        if self.terminal or self.closed:
            return 0
        return max(0, self.granted - self.data_delivered - self.held_data)

    @property
    def sender_has_credit(self) -> bool:
        """Whether the sender could be sending (a silent window then counts against it)."""
        return self.outstanding_credit > 0

    def __len__(self) -> int:
        return len(self._buffer)

    # -- Feed (the consumer) -----------------------------------------------------------------

    def take(self) -> bytes | None:
        """The next record, or None. A taken data record is a drain: it counts one credit
        and lists the slot in the dirty set (the first such mark posts the doorbell)."""
        buffer = self._buffer
        if not buffer:
            return None
        body: bytes = self._popleft()
        size = len(body)
        self.bytes_buffered -= size
        peer = self._peer
        if peer is not None:
            peer.used -= size
        # Nothing is delivered after a terminal, so the terminal is always the last record.
        if (buffer or not self.terminal) and not self.closed:
            self.drained += 1
            # Only a drain that a grant will follow names the slot: while the sender still
            # holds return_below credits or more, nothing needs to visit it.
            dirty = self._dirty
            if (
                dirty is not None
                and self.granted - self.data_delivered - self.held_data < self.return_below
            ):
                dirty.mark(self.index)
        return body

    @property
    def exhausted(self) -> bool:
        """No record is left and none will come."""
        return self.withdrawn or (self.closed and not self._buffer)

    def withdraw(self) -> None:
        """The anchor dropped this feed: unread records are discarded and their bytes freed.

        The slot is listed as dirty so the next visit tells the sender (CloseSlot
        UnknownSlot) unless the stream already ended.
        """
        if self.withdrawn:
            return
        self.withdrawn = True
        freed = self.bytes_buffered
        self._buffer.clear()
        self.bytes_buffered = 0
        peer = self._peer
        if peer is not None:
            peer.used -= freed
        dirty = self._dirty
        if dirty is not None and not self.closed:
            dirty.mark(self.index)


if TYPE_CHECKING:

    def _an_ingress_slot_is_a_feed(slot: IngressSlot) -> Feed:
        """Checked by the type checker only: the anchor reads the slot as its feed."""
        return slot
