"""The producer side of a node's streaming: senders attached to anchors, and their heartbeats.

:class:`AnchorProducer` is what a node's producers use, owned by the
:class:`~velomux_quic.streaming.manager.AnchorManager`. It attaches a sender to an anchor:
on this node directly into the anchor's inbox with no transport at all (through
:class:`LocalAnchors`, the manager's two calls for it), on another node by the
``_anchor_attach`` / ``_mpsc_anchor_attach`` round trip, whose answer names the transport
to connect on (a refusal raised as its typed
:class:`~velomux_quic.errors.AttachError`), or with a zero-RTT ticket. It keeps the node's
live senders, forgets one when it hands over its terminal, applies the consumer's
``_stream_cancel`` and ``_stream_stop`` (only from the node the sender is attached to),
and sends every remote sender's heartbeats from one task.

It is separate from the manager because it changes for different reasons: what a producer
does with an anchor it writes to, against what a consumer does with the anchors it owns
and the senders it watches. Nothing on the per-record path crosses between the two: a
sender writes into its channel, and the producer is reached only when a sender starts or
ends and once per heartbeat interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from typing import Protocol

from ..errors import (
    AlreadyAttached,
    AnchorNotFound,
    AttachError,
    AttachRefused,
    CallError,
    ControlDecodeError,
    DialError,
    MaxSendersReached,
    PeerGone,
    TicketError,
    UnaryTimeout,
    WrongHandleKind,
)
from ..ids import InstanceId, StreamAnchorHandle, WorkerId, worker_id_of
from ..messenger import Context, Messenger
from ..transport import CONTROL_LANE
from .channels import InboxChannel
from .config import StreamingConfig
from .control import (
    ATTACH_HANDLER,
    CANCEL_HANDLER,
    MPSC_ATTACH_HANDLER,
    STOP_HANDLER,
    AnchorAttachOk,
    AnchorAttachRequest,
    AnchorAttachResponse,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    MpscAnchorAttachResponse,
    StreamControl,
    StreamOpenTicket,
)
from .frames import HEARTBEAT
from .inbox import Inbox
from .metrics import StreamingMetrics
from .sender import SenderState, StreamSender
from .snapshot import SenderSnapshot
from .transports import AttachTerms, StreamTransport, TransportRegistry

__all__ = [
    "ATTACH_ERRORS",
    "TICKETS_REMEMBERED",
    "UNANSWERED_REMEMBERED",
    "AnchorProducer",
    "LocalAnchors",
]

ATTACH_ERRORS: dict[str, type[AttachError]] = {
    "anchor_not_found": AnchorNotFound,
    "already_attached": AlreadyAttached,
    "max_senders_reached": MaxSendersReached,
    "wrong_handle_kind": WrongHandleKind,
}
"""The attach refusal's code (the reason up to its first colon) to the error it raises."""

TICKETS_REMEMBERED = 1 << 16
"""Tickets a node remembers having opened, to refuse a second open of one. A reused
ticket would open a second stream on a slot the first one claimed: the consumer drops its
records as stale and the stream ends cancelled, so it is refused before anything is sent.
The oldest are forgotten first; 64 Ki at ~100 bytes each bounds the memory."""


UNANSWERED_REMEMBERED = 1 << 12
"""Timed-out attaches remembered (per anchor handle) for the retry to name; the oldest
are forgotten first, so a node that gives up on thousands of anchors stays bounded."""

ATTACH_ATTEMPTS = 3
"""Sends of one attach at most, all within its ``attach_timeout``: a request whose
connection ends before the answer (``PeerGone``) goes again. A node resumed after a
long stop sees two connections to the same peer end within a millisecond (its own dial
and the peer's), each failing every call waiting on that peer, hence more than one."""


class LocalAnchors(Protocol):
    """What a same-node attach needs from the consumer side (the manager satisfies it)."""

    def attach_local(self, handle: StreamAnchorHandle, *, mpsc: bool) -> tuple[Inbox, int]:
        """Register a sender on this node's anchor; its inbox and the sender's feed id.
        Raises the attach's typed error (gone, already attached, full)."""

    def local_sender_finished(self, handle: StreamAnchorHandle) -> None:
        """A same-node sender handed over its terminal: a single-sender anchor may be
        attached again."""


def _no_peer(handle: StreamAnchorHandle) -> AttachRefused:
    return AttachRefused(
        f"no known node has WorkerId {handle.worker_id:#x} (the node of {handle}): "
        "register it with node.add_peer(instance_id, address) or configure discovery, "
        "then attach again",
        handle,
    )


class AnchorProducer:
    """This node's senders; see the module docstring."""

    def __init__(
        self,
        messenger: Messenger,
        config: StreamingConfig,
        metrics: StreamingMetrics,
        transports: TransportRegistry,
        local: LocalAnchors,
    ) -> None:
        self._messenger = messenger
        self._config = config
        self._metrics = metrics
        self._transports = transports
        self._local = local
        self._worker_id: WorkerId = worker_id_of(messenger.instance_id)
        self._loop = asyncio.get_running_loop()
        self._senders: dict[int, SenderState] = {}
        self._next_sender_stream = 1
        self._pending_attaches = 0
        self._opened_tickets: dict[tuple[int, int], None] = {}
        self._unanswered: dict[StreamAnchorHandle, int] = {}
        """Per anchor, the session id of this node's last attach that timed out."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._heartbeat_wake = asyncio.Event()
        self._dialed_in: dict[WorkerId, InstanceId] = {}
        """The WorkerIds of the peers only the transport knows (they dialed in, and the
        peer table has no record of them), so an open to one of them finds it without
        digesting every connected peer's id again."""
        self._retiring: set[SenderState] = set()
        """Senders that handed over their terminal and wait for it to leave (remote only)."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        messenger.register_system(CANCEL_HANDLER, self._cancel_handler)
        messenger.register_system(STOP_HANDLER, self._stop_handler)

    # -- attach ----------------------------------------------------------------------

    async def attach(
        self,
        handle: StreamAnchorHandle,
        *,
        mpsc: bool,
        key: int | None = None,
        offer: list[str] | None = None,
    ) -> StreamSender:
        """Attach a sender to ``handle``'s anchor (see ``AnchorManager.attach_anchor``)."""
        if handle.is_mpsc != mpsc:
            raise WrongHandleKind(
                f"{handle} is {'an MPSC' if handle.is_mpsc else 'a single-sender'} handle: "
                f"use {'attach_mpsc_anchor' if handle.is_mpsc else 'attach_anchor'}",
                handle,
            )
        if handle.worker_id == self._worker_id:
            return self._attach_local(handle, mpsc)
        peer = self.peer_of(handle.worker_id)
        if peer is None:
            raise _no_peer(handle)
        sender_stream_id = self._new_sender_stream()
        request_type = MpscAnchorAttachRequest if mpsc else AnchorAttachRequest
        started = time.monotonic()
        deadline = started + self._config.attach_timeout
        attempts = 0
        self._pending_attaches += 1
        try:
            while True:
                request = request_type(
                    handle=handle,
                    session_id=int.from_bytes(os.urandom(8), "big") or 1,
                    stream_cancel_handle=(self._worker_id, sender_stream_id),
                    supported_transport_keys=sorted(
                        self._transports.keys() if offer is None else offer
                    ),
                    lane_key=key,
                    replaces_session_id=self._unanswered.pop(handle, 0),
                )
                try:
                    raw = await self._messenger.unary(
                        peer,
                        MPSC_ATTACH_HANDLER if mpsc else ATTACH_HANDLER,
                        request.encode(),
                        lane=CONTROL_LANE,  # never behind the data queued on the lanes
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                    response = (MpscAnchorAttachResponse if mpsc else AnchorAttachResponse).decode(
                        raw
                    )
                    break
                except (CallError, ControlDecodeError) as exc:
                    if isinstance(exc, (UnaryTimeout, PeerGone)):
                        # The request may still bind (or have bound) on the consumer: the
                        # next attach to this anchor names it, and the consumer releases
                        # that bind for it.
                        self._unanswered[handle] = request.session_id
                        if len(self._unanswered) > UNANSWERED_REMEMBERED:
                            del self._unanswered[next(iter(self._unanswered))]
                    attempts += 1
                    if (
                        isinstance(exc, PeerGone)
                        # No connection could be made at all (a wrong address, a refused
                        # certificate): a resend would only wait out attach_timeout.
                        and not isinstance(exc.__cause__, DialError)
                        and attempts < ATTACH_ATTEMPTS
                        and time.monotonic() < deadline
                    ):
                        # A connection ended under the request (the peer reset it, or it
                        # was replaced): send it again over the next one, within the same
                        # attach_timeout, naming the request it replaces.
                        self._metrics.attach_retries += 1
                        continue
                    self._metrics.attach_rtt_of("error", "none").observe(time.monotonic() - started)
                    if isinstance(exc, UnaryTimeout):
                        address = self._messenger.transport.peer_address(peer)
                        where = "" if address is None else f" at {address[0]}:{address[1]}"
                        raise AttachRefused(
                            f"attach to {handle} failed: no answer from node {peer}{where} "
                            f"within the attach timeout ({self._config.attach_timeout:g} s): "
                            "check that the node runs there and is not overloaded",
                            handle,
                        ) from exc
                    raise AttachRefused(f"attach to {handle} failed: {exc}", handle) from exc
        finally:
            self._pending_attaches -= 1
        if not isinstance(response, (AnchorAttachOk, MpscAnchorAttachOk)):
            self._metrics.attach_rtt_of("error", "none").observe(time.monotonic() - started)
            reason = getattr(response, "reason", "unexpected answer")
            code = reason.partition(":")[0]
            raise ATTACH_ERRORS.get(code, AttachRefused)(reason, handle)
        transport_key = response.streaming_transport_key
        self._metrics.attach_rtt_of("success", transport_key).observe(time.monotonic() - started)
        transport = self._transports.get(transport_key)
        if transport is None:
            raise AttachRefused(
                f"the receiver chose {transport_key!r}, which this node cannot connect on",
                handle,
            )
        terms = AttachTerms(
            peer=peer,
            handle=handle,
            routing_session_id=response.routing_session_id,
            heartbeat_interval=response.heartbeat_interval_ms / 1000.0,
            sender_id=response.sender_id if isinstance(response, MpscAnchorAttachOk) else 0,
            initial_credit=response.initial_credit,
            slot_byte_budget=response.slot_byte_budget,
            lane=response.lane,
        )
        return await self._connect(transport, terms, sender_stream_id)

    async def open_with_ticket(
        self, handle: StreamAnchorHandle, ticket: StreamOpenTicket
    ) -> StreamSender:
        """Open a stream on a pre-bound anchor with its ticket: the first batch carries the
        OpenSlot that claims the bind; no ``_anchor_attach`` crosses the wire. A ticket
        opens one stream: a second open of it on this node raises :class:`TicketError`."""
        if handle.is_mpsc:
            raise WrongHandleKind(
                f"{handle} is an MPSC handle; tickets are single-sender: use attach_mpsc_anchor",
                handle,
            )
        if handle.worker_id == self._worker_id:
            raise AttachRefused(
                f"{handle} was minted on this node: use attach_anchor here, not a ticket", handle
            )
        used = (handle.local_id, ticket.routing_session_id)
        if used in self._opened_tickets:
            raise TicketError(
                f"this ticket for {handle} already opened a stream, and a ticket opens one: "
                "ask the consumer for a new prebind_anchor ticket, or attach_anchor(handle)",
                handle,
            )
        transport = self._transports.get(ticket.streaming_transport_key)
        if transport is None:
            raise AttachRefused(
                f"the ticket names {ticket.streaming_transport_key!r}, which this node cannot "
                "connect on: enable the mux on this node",
                handle,
            )
        peer = self.peer_of(handle.worker_id)
        if peer is None:
            raise _no_peer(handle)
        self._opened_tickets[used] = None
        if len(self._opened_tickets) > TICKETS_REMEMBERED:
            del self._opened_tickets[next(iter(self._opened_tickets))]
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
        return await self._connect(transport, terms, self._new_sender_stream())

    def _new_sender_stream(self) -> int:
        sender_stream_id = self._next_sender_stream
        self._next_sender_stream += 1
        return sender_stream_id

    async def _connect(
        self, transport: StreamTransport, terms: AttachTerms, sender_stream_id: int
    ) -> StreamSender:
        channel = await transport.connect(terms)
        state = SenderState(
            self,
            self._metrics,
            terms.handle,
            channel,
            sender_stream_id=sender_stream_id,
            transport_key=transport.key,
            target=terms.peer,
            heartbeat_interval=terms.heartbeat_interval,
            sender_id=terms.sender_id,
        )
        watch = getattr(channel, "watch", None)
        if watch is not None:  # the mux tells the sender of stops, cancels and closes
            watch(state)
        self._senders[sender_stream_id] = state
        self._idle.clear()
        self._start_heartbeats()
        return StreamSender(state)

    def _attach_local(self, handle: StreamAnchorHandle, mpsc: bool) -> StreamSender:
        inbox, sender_id = self._local.attach_local(handle, mpsc=mpsc)
        state = SenderState(
            self,
            self._metrics,
            handle,
            InboxChannel(inbox, sender_id),
            sender_stream_id=self._new_sender_stream(),
            transport_key=None,
            target=None,
            heartbeat_interval=None,
            sender_id=sender_id if mpsc else 0,
        )
        self._senders[state.sender_stream_id] = state
        self._idle.clear()
        return StreamSender(state)

    def peer_of(self, worker_id: WorkerId) -> InstanceId | None:
        """The known node with this WorkerId (peer table first, then the transport's)."""
        known = self._messenger.peers.by_worker(worker_id)
        if known is not None:
            return known
        transport = self._messenger.transport
        peer = self._dialed_in.get(worker_id)
        if peer is not None and transport.knows(peer):
            return peer
        # A peer not indexed yet, or one the transport forgot: index what it knows now. A
        # WorkerId is a digest, so the ones indexed already are kept, not computed again.
        digests = {peer: digest for digest, peer in self._dialed_in.items()}
        self._dialed_in = {
            digests.get(peer) or worker_id_of(peer): peer for peer in transport.known_peers()
        }
        return self._dialed_in.get(worker_id)

    # -- a sender's end, and the consumer's cancel and stop ----------------------------

    def sender_finished(self, state: SenderState) -> None:
        """A sender handed over its terminal (or was cancelled): no more heartbeats."""
        self._senders.pop(state.sender_stream_id, None)
        if state.target is None:
            # Same-worker: the sentinel is in the channel now; a re-attach may follow.
            self._local.local_sender_finished(state.handle)
        elif not state.retired.done():
            self._retiring.add(state)
            return  # not idle: its terminal has not left
        self._check_idle()

    def sender_retired(self, state: SenderState) -> None:
        """Its terminal's fate is known (or it was cancelled, or abandoned)."""
        retiring = self._retiring
        if state in retiring:
            retiring.discard(state)
            self._check_idle()

    def _check_idle(self) -> None:
        if not self._senders and not self._retiring:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no sender of this node is open and every terminal it handed over left."""
        await self._idle.wait()

    def cancel_local_senders(self, local_id: int, sender_ids: set[int]) -> None:
        """This node's anchor ``local_id`` was cancelled: cancel its same-node senders."""
        for state in list(self._senders.values()):
            if (
                state.target is None
                and state.handle.local_id == local_id
                and _feed_id(state) in sender_ids
            ):
                state.cancel()

    def stop_local_senders(self, local_id: int) -> None:
        """This node's anchor ``local_id`` asks its same-node senders to stop."""
        for state in self._senders.values():
            if state.target is None and state.handle.local_id == local_id:
                state.request_stop()

    def _cancel_handler(self, ctx: Context) -> None:
        state = self._own_sender(ctx)
        if state is not None:
            state.cancel()

    def _stop_handler(self, ctx: Context) -> None:
        state = self._own_sender(ctx)
        if state is not None:
            state.request_stop()

    def _own_sender(self, ctx: Context) -> SenderState | None:
        try:
            control = StreamControl.decode(ctx.payload)
        except ControlDecodeError:
            return None
        state = self._senders.get(control.sender_stream_id)
        # Only the node the sender is attached to may stop or cancel it.
        if state is None or state.target != ctx.sender:
            return None
        return state

    # -- heartbeats (one task for every remote sender) ---------------------------------

    def _start_heartbeats(self) -> None:
        self._heartbeat_wake.set()
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = self._loop.create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        while not self._closed:
            self._heartbeat_wake.clear()
            now = self._loop.time()
            next_due: float | None = None
            for state in list(self._senders.values()):
                interval = state.heartbeat_interval
                if interval is None or state.terminal_sent:
                    continue
                if state.channel.closed:
                    # The channel closed under an open sender (its connection died at the
                    # idle timeout: the consumer's node is gone). Nothing else tells an
                    # idle producer, so its cancellation fires here, within an interval.
                    self._metrics.senders_lost += 1
                    state.cancel()
                    continue
                if state.next_heartbeat <= now:
                    if state.channel.try_send(HEARTBEAT):
                        self._metrics.heartbeats_sent += 1
                    else:  # a full channel drops the heartbeat: saturation shows as silence
                        self._metrics.heartbeats_dropped += 1
                    state.next_heartbeat = now + interval
                if next_due is None or state.next_heartbeat < next_due:
                    next_due = state.next_heartbeat
            if next_due is None:
                return  # nobody to heartbeat: the task ends, the next attach restarts it
            with contextlib.suppress(TimeoutError):  # the next heartbeat is due
                await asyncio.wait_for(self._heartbeat_wake.wait(), max(0.001, next_due - now))

    # -- introspection and shutdown ----------------------------------------------------

    @property
    def pending_attaches(self) -> int:
        """Attach requests sent that have no answer yet."""
        return self._pending_attaches

    @property
    def heartbeat_task_running(self) -> bool:
        """Whether the heartbeat task runs (it ends when no remote sender is left)."""
        return self._heartbeat_task is not None and not self._heartbeat_task.done()

    def sender_snapshots(self) -> tuple[SenderSnapshot, ...]:
        """Every live sender of this node, copied."""
        return tuple(
            SenderSnapshot(
                handle=state.handle,
                sender_id=state.sender_id,
                state=state.state,
                target=state.target,
                transport_key=state.transport_key,
                credit=state.channel.credit,
                queued_bytes=state.channel.queued_bytes,
                lane=state.channel.lane,
            )
            for state in self._senders.values()
        )

    def senders_per_transport(self) -> dict[str, int]:
        """Live senders by transport key (``local`` for a same-node anchor)."""
        return dict(Counter(state.transport_key or "local" for state in self._senders.values()))

    async def close(self) -> None:
        """End every stream on the wire and stop the heartbeat task (the node is closing).

        A remote stream that is still open gets the shutdown terminal at once (its consumer
        raises SenderDropped saying the producer shut down, within a round trip, instead
        of waiting for its watchdog); one that was finalized keeps its terminal. Both get
        up to ``close_flush_timeout`` to be handed to the transport, which then gives the
        admitted bytes its own ``close_timeout`` to be acknowledged. Same-node senders are
        cancelled: their anchors close with this node.
        """
        self._closed = True
        for state in list(self._senders.values()):
            if state.target is None:
                state.cancel()
            else:
                state.shut_down()
        pending = [state.retired for state in self._retiring if not state.retired.done()]
        if pending:
            await asyncio.wait(pending, timeout=self._config.close_flush_timeout)
        for state in list(self._retiring):
            state.abandon()  # its terminal did not leave in time: it never will
        task = self._heartbeat_task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _feed_id(state: SenderState) -> int:
    """The id a same-node sender writes under in the anchor's inbox."""
    channel = state.channel
    return channel.sender_id if isinstance(channel, InboxChannel) else state.sender_id
