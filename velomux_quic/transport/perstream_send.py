"""The send side of one stream of the per-stream path, gated by what QUIC has not sent.

:class:`PerStreamOutbound` is what :meth:`PeerConnection.open_stream
<velomux_quic.transport.connection.PeerConnection.open_stream>` hands out: an
:class:`~velomux_quic.transport.lanes.OutboundStream` whose admission counts the stream's own
unsent bytes and the connection's shared per-stream backlog, rather than the peer's window
as a lane does. It is separate from the connection because it is a stream's concern (how
much one stream and all of them together may hold untransmitted), changed together with
:mod:`.admission` and :mod:`.lanes`, not with the connection's lifecycle.
"""

from __future__ import annotations

from .admission import UNBOUNDED, SendAdmission, SendOutcome, SharedRoom
from .lanes import OutboundStream, StreamHost

__all__ = ["PerStreamOutbound"]


class PerStreamOutbound(OutboundStream):
    """A stream of the per-stream path: a lane-like gate over what QUIC has not sent yet.

    A lane's gate counts the peer's window as room, which is right for one stream per
    lane but not for a thousand streams: each would queue a window's worth that aioquic
    then has to trickle out under one congestion window. Here a frame fits while

    * the stream's own unsent bytes (written, never transmitted: waiting for the peer's
      window or for the connection) stay within ``send_buffer``, and
    * the connection's per-stream backlog (written inside the peer windows, not yet
      transmitted) stays within the connection's :class:`SharedRoom`.

    Either bound that counts nothing yet admits any one frame, so a frame larger than a
    bound still goes, alone. Room opens when aioquic transmits (the connection polls the
    shared room after every transmit) or when the peer's window grows.

    Neither bound counts what was transmitted and never acknowledged, which the peer
    decides: that is the connection's own cap (:class:`~.admission.InflightBound`), which
    these streams count towards as the lanes do. Below it a frame must also fit the cap's
    room, unless both bounds above count nothing (it goes alone, as on an idle lane, so
    the most held is the cap plus one frame); past it every frame waits in the shared
    room's turn until acknowledgements (or those of the peer's other connections, for its
    per-peer cap) make room.
    """

    __slots__ = ("_shared",)

    def __init__(
        self, conn: StreamHost, stream_id: int, send_buffer: int, shared: SharedRoom
    ) -> None:
        self._shared = shared
        super().__init__(conn, stream_id, send_buffer)

    def send(self, body: bytes) -> SendOutcome:
        """Queue one frame: ``ADMITTED`` or a pending admission served by the shared room."""
        outcome = self.gate.send(body)
        if isinstance(outcome, SendAdmission) and not outcome.done():
            self._shared.waiting(self.gate, len(body))
            self._conn.stream_blocked(self)
        return outcome

    def try_send(self, body: bytes, *, shared: bool = True) -> bool:
        """Write the frame only if it fits now; nothing is queued or allocated otherwise.

        ``shared=False`` measures the frame against the stream's own bound only, for a
        heartbeat: a few bytes per stream per interval, which other streams keeping the
        connection busy must not silence (the consumer's watchdog would end a live, idle
        stream). It still never overtakes the stream's own waiting frames.
        """
        if shared:
            return self.gate.try_send(body)
        gate = self.gate
        if gate.closed or gate.pending_count or not self._conn.established:
            return False
        unsent = self._quic.stream_unsent(self.stream_id)
        if unsent and unsent + len(body) > self.send_buffer:
            return False
        self.write(body)
        return True

    def room(self) -> int:
        if not self._conn.established:
            return -1
        cap = self._conn.inflight.room()
        if cap <= 0:
            return -1  # the unacknowledged cap is reached: even a lone frame waits
        unsent = self._quic.stream_unsent(self.stream_id)
        own = self.send_buffer - unsent if unsent else UNBOUNDED
        shared = self._shared.room()
        room = own if own < shared else shared
        if room == UNBOUNDED:
            return room  # a lone frame goes below the cap, larger than its room or not
        return cap if cap < room else room

    def idle(self) -> bool:
        return False  # room() already admits a lone frame when nothing is queued

    def _ensure_open(self) -> None:
        opened = self._opened
        super()._ensure_open()
        if not opened:
            self._quic.track_send_backlog(self.stream_id)
