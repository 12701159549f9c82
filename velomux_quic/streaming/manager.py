"""AnchorManager: a node's anchors and senders, the attach protocol, heartbeats, watchdogs.

Consumer side (this class): it creates anchors, answers ``_anchor_attach`` /
``_mpsc_anchor_attach`` (negotiating the transport), binds the streams that arrive to
their anchors, runs one watchdog timer per remote sender, and sends the consumer's
cancels and stops to remote producers. It owns the transports and their negotiation.

Producer side (:class:`~velomux_quic.streaming.producer.AnchorProducer`, owned here): it
attaches this node's senders to anchors, here or on another node, keeps them, and sends
their heartbeats. The manager hands it the two calls a same-node attach needs
(:class:`~velomux_quic.streaming.producer.LocalAnchors`) and forwards the public attach
calls to it.

Zero-RTT pre-binds (:class:`~velomux_quic.streaming.zero_rtt.ZeroRtt`, owned here) reach
the anchors through :class:`~velomux_quic.streaming.zero_rtt.PrebindHost`, five calls of
this class; the ticket's open is the producer's.

Anchors and senders call back only through the Protocols their modules define
(:class:`~velomux_quic.streaming.anchor.AnchorOwner`,
:class:`~velomux_quic.streaming.sender.SenderOwner`), so no module below imports this one.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from functools import partial
from typing import Any, Protocol

from ..errors import (
    AlreadyAttached,
    AnchorNotFound,
    ConfigurationError,
    ControlDecodeError,
    MaxSendersReached,
    UsageError,
)
from ..eventlog import EventThrottle, log_event
from ..ids import InstanceId, StreamAnchorHandle, WorkerId, worker_id_of
from ..messenger import Context, Messenger
from ..transport import CONTROL_LANE
from .anchor import AnchorEntry, MpscAnchor, RemoteSender, StreamAnchor
from .config import StreamingConfig
from .control import (
    ATTACH_HANDLER,
    CANCEL_HANDLER,
    MESSENGER_MUX_KEY,
    MPSC_ATTACH_HANDLER,
    PER_STREAM_KEY,
    STOP_HANDLER,
    AnchorAttachErr,
    AnchorAttachOk,
    AnchorAttachRequest,
    MpscAnchorAttachOk,
    MpscAnchorAttachRequest,
    StreamControl,
    StreamOpenTicket,
)
from .frames import DROPPED
from .inbox import Inbox
from .metrics import StreamingMetrics
from .perstream import PerStreamTransport
from .producer import AnchorProducer
from .sender import StreamSender
from .snapshot import AnchorSnapshot, BoundSenderSnapshot, StreamingSnapshot
from .transports import BindTerms, PrebindTransport, StreamTransport, TransportRegistry
from .watchdog import DETECTION_MULTIPLIER, WatchdogClock, check, deadline_windows
from .zero_rtt import ZeroRtt

__all__ = ["DETECTION_MULTIPLIER", "AnchorManager", "StreamObserver", "StreamingConfig"]

logger = logging.getLogger(__name__)

MPSC_BIT = 1 << 63


def _checked_handle(handle: object, method: str) -> StreamAnchorHandle:
    """``handle`` itself if it is a :class:`StreamAnchorHandle`, else a typed error that
    says what a handle is and where one comes from (not an AttributeError from deep in)."""
    if isinstance(handle, StreamAnchorHandle):
        return handle
    raise ConfigurationError(
        f"{method} takes a StreamAnchorHandle, not {type(handle).__name__} {handle!r:.60}: "
        "use the consumer's anchor.handle, or rebuild one it sent you with "
        "StreamAnchorHandle(int_value) or StreamAnchorHandle.from_wire({'hi': .., 'lo': ..})"
    )


class StreamObserver(Protocol):
    """Told when a remote producer's stream is bound to one of this node's anchors and
    when the node forgets it, with how it ended (``finished``, ``cancelled``,
    ``detached``, ``dropped``, ``released``): the consumer's side of a stream's life, for
    tracing. Called at attach and at a stream's end, never per record."""

    def bound(self, handle: StreamAnchorHandle, peer: InstanceId | None, transport: str) -> Any:
        """A stream was bound (``peer`` None: a pre-bind); what to keep for it."""

    def ended(self, observed: Any, outcome: str) -> None:
        """The stream ``bound`` returned ``observed`` for is over."""


class AnchorManager:
    """One per node: its anchors, the attach protocol, and (through the producer it owns)
    its senders. See the module docstring."""

    observer: StreamObserver | None = None
    """Told of every remote stream's bind and end (the node sets it when tracing)."""

    def __init__(
        self,
        messenger: Messenger,
        config: StreamingConfig | None = None,
        *,
        per_stream: bool = True,
    ) -> None:
        self.messenger = messenger
        self.config = config or StreamingConfig()
        self.worker_id: WorkerId = worker_id_of(messenger.instance_id)
        self._metrics = StreamingMetrics(messenger.registry, lambda: len(self._anchors))
        self._loop = asyncio.get_running_loop()
        self._anchors: dict[int, AnchorEntry] = {}
        self._ending: list[AnchorEntry] = []
        """Anchors whose readers took their end this turn, forgotten in the next."""
        self._refusal_lines = EventThrottle()
        self._next_session = int.from_bytes(os.urandom(4), "big") << 16 | 1
        self._attaches_served = 0
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self.transports = TransportRegistry(default_key=PER_STREAM_KEY)
        self._zero_rtt = ZeroRtt(self)
        self._producer = AnchorProducer(
            messenger, self.config, self._metrics, self.transports, self
        )
        messenger.register_system(ATTACH_HANDLER, partial(self._attach_handler, mpsc=False))
        messenger.register_system(MPSC_ATTACH_HANDLER, partial(self._attach_handler, mpsc=True))
        self._per_stream: PerStreamTransport | None = None
        if per_stream:  # a mux-only node installs no per-stream listener
            self._per_stream = PerStreamTransport(messenger, self.config, self._metrics)
            self.transports.install(self._per_stream)
            messenger.set_stream_acceptor(self._per_stream)

    @property
    def metrics(self) -> StreamingMetrics:
        """The node's ``velo_streaming_*`` metrics."""
        return self._metrics

    # -- transports ----------------------------------------------------------------------

    def install_transport(self, transport: StreamTransport) -> None:
        """Add a streaming transport (the node installs the mux here when it is enabled)."""
        self.transports.install(transport)
        if isinstance(transport, PrebindTransport):  # the mux: pre-binds, its accept window
            transport.on_bind_expired = self._zero_rtt.bind_expired
            self._zero_rtt.mux = transport

    @property
    def transport_keys(self) -> list[str]:
        """Keys this node can connect and bind on, sorted (what an attach advertises)."""
        return self.transports.keys()

    def _negotiate(self, offered: list[str]) -> str | None:
        """The chapter's rule: the mux only when both sides name it, else the per-stream
        default if offered; an empty offer (a sender from before negotiation) gets the
        default; nothing in common is refused."""
        default = self.transports.default_key
        installed = self.transports.keys()
        if not offered:
            return default if default in installed else None
        if MESSENGER_MUX_KEY in offered and MESSENGER_MUX_KEY in installed:
            return MESSENGER_MUX_KEY
        if default in offered and default in installed:
            return default
        return None

    # -- consumer: anchors ---------------------------------------------------------------

    def create_anchor(self, *, unattached_timeout: float | None = None) -> StreamAnchor[Any]:
        """A new single-sender anchor; send its ``handle`` to the producer.

        ``unattached_timeout`` (seconds) ends the stream if no sender is attached for that
        long (from now, and again after each detach); None waits forever.
        """
        entry = self._new_entry(mpsc=False, unattached_timeout=unattached_timeout)
        return StreamAnchor(self, entry)

    def create_mpsc_anchor(
        self,
        *,
        max_senders: int | None = None,
        unattached_timeout: float | None = None,
        channel_capacity: int | None = None,
    ) -> MpscAnchor:
        """A new anchor many producers write into at once.

        ``max_senders`` caps the live senders (None: no cap); ``unattached_timeout`` ends
        the stream once no sender was attached for that long; ``channel_capacity`` sizes
        its own channel in records (default ``StreamingConfig.anchor_capacity``).
        """
        entry = self._new_entry(
            mpsc=True,
            unattached_timeout=unattached_timeout,
            max_senders=max_senders,
            capacity=channel_capacity,
        )
        return MpscAnchor(self, entry)

    def _new_entry(
        self,
        *,
        mpsc: bool,
        unattached_timeout: float | None,
        max_senders: int | None = None,
        capacity: int | None = None,
    ) -> AnchorEntry:
        if self._closed:
            raise UsageError("the node is closed: anchors are created on a running node")
        while True:
            local_id = int.from_bytes(os.urandom(8), "big") & (MPSC_BIT - 1)
            if mpsc:
                local_id |= MPSC_BIT
            if local_id & (MPSC_BIT - 1) and local_id not in self._anchors:
                break
        entry = AnchorEntry(
            local_id=local_id,
            handle=StreamAnchorHandle.pack(self.worker_id, local_id),
            mpsc=mpsc,
            inbox=Inbox(capacity or self.config.anchor_capacity, ordered=not mpsc),
            heartbeat_interval=self.config.heartbeat_interval,
            max_senders=max_senders,
            unattached_timeout=unattached_timeout,
        )
        self._anchors[local_id] = entry
        self._arm_unattached(entry)
        return entry

    def _arm_unattached(self, entry: AnchorEntry) -> None:
        if entry.unattached_timeout is not None and entry.unattached_timer is None:
            entry.unattached_timer = self._loop.call_later(
                entry.unattached_timeout, self._unattached_expired, entry.local_id
            )

    def _unattached_expired(self, local_id: int) -> None:
        entry = self._anchors.get(local_id)
        if entry is not None and entry.sender_count == 0:
            entry.unattached_timer = None
            self.finish_anchor(local_id)

    def finish_anchor(self, local_id: int) -> None:
        """The stream is over (removed, or its end read): forget it, stop its watchdogs."""
        entry = self._anchors.pop(local_id, None)
        if entry is not None:
            entry.finished = True
            self._forget_anchor(entry)

    def reader_ended(self, local_id: int) -> None:
        """The reader took the stream's end: forget the anchor now, and do the rest of
        :meth:`finish_anchor` once the readers already woken in this turn have run. One
        batch may end hundreds of streams (a decode loop's last pass); each reader ends
        its anchor in the step that took its last record, so done at once, every end
        would delay the last records of the readers behind it."""
        entry = self._anchors.pop(local_id, None)
        if entry is None:
            return
        entry.finished = True
        ending = self._ending
        ending.append(entry)
        if len(ending) == 1:
            self._loop.call_soon(self._forget_ended)

    def _forget_ended(self) -> None:
        ending, self._ending = self._ending, []
        for entry in ending:
            self._forget_anchor(entry)

    def _forget_anchor(self, entry: AnchorEntry) -> None:
        if entry.unattached_timer is not None:
            entry.unattached_timer.cancel()
        outcome = "cancelled" if entry.cancelled else "finished"
        for sender in entry.senders.values():
            self._forget_sender(entry, sender, outcome)
        entry.inbox.close()

    def cancel_anchor(self, local_id: int) -> None:
        """Remove the anchor and tell every producer (remote ones by message); idempotent."""
        entry = self._anchors.get(local_id)
        if entry is None:
            return
        entry.cancelled = True
        remote = list(entry.senders.values())
        local = set(entry.local_senders)
        mux = self._zero_rtt.mux
        for sender in remote:  # a claimed ticket sender learns of it through the mux
            if mux is not None and not sender.sender_stream_id:
                mux.post_stream_lifecycle(entry, sender, stop=False)
        self.finish_anchor(local_id)
        for sender in remote:
            if sender.node is not None and sender.sender_stream_id:
                self._notify(sender.node, CANCEL_HANDLER, sender.sender_stream_id)
        self._producer.cancel_local_senders(local_id, local)
        self._metrics.anchor_operation("cancel", "success", "local").inc()

    def request_stop(self, local_id: int) -> None:
        """Ask every producer of the anchor to finish gracefully."""
        entry = self._anchors.get(local_id)
        if entry is None:
            return
        mux = self._zero_rtt.mux
        for sender in entry.senders.values():
            if sender.node is not None and sender.sender_stream_id:
                self._notify(sender.node, STOP_HANDLER, sender.sender_stream_id)
            elif mux is not None and not sender.sender_stream_id:
                mux.post_stream_lifecycle(entry, sender, stop=True)
        self._producer.stop_local_senders(local_id)

    def anchor_dropped(self, local_id: int) -> None:
        """An anchor object was garbage-collected: cancel it (possibly from another thread)."""
        if self._closed or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(self.cancel_anchor, local_id)

    def sender_detached(self, local_id: int, sender_id: int) -> None:
        """The consumer read a sender's Detached (or an MPSC sender's terminal)."""
        entry = self._anchors.get(local_id)
        if entry is None:
            return
        remote = entry.senders.pop(sender_id, None)
        if remote is not None:
            self._forget_sender(entry, remote, "detached")
        entry.local_senders.discard(sender_id)
        entry.inbox.withdraw_feed(sender_id)
        if not entry.mpsc and not entry.senders and not entry.local_senders:
            entry.attached = False
        if entry.sender_count == 0:
            self._arm_unattached(entry)

    def _forget_sender(self, entry: AnchorEntry, remote: RemoteSender, outcome: str) -> None:
        if remote.observed is not None and self.observer is not None:
            self.observer.ended(remote.observed, outcome)
            remote.observed = None
        if entry.prebind is remote:
            entry.prebind = None
        if remote.watchdog is not None:
            remote.watchdog.cancel()
            remote.watchdog = None
        transport = self.transports.get(remote.transport_key)
        if transport is not None:
            transport.unbind(entry, remote)

    def feed_exhausted(self, entry: AnchorEntry, sender_id: int | None) -> bool:
        """A feed ran dry for good without a terminal: its producer is gone, say Dropped.

        Called each time the reader finds nothing to read, so the common answer (no feed
        is exhausted) allocates nothing."""
        inbox = entry.inbox
        if not inbox.any_feed_exhausted():
            return False
        for feed_id, feed in inbox.feeds():
            if feed.exhausted:
                inbox.withdraw_feed(feed_id)
                inbox.inject(DROPPED, feed_id)
        return True

    # -- consumer: what the pre-bind uses (PrebindHost) and a same-node attach -----------

    def local_anchor(self, handle: StreamAnchorHandle) -> AnchorEntry | None:
        """The live anchor of ``handle`` on this node, or None (another node's, gone)."""
        if handle.worker_id != self.worker_id:
            return None
        entry = self._anchors.get(handle.local_id)
        return None if entry is None or entry.finished else entry

    def bind_remote(
        self,
        entry: AnchorEntry,
        transport: StreamTransport,
        *,
        peer: InstanceId | None,
        lane_key: int | None,
    ) -> tuple[RemoteSender, BindTerms]:
        """Register a remote sender of ``entry`` with a fresh routing session (``peer``
        None: a pre-bind, whose sender is not known yet), bind it on ``transport`` and arm
        its watchdog."""
        session_id = self._next_session
        self._next_session += 1
        sender_id = entry.next_sender_id
        entry.next_sender_id += 1
        remote = RemoteSender(
            node=peer,
            sender_stream_id=0,
            session_id=session_id,
            transport_key=transport.key,
            sender_id=sender_id,
            last_arrival=self._loop.time(),
            lane_key=lane_key,
            prebound=peer is None,
        )
        if self.observer is not None:
            remote.observed = self.observer.bound(entry.handle, peer, transport.key)
        entry.senders[sender_id] = remote
        if peer is not None:
            entry.attached = True
        if entry.unattached_timer is not None:
            entry.unattached_timer.cancel()
            entry.unattached_timer = None
        terms = transport.bind(entry, remote)
        self._arm_watchdog(entry, remote, entry.heartbeat_interval)
        return remote, terms

    def end_remote(self, entry: AnchorEntry, remote: RemoteSender, *, dropped: bool) -> None:
        """Forget a remote sender (its bind, watchdog and feed). ``dropped``: the reader
        reads Dropped next; otherwise the anchor may be attached again."""
        entry.senders.pop(remote.sender_id, None)
        self._forget_sender(entry, remote, "dropped" if dropped else "released")
        entry.inbox.withdraw_feed(remote.sender_id)
        log_event(
            logger,
            logging.DEBUG,
            "stream_sender_ended",
            peer=remote.node,
            local_id=f"{entry.local_id:x}",
            dropped=dropped,
        )
        if dropped:
            entry.inbox.inject(DROPPED, remote.sender_id)
        elif entry.sender_count == 0:
            entry.attached = False
            self._arm_unattached(entry)

    def attach_local(self, handle: StreamAnchorHandle, *, mpsc: bool) -> tuple[Inbox, int]:
        """Register a same-node sender on the anchor (its inbox, the sender's feed id)."""
        entry = self.local_anchor(handle)
        if entry is None:
            raise AnchorNotFound(
                f"no anchor {handle} on this node (finished, cancelled or never created)",
                handle,
            )
        prebound = entry.prebind
        if prebound is not None:
            if self._zero_rtt.claimed(entry, prebound):
                raise AlreadyAttached(f"{handle}'s pre-bind was claimed by a ticket", handle)
            # A same-worker sender writes into the anchor directly and never claims the slot.
            self._zero_rtt.release(entry, prebound)
        if not mpsc and entry.attached:
            raise AlreadyAttached(
                f"{handle} has a live sender: a single-sender anchor takes one at a time "
                "(detach it first, or use an MPSC anchor)",
                handle,
            )
        if mpsc and entry.max_senders is not None and entry.sender_count >= entry.max_senders:
            raise MaxSendersReached(f"{handle} allows {entry.max_senders} senders", handle)
        sender_id = entry.next_sender_id
        entry.next_sender_id += 1
        entry.local_senders.add(sender_id)
        entry.attached = True
        if entry.unattached_timer is not None:
            entry.unattached_timer.cancel()
            entry.unattached_timer = None
        return entry.inbox, sender_id

    def local_sender_finished(self, handle: StreamAnchorHandle) -> None:
        """A same-node sender handed over its terminal: a single-sender anchor is free."""
        entry = self._anchors.get(handle.local_id)
        if entry is not None and not entry.mpsc:
            entry.attached = False

    # -- consumer: the attach handlers ---------------------------------------------------

    def _attach_handler(self, ctx: Context, *, mpsc: bool) -> bytes:
        """``_anchor_attach`` and ``_mpsc_anchor_attach`` (an Err is the same for both)."""
        started = time.monotonic()
        self._attaches_served += 1
        request_type = MpscAnchorAttachRequest if mpsc else AnchorAttachRequest
        try:
            request = request_type.decode(ctx.payload)
        except ControlDecodeError as exc:
            self._log_attach_refused(ctx.sender, None, f"malformed: {exc}")
            return AnchorAttachErr(f"malformed: {exc}").encode()
        answer = self._attach(ctx.sender, request, mpsc=mpsc)
        self._count_attach(answer, started)
        if isinstance(answer, str):
            self._log_attach_refused(ctx.sender, request.handle, answer)
            return AnchorAttachErr(answer).encode()
        log_event(
            logger,
            logging.DEBUG,
            "stream_attached",
            peer=ctx.sender,
            handle=str(request.handle),
            mpsc=mpsc,
        )
        return answer.encode()

    def _log_attach_refused(
        self, peer: InstanceId, handle: StreamAnchorHandle | None, reason: str
    ) -> None:
        """INFO, at most once a second per peer: a peer can repeat a refused attach."""
        suppressed = self._refusal_lines.allow(peer)
        if suppressed is None:
            return
        fields: dict[str, object] = {"peer": peer, "reason": reason}
        if handle is not None:
            fields["handle"] = str(handle)
        if suppressed:
            fields["suppressed"] = suppressed
        log_event(logger, logging.INFO, "attach_refused", **fields)

    def _count_attach(self, answer: object, started: float) -> None:
        ok = not isinstance(answer, str)
        scheme = getattr(answer, "streaming_transport_key", "none")
        outcome = "success" if ok else "error"
        self._metrics.anchor_operation("attach", outcome, scheme).inc()
        self._metrics.anchor_operation_time("attach", outcome, scheme).observe(
            time.monotonic() - started
        )

    def _attach(
        self,
        peer: InstanceId,
        request: AnchorAttachRequest | MpscAnchorAttachRequest,
        *,
        mpsc: bool,
    ) -> AnchorAttachOk | MpscAnchorAttachOk | str:
        """The Ok answer, or the refusal reason (``code: words``)."""
        handle = request.handle
        entry = self.local_anchor(handle)
        if entry is None:
            return f"anchor_not_found: no anchor {handle} on this node"
        if entry.mpsc != mpsc:
            return f"wrong_handle_kind: {handle} is {'MPSC' if entry.mpsc else 'SPSC'}"
        prebound = entry.prebind
        if prebound is not None:
            adopted = self._zero_rtt.adopt(peer, entry, prebound, request)
            if isinstance(adopted, str):
                return adopted
            return self._attach_ok(entry, prebound, adopted, mpsc=mpsc)
        if request.replaces_session_id:
            self._release_unanswered(entry, peer, request.replaces_session_id)
        if not mpsc and entry.attached:
            return f"already_attached: {handle} has a live sender"
        if mpsc and entry.max_senders is not None and entry.sender_count >= entry.max_senders:
            return f"max_senders_reached: {handle} allows {entry.max_senders}"
        key = self._negotiate(list(request.supported_transport_keys))
        if key is None:
            return (
                f"no_common_transport: offered {list(request.supported_transport_keys)}, "
                f"this node binds {self.transport_keys}"
            )
        transport = self.transports.get(key)
        assert transport is not None
        remote, terms = self.bind_remote(entry, transport, peer=peer, lane_key=request.lane_key)
        remote.sender_stream_id = request.stream_cancel_handle[1]
        remote.attach_session_id = request.session_id
        return self._attach_ok(entry, remote, terms, mpsc=mpsc)

    def _release_unanswered(self, entry: AnchorEntry, peer: InstanceId, session_id: int) -> None:
        """A sender retries an attach whose answer it never got: release the bind that
        attach made (if it arrived at all), so the retry is not refused for it.

        Only the bind of exactly that request from exactly that node is released: its
        producer gave up on the answer, so nothing was ever sent on it."""
        for remote in list(entry.senders.values()):
            if remote.node == peer and remote.attach_session_id == session_id:
                logger.info(
                    "attach retried by %s: releasing the bind of its unanswered attach to %s",
                    peer,
                    entry.handle,
                )
                self._metrics.attach_binds_replaced += 1
                self.end_remote(entry, remote, dropped=False)

    def _attach_ok(
        self, entry: AnchorEntry, remote: RemoteSender, terms: BindTerms, *, mpsc: bool
    ) -> AnchorAttachOk | MpscAnchorAttachOk:
        interval_ms = int(entry.heartbeat_interval * 1000)
        key = remote.transport_key
        session_id = remote.session_id
        if mpsc:
            return MpscAnchorAttachOk(
                streaming_transport_key=key,
                heartbeat_interval_ms=interval_ms,
                sender_id=remote.sender_id,
                routing_session_id=session_id,
                initial_credit=terms.initial_credit,
                slot_byte_budget=terms.slot_byte_budget,
                lane=terms.lane,
            )
        return AnchorAttachOk(
            streaming_transport_key=key,
            heartbeat_interval_ms=interval_ms,
            routing_session_id=session_id,
            initial_credit=terms.initial_credit,
            slot_byte_budget=terms.slot_byte_budget,
            lane=terms.lane,
        )

    # -- consumer: watchdogs -------------------------------------------------------------

    def _arm_watchdog(self, entry: AnchorEntry, remote: RemoteSender, at: float) -> None:
        if remote.watchdog_clock is None:
            remote.watchdog_clock = WatchdogClock(reference=self._loop.time())
        remote.watchdog = self._loop.call_later(at, self._watchdog, entry.local_id, remote)

    def _watchdog(self, local_id: int, remote: RemoteSender) -> None:
        entry = self._anchors.get(local_id)
        if entry is None or entry.senders.get(remote.sender_id) is not remote:
            return
        self._metrics.heartbeat_watchdog_checks += 1
        window = entry.heartbeat_interval
        last, exempt = remote.probe() if remote.probe is not None else (remote.last_arrival, False)
        clock = remote.watchdog_clock
        assert clock is not None  # armed with one
        delay = check(clock, now=self._loop.time(), last_arrival=last, exempt=exempt, window=window)
        if delay is not None:
            self._arm_watchdog(entry, remote, delay)
            return
        remote.watchdog = None
        if not entry.mpsc:
            self._metrics.heartbeat_watchdog_firings += 1
            logger.info(
                "stream_watchdog: no frame from %s for %.1f windows of %.3f s; local_id=%x",
                remote.node,
                deadline_windows(),
                window,
                local_id,
            )
        self.end_remote(entry, remote, dropped=True)
        if remote.node is not None and remote.sender_stream_id:
            self._notify(remote.node, CANCEL_HANDLER, remote.sender_stream_id)

    # -- consumer: cancel and stop sent to a remote producer -----------------------------

    def _notify(self, node: InstanceId, handler: str, sender_stream_id: int) -> None:
        async def send() -> None:
            try:
                await self.messenger.am_send(
                    node, handler, StreamControl(sender_stream_id).encode(), lane=CONTROL_LANE
                )
            except Exception as exc:  # the producer's node may be gone: nothing to tell
                logger.debug("could not send %s to %s: %r", handler, node, exc)

        if not self._closed:
            task = self._loop.create_task(send())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- zero-RTT: pre-bind (consumer) and open (producer) -------------------------------

    def prebind_anchor(
        self, handle: StreamAnchorHandle, *, key: int | None = None
    ) -> StreamOpenTicket:
        """Bind the anchor's mux slot now and return the ticket a producer opens it with
        (:meth:`open_anchor_stream`), saving the attach round trip.

        Raises :class:`~velomux_quic.errors.TicketError` saying why and what to do: no
        mux on this node, an MPSC anchor, another node's handle, an anchor already
        attached or pre-bound, or one that is gone. ``key`` places the stream as in
        :meth:`attach_anchor`.
        """
        return self._zero_rtt.prebind(_checked_handle(handle, "prebind_anchor"), key=key)

    async def open_anchor_stream(
        self, handle: StreamAnchorHandle, ticket: StreamOpenTicket
    ) -> StreamSender:
        """Producer side of a ticket: open the stream with no attach message.

        A ticket opens one stream: opening it again raises
        :class:`~velomux_quic.errors.TicketError`.
        """
        handle = _checked_handle(handle, "open_anchor_stream")
        if not isinstance(ticket, StreamOpenTicket):
            raise ConfigurationError(
                f"open_anchor_stream takes the StreamOpenTicket the consumer's prebind_anchor "
                f"returned (StreamOpenTicket.decode(its bytes)), not {type(ticket).__name__}"
            )
        return await self._producer.open_with_ticket(handle, ticket)

    # -- producer: attach (see producer.py) ----------------------------------------------

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
        advertised (compatibility testing only). A refusal raises its
        :class:`~velomux_quic.errors.AttachError` subclass.
        """
        handle = _checked_handle(handle, "attach_anchor")
        return await self._producer.attach(handle, mpsc=False, key=key, offer=offer)

    async def attach_mpsc_anchor(
        self,
        handle: StreamAnchorHandle,
        *,
        key: int | None = None,
        offer: list[str] | None = None,
    ) -> StreamSender:
        """Attach one more producer to an MPSC anchor; ``key`` and ``offer`` as in
        :meth:`attach_anchor`. The sender's ``sender_id`` tags its records."""
        handle = _checked_handle(handle, "attach_mpsc_anchor")
        return await self._producer.attach(handle, mpsc=True, key=key, offer=offer)

    # -- introspection -------------------------------------------------------------------

    def snapshot(self) -> StreamingSnapshot:
        """A copy of this node's streaming state now (see :mod:`.snapshot`)."""
        anchors: list[AnchorSnapshot] = []
        bound: list[BoundSenderSnapshot] = []
        for entry in self._anchors.values():
            anchors.append(
                AnchorSnapshot(
                    handle=entry.handle,
                    kind="mpsc" if entry.mpsc else "spsc",
                    attached=entry.attached,
                    senders=entry.sender_count,
                    buffered_records=len(entry.inbox),
                    prebound=entry.prebind is not None,
                    finished=entry.finished,
                    cancelled=entry.cancelled,
                )
            )
            bound.extend(
                BoundSenderSnapshot(
                    handle=entry.handle,
                    sender_id=remote.sender_id,
                    node=remote.node,
                    transport_key=remote.transport_key,
                    lane=remote.lane,
                    routing_session_id=remote.session_id,
                )
                for remote in entry.senders.values()
            )
        producer = self._producer
        return StreamingSnapshot(
            anchors=tuple(anchors),
            bound_senders=tuple(bound),
            senders=producer.sender_snapshots(),
            pending_attaches=producer.pending_attaches,
            attaches_served=self._attaches_served,
            heartbeat_task_running=producer.heartbeat_task_running,
            senders_per_transport=producer.senders_per_transport(),
            bound_per_transport=dict(Counter(remote.transport_key for remote in bound)),
            per_stream=None if self._per_stream is None else self._per_stream.snapshot(),
        )

    # -- shutdown ------------------------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for this node's senders to finish (each open one
        hands over its terminal, and every terminal leaves); True when they all did."""
        try:
            async with asyncio.timeout(timeout):
                await self._producer.wait_idle()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """End this node's streams on the wire (open ones with the shutdown terminal,
        finalized ones flushed: see ``AnchorProducer.close``), end every anchor still open
        as cancelled (its reader takes what is buffered, then StreamCancelled: a stream cut
        by its own node's shutdown must not read as complete), close the transports;
        idempotent."""
        self._closed = True
        await self._producer.close()
        self._forget_ended()  # before the transports they are bound to close
        for local_id, entry in list(self._anchors.items()):
            entry.cancelled = True
            self.finish_anchor(local_id)
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for transport in self.transports:
            await transport.close()
