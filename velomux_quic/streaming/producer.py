"""The producer side of the AnchorManager: senders attached to anchors, and their heartbeats.

:class:`AnchorProducer` is the half of :class:`~velomux_quic.streaming.manager.AnchorManager`
that a node's producers use. It attaches a sender to an anchor: on this node directly into
the anchor's inbox with no transport at all, on another node by the ``_anchor_attach`` /
``_mpsc_anchor_attach`` round trip, whose answer names the transport to connect on (a
refusal raised as its typed :class:`~velomux_quic.streaming.errors.AttachError`). It keeps
the node's live senders, forgets one when it hands over its terminal, applies the
consumer's ``_stream_cancel`` and ``_stream_stop`` (only from the node the sender is
attached to), and sends every remote sender's heartbeats from one task.

:mod:`.manager` keeps the rest: the transports and their negotiation, and the consumer side
(the anchors, the attach handlers that answer the requests sent from here, the watchdogs,
and the cancels and stops sent to a remote producer), with the zero-RTT pre-bind and open
handed to :mod:`.zero_rtt`. The two are separate because they change for different reasons
(what a producer does with an anchor it writes to against what a consumer does with the
anchors it owns and the senders it watches), and each stays small enough to read whole.

They are one class at runtime: ``AnchorManager`` inherits this mixin, so a method here
reaching the manager's state, or the manager's reaching these, costs exactly what it did
in a single class, with no other object to load and no forwarding call. This class
declares, for the type checker, the state the manager's constructor sets and the methods
of the manager it calls. A :class:`~velomux_quic.streaming.sender.SenderState` names the
:class:`~velomux_quic.streaming.manager.AnchorManager` these methods are mixed into, which
the type checker cannot see from here: hence the ``type: ignore`` where one is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

from ..ids import InstanceId, StreamAnchorHandle, WorkerId, worker_id_of
from ..messenger import CallError, Context, Messenger
from .anchor import AnchorEntry
from .channels import InboxChannel
from .config import StreamingConfig
from .control import (
    AnchorAttachOk,
    AnchorAttachRequest,
    AnchorAttachResponse,
    ControlDecodeError,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    MpscAnchorAttachResponse,
    StreamControl,
)
from .errors import (
    AlreadyAttached,
    AnchorNotFound,
    AttachError,
    AttachRefused,
    MaxSendersReached,
    WrongHandleKind,
)
from .frames import HEARTBEAT
from .metrics import StreamingMetrics
from .sender import SenderState, StreamSender
from .transports import AttachTerms, StreamTransport, TransportRegistry

if TYPE_CHECKING:
    from .zero_rtt import ZeroRtt

__all__ = ["AnchorProducer"]

_ERRORS: dict[str, type[AttachError]] = {
    "anchor_not_found": AnchorNotFound,
    "already_attached": AlreadyAttached,
    "max_senders_reached": MaxSendersReached,
    "wrong_handle_kind": WrongHandleKind,
}
"""The attach refusal's code (the reason up to its first colon) to the error it raises."""


class AnchorProducer:
    """The producer methods of :class:`~velomux_quic.streaming.manager.AnchorManager`."""

    # Set by AnchorManager.__init__; declared here because the producer side uses them.
    messenger: Messenger
    config: StreamingConfig
    worker_id: WorkerId
    metrics: StreamingMetrics
    transports: TransportRegistry
    _loop: asyncio.AbstractEventLoop
    _anchors: dict[int, AnchorEntry]
    _senders: dict[int, SenderState]
    _next_sender_stream: int
    _heartbeat_task: asyncio.Task[None] | None
    _heartbeat_wake: asyncio.Event
    _closed: bool
    _zero_rtt: ZeroRtt

    if TYPE_CHECKING:
        # Defined by AnchorManager; declared here because the producer side calls them.

        def _mux(self) -> Any: ...

        @property
        def transport_keys(self) -> list[str]: ...

    # -- producer: attach ----------------------------------------------------------------

    async def attach_anchor(
        self,
        handle: StreamAnchorHandle,
        *,
        key: int | None = None,
        offer: list[str] | None = None,
    ) -> StreamSender:
        """Attach a producer to a single-sender anchor, on this node or another.

        ``key`` (a u64) asks the receiver to put the stream on lane ``splitmix64(key) %
        lanes``, so streams with one key share a lane; without it the receiver picks the
        lane with the least load from this node. ``offer`` overrides the transport keys
        advertised (compatibility testing only).
        """
        return await self._attach_sender(handle, mpsc=False, offer=offer, lane_key=key)

    async def attach_mpsc_anchor(
        self,
        handle: StreamAnchorHandle,
        *,
        key: int | None = None,
        offer: list[str] | None = None,
    ) -> StreamSender:
        return await self._attach_sender(handle, mpsc=True, offer=offer, lane_key=key)

    async def _attach_sender(
        self,
        handle: StreamAnchorHandle,
        *,
        mpsc: bool,
        offer: list[str] | None,
        lane_key: int | None = None,
    ) -> StreamSender:
        if handle.is_mpsc != mpsc:
            raise WrongHandleKind(
                f"{handle} is {'an MPSC' if handle.is_mpsc else 'a single-sender'} handle", handle
            )
        if handle.worker_id == self.worker_id:
            return self._attach_local(handle, mpsc)
        peer = self._peer_of(handle.worker_id)
        if peer is None:
            raise AttachRefused(f"no known node has WorkerId {handle.worker_id:#x}", handle)
        sender_stream_id = self._next_sender_stream
        self._next_sender_stream += 1
        request_type = MpscAnchorAttachRequest if mpsc else AnchorAttachRequest
        request = request_type(
            handle=handle,
            session_id=int.from_bytes(os.urandom(8), "big"),
            stream_cancel_handle=(self.worker_id, sender_stream_id),
            supported_transport_keys=sorted(self.transport_keys if offer is None else offer),
            lane_key=lane_key,
        )
        started = time.monotonic()
        try:
            raw = await self.messenger.unary(
                peer,
                "_mpsc_anchor_attach" if mpsc else "_anchor_attach",
                request.encode(),
                timeout=self.config.attach_timeout,
            )
            response = (MpscAnchorAttachResponse if mpsc else AnchorAttachResponse).decode(raw)
        except (CallError, ControlDecodeError) as exc:
            self.metrics.attach_rtt.labels("error", "none").observe(time.monotonic() - started)
            raise AttachRefused(f"attach to {handle} failed: {exc}", handle) from exc
        if not isinstance(response, (AnchorAttachOk, MpscAnchorAttachOk)):
            self.metrics.attach_rtt.labels("error", "none").observe(time.monotonic() - started)
            reason = getattr(response, "reason", "unexpected answer")
            code = reason.partition(":")[0]
            raise _ERRORS.get(code, AttachRefused)(reason, handle)
        key = response.streaming_transport_key
        self.metrics.attach_rtt.labels("success", key).observe(time.monotonic() - started)
        transport = self.transports.get(key)
        if transport is None:
            raise AttachRefused(f"the receiver chose {key!r}, which this node cannot connect on")
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

    async def _connect(
        self, transport: StreamTransport, terms: AttachTerms, sender_stream_id: int
    ) -> StreamSender:
        channel = await transport.connect(terms)
        state = SenderState(
            self,  # type: ignore[arg-type]  # an AnchorManager at runtime
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
        self._start_heartbeats()
        return StreamSender(state)

    # -- producer: a same-node attach, and a sender's end --------------------------------

    def _attach_local(self, handle: StreamAnchorHandle, mpsc: bool) -> StreamSender:
        entry = self._anchors.get(handle.local_id)
        if entry is None or entry.finished:
            raise AnchorNotFound(f"no anchor {handle} on this node", handle)
        prebound = entry.prebind
        if prebound is not None:
            mux = self._mux()
            if mux is not None and mux.claimed(entry, prebound):
                raise AlreadyAttached(f"{handle}'s pre-bind was claimed by a ticket", handle)
            # A same-worker sender writes into the anchor directly and never claims the slot.
            self._zero_rtt.release(entry, prebound)
        if not mpsc and entry.attached:
            raise AlreadyAttached(f"{handle} has a live sender", handle)
        if mpsc and entry.max_senders is not None and entry.sender_count >= entry.max_senders:
            raise MaxSendersReached(f"{handle} allows {entry.max_senders} senders", handle)
        sender_id = entry.next_sender_id
        entry.next_sender_id += 1
        entry.local_senders.add(sender_id)
        entry.attached = True
        if entry.unattached_timer is not None:
            entry.unattached_timer.cancel()
            entry.unattached_timer = None
        sender_stream_id = self._next_sender_stream
        self._next_sender_stream += 1
        state = SenderState(
            self,  # type: ignore[arg-type]  # an AnchorManager at runtime
            handle,
            InboxChannel(entry.inbox, sender_id),
            sender_stream_id=sender_stream_id,
            transport_key=None,
            target=None,
            heartbeat_interval=None,
            sender_id=sender_id if mpsc else 0,
        )
        self._senders[sender_stream_id] = state
        return StreamSender(state)

    def _peer_of(self, worker_id: WorkerId) -> InstanceId | None:
        known = self.messenger.peers.by_worker(worker_id)
        if known is not None:
            return known
        for peer in self.messenger.transport.known_peers():
            if worker_id_of(peer) == worker_id:
                return peer
        return None

    def sender_finished(self, state: SenderState) -> None:
        """A sender handed over its terminal (or was cancelled): no more heartbeats."""
        self._senders.pop(state.sender_stream_id, None)
        if state.target is None:
            entry = self._anchors.get(state.handle.local_id)
            if entry is not None and not entry.mpsc:
                # Same-worker: the sentinel is in the channel now; a re-attach may follow.
                entry.attached = False

    # -- producer: control from the consumer ---------------------------------------------

    def _cancel_handler(self, ctx: Context) -> None:
        state = self._own_sender(ctx)
        if state is not None:
            state.cancel()

    def _stop_handler(self, ctx: Context) -> None:
        state = self._own_sender(ctx)
        if state is not None:
            state.stop_requested.set()

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

    # -- producer: heartbeats (one task for every remote sender) -------------------------

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
                if state.next_heartbeat <= now:
                    if state.channel.try_send(HEARTBEAT):
                        self.metrics.heartbeats_sent += 1
                    else:  # a full channel drops the heartbeat: saturation shows as silence
                        self.metrics.heartbeats_dropped += 1
                    state.next_heartbeat = now + interval
                if next_due is None or state.next_heartbeat < next_due:
                    next_due = state.next_heartbeat
            if next_due is None:
                return  # nobody to heartbeat: the task ends, the next attach restarts it
            with contextlib.suppress(TimeoutError):  # the next heartbeat is due
                await asyncio.wait_for(self._heartbeat_wake.wait(), max(0.001, next_due - now))
