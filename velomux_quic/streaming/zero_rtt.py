"""Zero-RTT streams: the pre-bind (consumer) and the ticket's open (producer).

The receiver chooses every field of an attach answer by itself, so it can bind a stream's
slot before any sender asks (:meth:`~ZeroRtt.prebind`) and hand the application a
:class:`StreamOpenTicket`; the producer then opens the stream with the ticket
(:meth:`~ZeroRtt.open`) and its first batch's OpenSlot claims the bind, with no
``_anchor_attach`` on the wire. The rules around a pre-bind (adoption by an ordinary attach,
release, expiry) live here too; the mux keeps the binds themselves (``mux/binds.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..ids import InstanceId, StreamAnchorHandle
from .anchor import AnchorEntry, RemoteSender
from .control import (
    MESSENGER_MUX_KEY,
    AnchorAttachOk,
    AnchorAttachRequest,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    StreamOpenTicket,
)
from .errors import AttachRefused, WrongHandleKind
from .frames import DROPPED
from .sender import StreamSender
from .transports import AttachTerms

if TYPE_CHECKING:
    from .manager import AnchorManager

__all__ = ["ZeroRtt"]

logger = logging.getLogger(__name__)


class ZeroRtt:
    """The zero-RTT half of :class:`~velomux_quic.streaming.manager.AnchorManager`: it works
    on the manager's anchors, senders and transports, as the attach handler does."""

    def __init__(self, manager: AnchorManager) -> None:
        self._manager = manager

    def prebind(
        self, handle: StreamAnchorHandle, *, key: int | None = None
    ) -> StreamOpenTicket | None:
        """Do the attach handler's work now, before any sender asks, and return the ticket
        a producer opens the stream with (:meth:`open_anchor_stream`) with no attach round
        trip. None when no mux is installed (silently), or, logged and counted, for an
        MPSC anchor, another node's handle, an anchor already attached or pre-bound, or
        one that is gone. ``key`` places the stream as in :meth:`attach_anchor`.
        """
        mux = self._manager._mux()
        if mux is None:
            return None
        entry = (
            self._manager._anchors.get(handle.local_id)
            if handle.worker_id == self._manager.worker_id
            else None
        )
        why = None
        if entry is None or entry.finished:
            why = "no such anchor on this node"
        elif entry.mpsc:
            why = "an MPSC anchor cannot be pre-bound"
        elif entry.attached or entry.prebind is not None or entry.sender_count:
            why = "already attached or pre-bound"
        if why is not None or entry is None:
            logger.debug("prebind_anchor(%s) refused: %s", handle, why)
            self._manager.metrics.anchor_operations.labels("prebind", "error", "none").inc()
            return None
        remote = self._manager._new_remote(entry, None, MESSENGER_MUX_KEY, key)
        entry.prebind = remote
        terms = mux.bind(entry, remote)
        self._manager._arm_watchdog(entry, remote, entry.heartbeat_interval)
        self._manager.metrics.anchor_operations.labels(
            "prebind", "success", MESSENGER_MUX_KEY
        ).inc()
        return StreamOpenTicket(
            streaming_transport_key=MESSENGER_MUX_KEY,
            heartbeat_interval_ms=int(entry.heartbeat_interval * 1000),
            routing_session_id=remote.session_id,
            initial_credit=terms.initial_credit,
            slot_byte_budget=terms.slot_byte_budget,
            lane=terms.lane,
        )

    async def open(self, handle: StreamAnchorHandle, ticket: StreamOpenTicket) -> StreamSender:
        """Open a stream on a pre-bound anchor with its ticket: the first batch carries the
        OpenSlot that claims the bind; no ``_anchor_attach`` crosses the wire."""
        if handle.is_mpsc:
            raise WrongHandleKind(f"{handle} is an MPSC handle; tickets are single-sender", handle)
        if handle.worker_id == self._manager.worker_id:
            raise AttachRefused(
                f"{handle} was minted on this node: use attach_anchor here, not a ticket", handle
            )
        transport = self._manager.transports.get(ticket.streaming_transport_key)
        if transport is None:
            raise AttachRefused(
                f"the ticket names {ticket.streaming_transport_key!r}, which this node cannot "
                "connect on",
                handle,
            )
        peer = self._manager._peer_of(handle.worker_id)
        if peer is None:
            raise AttachRefused(f"no known node has WorkerId {handle.worker_id:#x}", handle)
        sender_stream_id = self._manager._next_sender_stream
        self._manager._next_sender_stream += 1
        terms = AttachTerms(
            peer=peer,
            handle=handle,
            routing_session_id=ticket.routing_session_id,
            heartbeat_interval=ticket.heartbeat_interval_ms / 1000.0,
            sender_id=0,
            initial_credit=ticket.initial_credit,
            slot_byte_budget=ticket.slot_byte_budget,
            lane=ticket.lane,
        )
        return await self._manager._connect(transport, terms, sender_stream_id)

    def adopt(
        self,
        peer: InstanceId,
        entry: AnchorEntry,
        remote: RemoteSender,
        request: AnchorAttachRequest | MpscAnchorAttachRequest,
    ) -> AnchorAttachOk | MpscAnchorAttachOk | str:
        """An ordinary attach meets a pre-bind: it adopts the waiting slot and the ticket's
        session if nothing claimed it yet and the sender can speak the mux; otherwise the
        attach is refused (and a sender without the mux releases the pre-bind, so its
        retry attaches the ordinary way)."""
        mux = self._manager._mux()
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
        return self._manager._attach_ok(entry, remote, terms, mpsc=entry.mpsc)

    def release(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """Give an unclaimed pre-bind back: its slot, its lane load, its feed."""
        entry.senders.pop(remote.sender_id, None)
        self._manager._forget_sender(entry, remote)
        entry.inbox.withdraw_feed(remote.sender_id)
        if entry.sender_count == 0:
            entry.attached = False
            self._manager._arm_unattached(entry)

    def bind_expired(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """The accept window closed and no OpenSlot claimed the bind: the consumer reads
        Dropped (SenderDropped), as it would for a sender that vanished."""
        if entry.senders.get(remote.sender_id) is not remote:
            return
        self._manager.metrics.unclaimed_bind_reaped += 1
        logger.info("accept window closed unclaimed: local_id=%x", entry.local_id)
        entry.senders.pop(remote.sender_id, None)
        self._manager._forget_sender(entry, remote)
        entry.inbox.withdraw_feed(remote.sender_id)
        entry.inbox.inject(DROPPED, remote.sender_id)
