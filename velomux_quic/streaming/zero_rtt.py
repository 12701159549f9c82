"""Zero-RTT streams, the consumer's half: the pre-bind and the rules around it.

The receiver chooses every field of an attach answer by itself, so it can bind a stream's
slot before any sender asks (:meth:`~ZeroRtt.prebind`) and hand the application a
:class:`StreamOpenTicket`; the producer then opens the stream with the ticket
(``AnchorProducer.open_with_ticket``) and its first batch's OpenSlot claims the bind, with
no ``_anchor_attach`` on the wire. The rules around a pre-bind (adoption by an ordinary
attach, release, expiry) live here; the mux keeps the binds themselves (``mux/binds.py``).

:class:`ZeroRtt` works on the manager's anchors through :class:`PrebindHost`, five calls
the manager offers for it, and on the mux through
:class:`~velomux_quic.streaming.transports.PrebindTransport`.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ..errors import TicketError
from ..ids import InstanceId, StreamAnchorHandle
from .anchor import AnchorEntry, RemoteSender
from .control import (
    MESSENGER_MUX_KEY,
    AnchorAttachRequest,
    MpscAnchorAttachRequest,
    StreamOpenTicket,
)
from .metrics import StreamingMetrics
from .transports import BindTerms, PrebindTransport

__all__ = ["PrebindHost", "ZeroRtt"]

logger = logging.getLogger(__name__)


class PrebindHost(Protocol):
    """What the pre-bind needs from the anchor manager (the consumer's side)."""

    @property
    def metrics(self) -> StreamingMetrics:
        """The node's streaming metrics (prebinds and reaped binds are counted)."""

    def local_anchor(self, handle: StreamAnchorHandle) -> AnchorEntry | None:
        """The live anchor of ``handle`` on this node, or None (another node's, gone)."""

    def bind_remote(
        self,
        entry: AnchorEntry,
        transport: PrebindTransport,
        *,
        peer: InstanceId | None,
        lane_key: int | None,
    ) -> tuple[RemoteSender, BindTerms]:
        """Register a remote sender of ``entry`` (``peer`` None: a pre-bind), bind it on
        ``transport`` and arm its watchdog, as the attach handler does."""

    def end_remote(self, entry: AnchorEntry, remote: RemoteSender, *, dropped: bool) -> None:
        """Forget a remote sender: its bind, watchdog and feed; ``dropped`` tells the
        reader the producer vanished (SenderDropped), else the anchor may be attached
        again (and its unattached timer restarts when nobody is left)."""


class ZeroRtt:
    """The pre-bind and its rules; see the module docstring."""

    def __init__(self, host: PrebindHost) -> None:
        self._host = host
        self.mux: PrebindTransport | None = None
        """The transport pre-binds are made on; None until the node installs the mux."""

    def prebind(self, handle: StreamAnchorHandle, *, key: int | None = None) -> StreamOpenTicket:
        """Do the attach handler's work now, before any sender asks, and return the ticket
        a producer opens the stream with, with no attach round trip.

        Raises :class:`TicketError` (logged and counted) when no mux is installed, for an
        MPSC anchor, another node's handle, an anchor already attached or pre-bound, or
        one that is gone. ``key`` places the stream as an attach's ``key`` does.
        """
        host = self._host
        mux = self.mux
        entry = host.local_anchor(handle)
        why: str | None = None
        if mux is None:
            why = (
                "this node has no mux (messenger-mux-v2), and only the mux binds a stream "
                "before its sender asks: start the node with the mux enabled, or let the "
                "producer attach_anchor(handle) instead"
            )
        elif entry is None:
            why = (
                "there is no such live anchor on this node: pre-bind on the node that created "
                "the anchor, before it finished or was cancelled"
            )
        elif entry.mpsc:
            why = (
                "it is an MPSC anchor, and a ticket opens a single-sender stream: "
                "let each producer attach_mpsc_anchor(handle)"
            )
        elif entry.prebind is not None:
            why = "it is already pre-bound: hand out the ticket that call returned"
        elif entry.attached or entry.sender_count:
            why = "it already has a sender: a ticket is for an anchor nobody attached"
        if why is not None or mux is None or entry is None:
            logger.debug("prebind_anchor(%s) refused: %s", handle, why)
            host.metrics.anchor_operation("prebind", "error", "none").inc()
            raise TicketError(f"cannot pre-bind {handle}: {why}", handle)
        remote, terms = host.bind_remote(entry, mux, peer=None, lane_key=key)
        entry.prebind = remote
        host.metrics.anchor_operation("prebind", "success", MESSENGER_MUX_KEY).inc()
        return StreamOpenTicket(
            streaming_transport_key=MESSENGER_MUX_KEY,
            heartbeat_interval_ms=int(entry.heartbeat_interval * 1000),
            routing_session_id=remote.session_id,
            initial_credit=terms.initial_credit,
            slot_byte_budget=terms.slot_byte_budget,
            lane=terms.lane,
        )

    def claimed(self, entry: AnchorEntry, remote: RemoteSender) -> bool:
        """Whether a ticket's first batch already claimed the pre-bind ``remote``."""
        return self.mux is not None and self.mux.claimed(entry, remote)

    def adopt(
        self,
        peer: InstanceId,
        entry: AnchorEntry,
        remote: RemoteSender,
        request: AnchorAttachRequest | MpscAnchorAttachRequest,
    ) -> BindTerms | str:
        """An ordinary attach meets a pre-bind: it adopts the waiting slot and the ticket's
        session if nothing claimed it yet and the sender can speak the mux (the terms to
        answer with); otherwise the refusal (and a sender without the mux releases the
        pre-bind, so its retry attaches the ordinary way)."""
        mux = self.mux
        if mux is None or not remote.prebound or mux.claimed(entry, remote):
            return f"already_attached: {entry.handle}'s pre-bind was claimed by a ticket"
        if MESSENGER_MUX_KEY not in request.supported_transport_keys:
            self.release(entry, remote)
            return (
                f"no_common_transport: {entry.handle} is pre-bound on {MESSENGER_MUX_KEY}, "
                f"offered {list(request.supported_transport_keys)}; the pre-bind is released"
            )
        terms = mux.adopt(entry, remote, peer)
        remote.node = peer
        remote.prebound = False
        remote.sender_stream_id = request.stream_cancel_handle[1]
        entry.prebind = None
        entry.attached = True
        return terms

    def release(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """Give an unclaimed pre-bind back: its slot, its lane load, its feed."""
        self._host.end_remote(entry, remote, dropped=False)

    def bind_expired(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """The accept window closed and no OpenSlot claimed the bind: the consumer reads
        Dropped (SenderDropped), as it would for a sender that vanished."""
        if entry.senders.get(remote.sender_id) is not remote:
            return
        self._host.metrics.unclaimed_bind_reaped += 1
        logger.info("accept window closed unclaimed: local_id=%x", entry.local_id)
        self._host.end_remote(entry, remote, dropped=True)
