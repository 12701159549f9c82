"""What one connection writes: its lanes, the per-stream path's streams, and their bounds.

A connection this node dialed sends: each lane is an :class:`~.lanes.OutboundStream` with
its admission gate, and the per-stream path opens streams of its own beside them
(:class:`~.perstream_send.PerStreamOutbound`), which share one backlog
(``streams_send_buffer``). A send that waits is polled when room may have opened: when
datagrams arrived (acknowledgements come in them), when the engine's timer ran, when
another connection to the same peer had its bytes acknowledged.

What the lanes and the per-stream streams hold unacknowledged is capped by this node, per
connection and per peer (:class:`~.admission.InflightBound`,
:class:`~.admission.PeerHoldings`); a connection held above half its cap for
``unacked_timeout`` is closed (the stall check), and what a connection that ends never had
acknowledged on its lanes is reported to the handler as lost. A graceful close waits for
the lanes' and the finished per-stream streams' bytes.

:class:`OutboundStreams` is sans-IO: it is given ``now`` and answers with the time of its
next stall check, which the connection keeps among its :class:`~.deadlines.Deadline`;
closing the connection and transmitting it asks of its :class:`OutboundHost`.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ..errors import ChannelClosed, ConnectionReplaced
from ..ids import InstanceId
from .admission import InflightBound, PeerHoldings, PeerLedger, SendOutcome, SharedRoom
from .config import MAX_LANES
from .deliveries import Deliveries, DeliveryCallback
from .handler import EndpointServices
from .lanes import FIRST_EXTRA_STREAM, OutboundStream, StreamHost, stream_of_lane
from .perstream_send import PerStreamOutbound
from .seam import QuicEngine
from .states import CloseCode

__all__ = ["OutboundHost", "OutboundOwner", "OutboundStreams"]

logger = logging.getLogger(__name__)

_PRUNE_FINISHED_MIN = 64
"""Finished per-stream streams remembered before the acknowledged ones are forgotten."""


class OutboundHost(StreamHost, Protocol):
    """What the send side asks of its connection, beyond what its streams ask of it."""

    def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None:
        """Close the connection now (a peer that acknowledges nothing)."""

    def transmit(self) -> None:
        """Transmit now (a lane's reset should leave at once)."""

    def peer_name(self) -> str:
        """The peer, as errors and log lines name it."""


OutboundOwner = EndpointServices
"""What the send side asks of the node's endpoint (a ``ConnectionOwner`` is one)."""


class OutboundStreams:
    """The send side of one connection (see the module docstring)."""

    __slots__ = (
        "_blocked",
        "_cap_counted",
        "_deliveries",
        "_extra",
        "_finished_unacked",
        "_host",
        "_lanes",
        "_next_extra",
        "_owner",
        "_prune_finished_at",
        "_quic",
        "_send_buffer",
        "_stall_period",
        "_stats",
        "_unacked_timeout",
        "close_error",
        "holdings",
        "inflight",
        "stream_room",
    )

    def __init__(
        self, host: OutboundHost, owner: OutboundOwner, quic: QuicEngine, now: float
    ) -> None:
        config = owner.config
        self._host = host
        self._owner = owner
        self._quic = quic
        self._stats = owner.stats
        self._send_buffer = config.send_buffer
        self._unacked_timeout = config.unacked_timeout
        self._stall_period = config.unacked_timeout / 4
        self._lanes: list[OutboundStream | None] = [None] * MAX_LANES
        self._extra: dict[int, OutboundStream] = {}
        self._finished_unacked: set[int] = set()
        """Per-stream streams finished (their FIN written) that may still hold bytes the
        peer has not acknowledged: a graceful close waits for them as for the lanes."""
        self._prune_finished_at = _PRUNE_FINISHED_MIN
        self._next_extra = FIRST_EXTRA_STREAM
        self._blocked: set[OutboundStream] = set()
        self._deliveries = Deliveries()
        self.stream_room = SharedRoom(config.streams_send_buffer, lambda: quic.send_backlog)
        """What the per-stream streams may hold, together, not yet transmitted (polled
        by the connection after each transmit, which is what frees it)."""
        self.inflight = InflightBound(config.max_unacked_bytes, now)
        """This node's cap on what the lanes hold unacknowledged (see InflightBound)."""
        self.holdings: PeerHoldings | None = None
        """What the peer's connections hold together, from establishment to the end."""
        self._cap_counted = False
        self.close_error: ChannelClosed | ConnectionReplaced | None = None
        """What every send is refused with once the connection is closing."""

    # -- sending ---------------------------------------------------------------------------

    def send(self, lane: int, body: bytes) -> SendOutcome:
        outbound = self._lanes[lane]
        if outbound is None:
            outbound = self._lanes[lane] = OutboundStream(
                self._host, stream_of_lane(lane), self._send_buffer, lane
            )
        return outbound.send(body)

    def open_stream(self, send_buffer: int) -> PerStreamOutbound:
        """A new unidirectional stream of its own (the per-stream path), opened on first write.

        Its sends wait while it holds ``send_buffer`` bytes not yet transmitted, or while
        the connection's per-stream streams together hold ``streams_send_buffer``.
        """
        stream = PerStreamOutbound(self._host, self._next_extra, send_buffer, self.stream_room)
        self._next_extra += 4
        self._extra[stream.stream_id] = stream
        if self.close_error is not None:
            stream.gate.close(self.close_error)
        return stream

    def stream_blocked(self, stream: OutboundStream) -> None:
        """A send waits: a lane's is polled with the gates, a per-stream stream's in the
        shared room's turn (it joined that queue itself)."""
        if stream.lane >= 0:
            self._blocked.add(stream)
        stats = self._stats
        stats.send_backpressure += 1
        if not self._cap_counted and self.inflight.room() < stream.gate.head_size:
            self._cap_counted = True  # once per time the cap is reached
            stats.unacked_cap_reached += 1

    def stream_done(self, stream: OutboundStream) -> None:
        self._blocked.discard(stream)
        if self._extra.pop(stream.stream_id, None) is not None and not stream.aborted:
            finished = self._finished_unacked
            finished.add(stream.stream_id)
            if len(finished) >= self._prune_finished_at:  # amortised: bounded by what is unacked
                self._prune_finished()
                self._prune_finished_at = max(_PRUNE_FINISHED_MIN, 2 * len(finished))

    def poll_gates(self) -> None:
        """Room may have opened: admit what waits, lane by lane, then the per-stream
        streams in their shared turn."""
        blocked = self._blocked
        streams_wait = self.stream_room.waiting_count
        if not (blocked or streams_wait) or not self._host.established:
            return
        for stream in list(blocked):
            stream.gate.poll()
            if stream.gate.pending_count == 0:
                blocked.discard(stream)
        if streams_wait and self.inflight.room() > 0:
            self.stream_room.poll()

    def reset_lane(self, lane: int) -> None:
        """Abort one lane's stream (RESET_STREAM); the peer sees the lane cut."""
        outbound = self._lanes[lane]
        if outbound is None:
            return
        self._lanes[lane] = None
        self._blocked.discard(outbound)
        self._deliveries.fail(lane)
        outbound.gate.close(ChannelClosed(f"lane {lane} to {self._host.peer_name()} was reset"))
        self._quic.reset_stream(outbound.stream_id, int(CloseCode.KILLED))
        self._host.transmit()

    def stopped(self, stream_id: int) -> bool:
        """The receiver no longer wants a stream we write (STOP_SENDING): reset it. False
        when it is not one of the per-stream path's."""
        self._finished_unacked.discard(stream_id)  # the peer wants none of it any more
        stream = self._extra.pop(stream_id, None)
        if stream is None:
            return False
        self._blocked.discard(stream)
        stream.finished = True
        stream.gate.close(ChannelClosed("the receiver stopped the stream"))
        try:
            self._quic.reset_stream(stream_id, int(CloseCode.SHUTDOWN))
        except Exception:  # already finished: nothing to reset
            logger.debug("could not reset stream %d", stream_id, exc_info=True)
        return True

    def refuse_pending(self, error: ChannelClosed | ConnectionReplaced) -> None:
        """The connection is closing: what waits, and every send from now on, is refused."""
        self.close_error = error
        for lane in self._lanes:
            if lane is not None:
                lane.gate.close(error)
        for stream in self._extra.values():
            stream.gate.close(error)
        self._blocked.clear()
        self.stream_room.clear()

    # -- acknowledgements ------------------------------------------------------------------

    def on_delivered(self, lane: int, callback: DeliveryCallback) -> None:
        """``callback(True)`` once the peer acknowledged every byte written so far on
        ``lane``; ``callback(False)`` if the connection or the lane ends first."""
        outbound = self._lanes[lane]
        if outbound is None or not self._host.established:
            callback(False)
            return
        target = outbound.written
        if self._quic.stream_unacked(outbound.stream_id) == 0:
            callback(True)
            return
        self._deliveries.watch(lane, target, callback)

    def datagrams_arrived(self, now: float) -> None:
        """Acknowledgements may have come in: recount, admit what waits, tell the callers
        whose bytes the peer acknowledged."""
        if self.holdings is not None:
            self._resync_inflight(now)
        self.poll_gates()
        if self._deliveries.waiting:
            self._deliveries.check(self._acknowledged)

    def _acknowledged(self, lane: int) -> int | None:
        """How far the peer acknowledged ``lane``'s bytes (None: the lane is gone)."""
        outbound = self._lanes[lane]
        if outbound is None:
            return None
        return outbound.written - self._quic.stream_unacked(outbound.stream_id)

    def unacked_total(self) -> int:
        """Admitted bytes the peer has not acknowledged: the lanes', and those of the
        per-stream streams already finished (a producer that finalizes its streams and
        closes at once must not cut their last bytes off: the engine may still be pacing
        them out when the close comes)."""
        total = self._lanes_unacked()
        if self._finished_unacked:
            total += self._prune_finished()
        return total

    def _prune_finished(self) -> int:
        """Forget the finished streams the peer acknowledged; the others' unacknowledged bytes."""
        unacked = 0
        for stream_id in list(self._finished_unacked):
            left = self._quic.stream_unacked(stream_id)
            if left:
                unacked += left
            else:
                self._finished_unacked.discard(stream_id)
        return unacked

    def _streams_unacked(self) -> int:
        """What the per-stream streams hold unacknowledged, open and finished: a walk over
        all of them, so only when the estimate may decide (``stream_count_due``)."""
        quic = self._quic
        unacked = sum(quic.stream_unacked(stream_id) for stream_id in self._extra)
        if self._finished_unacked:
            unacked += self._prune_finished()
        return unacked

    def _lanes_unacked(self) -> int:
        quic = self._quic
        return sum(quic.stream_unacked(lane.stream_id) for lane in self._lanes if lane is not None)

    # -- this node's cap on unacknowledged bytes (InflightBound, PeerHoldings) --------------

    def join(self, ledger: PeerLedger, peer: InstanceId, now: float) -> float:
        """Established: count with the peer's other connections. The time of the first
        stall check."""
        holdings = self.holdings = ledger.join(peer, self.poll_gates)
        self.inflight.holdings = holdings
        return now + self._stall_period

    def leave(self, ledger: PeerLedger, peer: InstanceId) -> None:
        """The connection ended: what it held no longer counts for its peer, and room it
        held may admit what waits on the peer's other connections."""
        holdings = self.holdings
        if holdings is None:
            return
        self.holdings = None
        self.inflight.detach()
        self.inflight.holdings = None
        ledger.leave(peer, holdings, self.poll_gates)
        if holdings.room() > 0:
            holdings.wake_others(self.poll_gates)

    def _resync_inflight(self, now: float) -> None:
        """Acknowledgements came in: recount; room opened here may admit another
        connection's waiting sends to the same peer (its cap is per peer too)."""
        inflight = self.inflight
        if not inflight.unacked:
            return
        holdings = self.holdings
        was_full = holdings is not None and holdings.room() <= 0
        streams = self._streams_unacked() if inflight.stream_count_due() else None
        if inflight.resync(self._lanes_unacked(), now, streams):
            if was_full and holdings is not None:
                holdings.wake_others(self.poll_gates)
            if self._cap_counted and inflight.room() > 0:
                self._cap_counted = False

    def check_stall(self, now: float) -> float | None:
        """Close a connection whose peer has held it above half the cap too long; the time
        of the next check (None: the connection is not established, or was closed)."""
        if not self._host.established:
            return None
        inflight = self.inflight
        streams = self._streams_unacked() if inflight.streams else None
        inflight.resync(self._lanes_unacked(), now, streams)
        stalled = inflight.stalled_for(now)
        timeout = self._unacked_timeout
        if stalled >= timeout:
            self._stats.rejections["unacked_stall"] += 1
            logger.warning(
                "closing connection to %s: it held %d unacknowledged bytes (more than half of"
                " max_unacked_bytes %d) for %.0f s (unacked_timeout %g s)",
                self._host.peer_name(),
                inflight.unacked,
                inflight.limit,
                stalled,
                timeout,
            )
            self._host.close(CloseCode.UNACKNOWLEDGED, "nothing acknowledged for too long")
            return None
        return now + self._stall_period

    def report_unacked(self, peer: InstanceId, error: ChannelClosed | ConnectionReplaced) -> None:
        """Admitted data the peer never acknowledged: report it to the node's error handler."""
        for lane in self._lanes:
            if lane is None:
                continue
            lost = self._quic.stream_unacked(lane.stream_id)
            if lost:
                self._stats.send_failures_after_admission += 1
                self._owner.handler.send_failed(
                    peer,
                    lane.lane,
                    ChannelClosed(
                        f"{error}; {lost} admitted bytes on lane {lane.lane} unacknowledged"
                    ),
                )

    def ended(self) -> None:
        """The connection ended: no acknowledgement will come for what is still watched."""
        self._deliveries.fail()

    # -- the snapshot ------------------------------------------------------------------------

    @property
    def lanes(self) -> tuple[int, ...]:
        """The lanes written so far (not reset)."""
        return tuple(lane.lane for lane in self._lanes if lane is not None)

    @property
    def extra_streams(self) -> int:
        return len(self._extra)

    def waiting(self) -> tuple[int, int]:
        """Streams with sends waiting (or to be polled), and of those waiting, how many
        only the peer's reader can release (see ``OutboundStream.held_by_peer_window``)."""
        streams = [lane for lane in self._lanes if lane is not None]
        streams.extend(self._extra.values())
        waiting = {s for s in streams if s.gate.pending_count}
        held = sum(1 for s in waiting if s.held_by_peer_window)
        return len(waiting | self._blocked), held
