"""The ordered admission gate: per (peer, lane) backpressure that a sender learns at the send site.

``send`` never blocks and never drops. It returns :data:`ADMITTED` when the frame went
straight onto the lane's QUIC stream, or a :class:`SendAdmission` when the lane is full:
the frame waits *in the gate* (not in the awaitable), and the gate admits waiting frames
strictly in the order ``send`` returned them, whoever awaits. A batcher parks itself on the
admission instead of a runtime worker, which is how the mux learns that a peer is congested.

The per-stream path gives every stream such a gate, and bounds what all of a connection's
streams have queued together with a :class:`SharedRoom` that their gates draw on.

This module is sans-IO: the gate is told how much room its lane has through a callable
and writes through another, so it is tested without sockets or an event loop.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Final, final

from ..errors import AdmissionCancelled, AdmissionError

__all__ = [
    "ADMITTED",
    "CONTENTION_WINDOW",
    "UNBOUNDED",
    "AdmissionState",
    "Admitted",
    "InflightBound",
    "LaneGate",
    "PeerHoldings",
    "PeerLedger",
    "SendAdmission",
    "SendOutcome",
    "SharedRoom",
]


@final
class Admitted:
    """The frame is on the lane's stream. A singleton: the fast path allocates nothing."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ADMITTED"


ADMITTED: Final = Admitted()

UNBOUNDED: Final = sys.maxsize
"""The room of a bound nothing counts against yet: any one frame fits it."""


class AdmissionState(enum.Enum):
    PENDING = "pending"
    ADMITTED = "admitted"
    FAILED = "failed"


ResolvedHook = Callable[["SendAdmission"], None]


class SendAdmission:
    """A frame waiting in a :class:`LaneGate`; await it to learn when it was admitted.

    Awaiting raises the :class:`AdmissionError` that refused it. Dropping the object does
    not cancel the send (the frame stays queued in the gate); cancelling is explicit via
    :meth:`cancel`. ``on_resolved`` observes the outcome without polling or a task.
    """

    __slots__ = ("_error", "_frame", "_future", "_hooks", "_state")

    def __init__(self, frame: bytes) -> None:
        self._frame: bytes | None = frame
        self._state = AdmissionState.PENDING
        self._error: AdmissionError | None = None
        self._future: asyncio.Future[None] | None = None
        self._hooks: list[ResolvedHook] | None = None

    @property
    def state(self) -> AdmissionState:
        return self._state

    @property
    def error(self) -> AdmissionError | None:
        return self._error

    def done(self) -> bool:
        return self._state is not AdmissionState.PENDING

    def cancel(self) -> bool:
        """Withdraw the frame if it is still waiting; True when it was withdrawn."""
        if self._state is not AdmissionState.PENDING:
            return False
        self._fail(AdmissionCancelled("admission cancelled by the sender"))
        return True

    def on_resolved(self, hook: ResolvedHook) -> None:
        """Call ``hook(self)`` once the admission resolves (at once if it already has)."""
        if self._state is not AdmissionState.PENDING:
            hook(self)
            return
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(hook)

    def __await__(self) -> Generator[Any, None, None]:
        if self._state is AdmissionState.PENDING:
            if self._future is None:
                self._future = asyncio.get_running_loop().create_future()
            yield from self._future.__await__()
        if self._error is not None:
            raise self._error

    # -- driven by the gate -------------------------------------------------------------

    def _admit(self) -> None:
        self._state = AdmissionState.ADMITTED
        self._frame = None
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._run_hooks()

    def _fail(self, error: AdmissionError) -> None:
        self._state = AdmissionState.FAILED
        self._error = error
        self._frame = None
        if self._future is not None and not self._future.done():
            # The exception is raised from __await__, not from the future, so an
            # admission nobody awaits never logs "exception was never retrieved".
            self._future.set_result(None)
        self._run_hooks()

    def _run_hooks(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks:
            for hook in hooks:
                hook(self)

    def __repr__(self) -> str:
        return f"<SendAdmission {self._state.value}>"


SendOutcome = Admitted | SendAdmission


def _no_room() -> int:
    return 0


def _never_idle() -> bool:
    return False


def _nowhere(frame: bytes) -> None:
    """A closed gate's writer: never called (every send checks the close first)."""


class LaneGate:
    """FIFO admission for one (peer, lane).

    ``room()`` returns how many more bytes the lane may take now: the peer-granted
    flow-control window plus a bounded local send buffer, less what is already queued on
    the stream. A frame larger than any possible room would never fit, so a frame is also
    admitted whenever the lane's stream has nothing queued beyond the window
    (``idle()``); memory per lane is therefore bounded by window + send buffer + one
    ``max_message_size`` frame.
    """

    __slots__ = ("_closed_error", "_idle", "_pending", "_room", "_write")

    def __init__(
        self,
        room: Callable[[], int],
        idle: Callable[[], bool],
        write: Callable[[bytes], None],
    ) -> None:
        self._room = room
        self._idle = idle
        self._write = write
        self._pending: deque[SendAdmission] = deque()
        self._closed_error: AdmissionError | None = None

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed_error is not None

    @property
    def head_size(self) -> int:
        """Size of the oldest frame still waiting, 0 when none is (a shared room's poll
        uses it to tell "blocked by my own bound" from "blocked by the shared one")."""
        for admission in self._pending:
            if admission._frame is not None:
                return len(admission._frame)
        return 0

    def _fits(self, size: int) -> bool:
        return size <= self._room() or self._idle()

    def try_send(self, frame: bytes) -> bool:
        """Admit ``frame`` only if :meth:`send` would have admitted it at once; never queue.

        What a caller that must not wait uses (heartbeats, a ``try_send`` before an
        awaited ``send``): the room is computed once and nothing is allocated.
        """
        if self._closed_error is not None or self._pending or not self._fits(len(frame)):
            return False
        self._write(frame)
        return True

    def send(self, frame: bytes) -> SendOutcome:
        """Admit ``frame`` now, or queue it behind the frames already waiting."""
        if self._closed_error is not None:
            admission = SendAdmission(frame)
            admission._fail(self._closed_error)
            return admission
        if not self._pending and self._fits(len(frame)):
            self._write(frame)
            return ADMITTED
        admission = SendAdmission(frame)
        self._pending.append(admission)
        return admission

    def poll(self) -> int:
        """Admit waiting frames that fit now, in order; returns how many were admitted.

        Called after the connection processed datagrams (acknowledgements and
        MAX_STREAM_DATA are what open room) and after a connection becomes usable.
        """
        admitted = 0
        pending = self._pending
        while pending:
            head = pending[0]
            if head._state is not AdmissionState.PENDING:
                pending.popleft()  # cancelled while waiting
                continue
            frame = head._frame
            assert frame is not None
            if not self._fits(len(frame)):
                break
            pending.popleft()
            self._write(frame)
            head._admit()
            admitted += 1
        return admitted

    def close(self, error: AdmissionError) -> int:
        """Refuse every waiting frame with ``error`` and any later send; returns the count.

        The gate's callables are its stream's own methods, and the stream holds the gate:
        a closed gate never calls them again, so it lets them go, and an ended stream is
        freed when its last reference goes instead of waiting for the cyclic collector."""
        if self._closed_error is None:
            self._closed_error = error
            self._room = _no_room
            self._idle = _never_idle
            self._write = _nowhere
        refused = 0
        while self._pending:
            admission = self._pending.popleft()
            if admission._state is AdmissionState.PENDING:
                admission._fail(error)
                refused += 1
        return refused


class SharedRoom:
    """A byte bound that several gates draw on together, served in the order they waited.

    The per-stream path opens one QUIC stream, and one :class:`LaneGate`, per token stream.
    Each gate bounds its own stream; this bounds what all of them have queued on one
    connection, so a thousand streams written at full rate cannot pile megabytes into the
    QUIC stack between two packets. A gate's room callable takes the smaller of its own
    room and :meth:`room`.

    ``used()`` is the bytes the bound counts now (for the per-stream path: written inside
    each stream's peer window and not yet transmitted). When ``used()`` is zero the room
    is :data:`UNBOUNDED`, so a frame larger than ``limit`` is still admitted, alone.

    Fairness: a frame that waits because this room is short (not its own gate's) makes the
    room *saturated*, and a saturated room has no room for a new send on any gate until
    :meth:`poll` has served the waiting gates, oldest first. Otherwise a steady trickle of
    small frames on other streams could keep a large one waiting for ever. Gates that wait
    on their own bound (a consumer that stopped reading) never saturate it, so they hold
    up nobody else.
    """

    __slots__ = ("_limit", "_members", "_saturated", "_serving", "_used", "_waiting")

    def __init__(self, limit: int, used: Callable[[], int]) -> None:
        self._limit = limit
        self._used = used
        self._waiting: deque[LaneGate] = deque()
        self._members: set[LaneGate] = set()
        self._saturated = False
        self._serving = False

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def saturated(self) -> bool:
        return self._saturated

    @property
    def waiting_count(self) -> int:
        """Gates with frames waiting (on this room or on their own bound)."""
        return len(self._waiting)

    def _free(self) -> int:
        used = self._used()
        return self._limit - used if used else UNBOUNDED

    def room(self) -> int:
        """What a gate may take now: -1 while saturated (outside :meth:`poll`)."""
        if self._saturated and not self._serving:
            return -1
        return self._free()

    def waiting(self, gate: LaneGate, size: int) -> None:
        """``gate`` queued a frame of ``size`` bytes; it is served by :meth:`poll`, in turn."""
        if gate not in self._members:
            self._members.add(gate)
            self._waiting.append(gate)
        if size > self._free():
            self._saturated = True

    def poll(self) -> int:
        """Admit what fits now, gate by gate in the order they began waiting; returns the
        number of frames admitted. Call it whenever ``used()`` may have fallen.

        A gate still waiting afterwards either waits on this room (the poll stops there:
        nobody behind it may overtake it) or on its own bound (it goes to the back, and the
        gates behind it are served).
        """
        waiting = self._waiting
        if not waiting:
            self._saturated = False
            return 0
        admitted = 0
        saturated = False
        self._serving = True
        try:
            for _ in range(len(waiting)):
                gate = waiting[0]
                admitted += gate.poll()
                if gate.pending_count == 0:
                    waiting.popleft()
                    self._members.discard(gate)
                    continue
                if gate.head_size > self._free():
                    saturated = True
                    break
                waiting.rotate(-1)
        finally:
            self._serving = False
        self._saturated = saturated
        return admitted

    def clear(self) -> None:
        """Forget every waiting gate (their connection closed and refused them)."""
        self._waiting.clear()
        self._members.clear()
        self._saturated = False


CONTENTION_WINDOW: Final = 1.0
"""Seconds since another peer last had lane data within which a peer's turn share holds."""


class PeerHoldings:
    """What all of one peer's connections hold, together: the per-peer side of two bounds.

    A peer may keep several connections (``max_connections_per_peer``); a bound per
    connection alone would let it multiply what this node holds for it by that count. So
    the bytes admitted and not yet acknowledged (``max_unacked_bytes_per_peer``) and the
    unfinished inbound frames (``max_partial_frame_bytes``) are also summed here, over
    every connection of the peer, and checked against the peer's limit.
    """

    __slots__ = (
        "_call_soon",
        "_deferred",
        "_ledger",
        "_refill_armed",
        "_wakers",
        "active_at",
        "partial_bytes",
        "peer_limit",
        "turn_bytes",
        "turn_left",
        "unacked",
    )

    def __init__(
        self,
        peer_limit: int,
        turn_bytes: int = UNBOUNDED,
        call_soon: Callable[[Callable[[], None]], object] | None = None,
        ledger: PeerLedger | None = None,
    ) -> None:
        self.peer_limit = peer_limit
        self.unacked = 0
        """Bytes admitted to the peer's connections' lanes and not yet acknowledged."""
        self.partial_bytes = 0
        """Bytes of unfinished frames on the peer's inbound lanes."""
        self._wakers: list[Callable[[], None]] = []
        self.turn_bytes = turn_bytes
        self.turn_left = turn_bytes
        """Bytes of lane data the peer may still have handled in this turn of the loop."""
        self._call_soon = call_soon
        self._refill_armed = False
        self._deferred: list[Callable[[], None]] = []
        self._ledger = ledger
        self.active_at = -CONTENTION_WINDOW
        """When (the ledger's clock) this peer's lane data was last first charged in a turn."""

    # -- turns: a bounded share of each loop turn per peer -------------------------------

    def take_turn(self, size: int) -> int:
        r"""Charge up to ``size`` bytes of lane data to this turn and return how many were
        charged: all of them while the share lasts, what is left of the share when they
        would pass it, 0 once it is spent (the caller keeps the rest and :meth:`defer`\ s
        itself to the next turn). A piece is cut at the share rather than charged whole
        because an engine hands over a whole GRO burst's stream data as one piece (up to
        64 KiB): charged whole, it would let a flooder take several shares in one turn.

        The turn is refilled by a callback the first charge of a turn schedules, so it
        runs after everything the loop is doing now: every other peer's datagrams of this
        turn get their share before this peer gets more. Lane data held back is not
        consumed, so the peer's receive window stops growing and its sending slows to
        its share.

        A share is only spent against someone: while no other peer of the ledger has had
        lane data charged within :data:`CONTENTION_WINDOW`, a spent share is renewed on the
        spot and a piece is never cut. Splitting a lone peer's burst over loop turns would
        serve nobody, and costs its consumers a wait and a wake-up for each split. The
        window is long beside a request's round trip so that a peer sending now and then
        still counts as present: a window of a loop turn or two let a flooder take whole
        turns between a legitimate peer's datagrams, which then waited behind them.
        """
        left = self.turn_left
        if left <= 0:
            if self._contended():
                return 0
            left = self.turn_bytes  # nobody else to yield to: a fresh share
        elif size > left and self._contended():
            size = left
        self.turn_left = left - size
        if not self._refill_armed and self._call_soon is not None:
            self._refill_armed = True
            self._call_soon(self._refill)
            if self._ledger is not None:
                self._ledger.charged(self)
        return size

    def _contended(self) -> bool:
        ledger = self._ledger
        return ledger is None or ledger.contended(self)

    def defer(self, resume: Callable[[], None]) -> None:
        """Call ``resume`` at the next turn (once per call)."""
        self._deferred.append(resume)

    def _refill(self) -> None:
        self._refill_armed = False
        self.turn_left = self.turn_bytes
        deferred, self._deferred = self._deferred, []
        for resume in deferred:
            resume()

    @property
    def members(self) -> int:
        return len(self._wakers)

    def join(self, wake: Callable[[], None]) -> None:
        self._wakers.append(wake)

    def leave(self, wake: Callable[[], None]) -> None:
        self._wakers.remove(wake)

    def room(self) -> int:
        return self.peer_limit - self.unacked

    def wake_others(self, caller: Callable[[], None]) -> None:
        """Room opened on one connection: the peer's others may admit what waits on it."""
        for wake in list(self._wakers):
            if wake != caller:  # bound methods: equal, never identical
                wake()


class PeerLedger:
    """One :class:`PeerHoldings` per peer with a live connection (entries go with the last),
    and who had lane data lately, so a peer's share is only enforced while another peer
    competes for the loop."""

    __slots__ = ("_call_soon", "_clock", "_peers", "peer_limit", "turn_bytes")

    def __init__(
        self,
        peer_limit: int,
        turn_bytes: int = UNBOUNDED,
        call_soon: Callable[[Callable[[], None]], object] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.peer_limit = peer_limit
        self.turn_bytes = turn_bytes
        self._call_soon = call_soon
        self._clock = clock
        self._peers: dict[object, PeerHoldings] = {}

    def charged(self, holdings: PeerHoldings) -> None:
        """``holdings``' first charge of a loop turn: it is competing now."""
        if self._clock is not None:
            holdings.active_at = self._clock()

    def contended(self, holdings: PeerHoldings) -> bool:
        """Whether another peer had lane data within :data:`CONTENTION_WINDOW` (always,
        without a clock to tell)."""
        if self._clock is None:
            return True
        recent = self._clock() - CONTENTION_WINDOW
        return any(
            other is not holdings and other.active_at >= recent for other in self._peers.values()
        )

    def __len__(self) -> int:
        return len(self._peers)

    def join(self, peer: object, wake: Callable[[], None]) -> PeerHoldings:
        holdings = self._peers.get(peer)
        if holdings is None:
            holdings = self._peers[peer] = PeerHoldings(
                self.peer_limit, self.turn_bytes, self._call_soon, self
            )
        holdings.join(wake)
        return holdings

    def leave(self, peer: object, holdings: PeerHoldings, wake: Callable[[], None]) -> None:
        holdings.leave(wake)
        if not holdings.members and self._peers.get(peer) is holdings:
            del self._peers[peer]


class InflightBound:
    """This node's own cap on what one connection's lanes hold unacknowledged.

    A lane's gate otherwise admits up to the peer's window plus ``send_buffer``, and the
    window is the peer's to choose: a member granting a gigabyte and acknowledging nothing
    would have every frame admitted and held by the QUIC stack. The cap is ours: past
    ``limit`` bytes admitted and not acknowledged on this connection, or past the peer's
    limit over all of its connections (:class:`PeerHoldings`), :meth:`room` is negative and
    the gates wait, so what waits stays in the gates, where the layer above charges and
    bounds it.

    Both the lanes and the per-stream path's streams count: a member that grants large
    windows and acknowledges nothing would otherwise have every per-stream write held
    too. ``unacked`` is the lanes' exact count after :meth:`resync` (run when datagrams
    arrived, which is when acknowledgements do) plus ``streams``, the per-stream streams'
    part, and every write in between, so the check on the send path costs two
    subtractions. The per-stream part is recounted only when :meth:`stream_count_due`
    (a walk over every stream the connection writes, too dear per datagram); between
    counts it only grows, so it errs towards waiting, never towards holding more.

    A connection that stays above half its cap is *stalled*; :meth:`stalled_for` says since
    when, for the close of a peer that keeps a connection alive and never acknowledges.
    """

    __slots__ = ("_calm_at", "holdings", "limit", "streams", "unacked")

    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        self.unacked = 0
        self.streams = 0
        """The per-stream streams' part of ``unacked``: exact at the last count, plus what
        they wrote since."""
        self.holdings: PeerHoldings | None = None
        self._calm_at = now

    def room(self) -> int:
        """Bytes the connection's lanes may still take: negative once a cap is reached."""
        room = self.limit - self.unacked
        holdings = self.holdings
        if holdings is not None:
            peer_room = holdings.peer_limit - holdings.unacked
            if peer_room < room:
                return peer_room
        return room

    def written(self, size: int) -> None:
        self.unacked += size
        if self.holdings is not None:
            self.holdings.unacked += size

    def stream_written(self, size: int) -> None:
        """A per-stream stream wrote ``size`` bytes (:meth:`written`'s count, inline: it
        runs per frame)."""
        self.streams += size
        self.unacked += size
        if self.holdings is not None:
            self.holdings.unacked += size

    def stream_count_due(self) -> bool:
        """Whether :meth:`resync` should be given the per-stream part counted afresh: it
        counts something and the connection is past half its cap or out of room (where
        the stall clock runs and gates wait, an estimate must not decide)."""
        return self.streams > 0 and (self.unacked * 2 > self.limit or self.room() <= 0)

    def resync(self, lanes_unacked: int, now: float, streams_unacked: int | None = None) -> bool:
        """Take the lanes' exact count, and the per-stream streams' when counted
        (``None``: keep their part as it stands); True when the total fell (room opened)."""
        if streams_unacked is not None:
            self.streams = streams_unacked
        unacked = lanes_unacked + self.streams
        delta = unacked - self.unacked
        self.unacked = unacked
        if self.holdings is not None:
            self.holdings.unacked += delta
        if unacked * 2 <= self.limit:
            self._calm_at = now
        return delta < 0

    def stalled_for(self, now: float) -> float:
        """Seconds since the connection last held at most half its cap (0 while it does)."""
        if self.unacked * 2 <= self.limit:
            self._calm_at = now
            return 0.0
        return now - self._calm_at

    def detach(self) -> None:
        """The connection ended: what it held no longer counts for its peer."""
        if self.holdings is not None:
            self.holdings.unacked -= self.unacked
        self.unacked = self.streams = 0
