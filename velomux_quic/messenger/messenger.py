"""The Messenger: active messages between nodes, on the QUIC transport.

It turns frames into calls and back: fire-and-forget messages, acknowledged messages,
unary request/response with typed remote errors and timeouts, and dispatch of each
message to the handler registered under its name, inline, ordered per (sender, lane), or
spawned (see :meth:`Messenger.register`).

Replies go back the way docs/architecture.md decides: on *this* node's own outbound connection
to the sender, on the lane the request arrived on. The sender of every message is the
InstanceId its connection's certificate proved, never something the message says.

Sending, receiving and dispatch are one concern, the active message, and live in the one
:class:`Messenger` class here. Payloads too large to travel inline are a second concern,
rendezvous, held by a collaborator (:class:`~.rendezvous.Rendezvous`) that the messenger
owns and gives only what it needs: a request stream to a peer, the delivery of a pulled
payload, the refusal of a waiting caller, its background tasks, and the metrics.

The layers built on the messenger plug in through generic hooks and the messenger knows
none of their names: reserved (``_``) handlers (:meth:`Messenger.register_system`), header
codecs for reserved headers (:meth:`Messenger.register_header`), the lane-reset and
staged-refusal hooks, and the acceptor of the transport's other streams.

The per-message paths are :meth:`Messenger.frame_received` and ``_deliver`` on the way in,
``_send`` on the way out. A message of the mux carries hundreds of records, so an
attribute load per message is nothing; still, nothing on them awaits or allocates beyond
the envelope, the :class:`Context` and, for a queued handler, its job tuple.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgpack  # type: ignore[import-untyped]
from prometheus_client.registry import CollectorRegistry

from ..discovery import PeerDiscovery, PeerRecord, PeerWatch, peer_address
from ..errors import (
    CallError,
    CallPeerNotRegistered,
    ConfigurationError,
    DialError,
    HandlerFailed,
    MessengerClosed,
    PeerGone,
    PeerNotRegistered,
    RemoteRefused,
    SendTimeout,
    TransportError,
    UnknownHandler,
    WorkerIdCollision,
)
from ..ids import InstanceId
from ..security.certs import NodeCredentials
from ..transport import (
    PeerLink,
    QuicEndpoint,
    SendAdmission,
    SendOutcome,
    StreamData,
    StreamReset,
    StreamStopped,
    TransportConfig,
    TransportHandler,
)
from .calls import PendingCalls
from .config import MessengerConfig
from .dispatch import OrderedDispatcher
from .envelope import (
    Envelope,
    ErrorCode,
    Kind,
    MalformedEnvelope,
    StagedDescriptor,
    decode_envelope,
    decode_error,
    encode_envelope,
    encode_error,
    message_prefix,
)
from .headers import RESERVED_PREFIX, HeaderCodec
from .held_replies import HeldReplies
from .metrics import MessengerMetrics
from .peers import DiscoveryFeed, PeerRegistry, sync_registry
from .registry import Context, Dispatch, Handler, HandlerRegistry, HandlerSpec
from .rendezvous import RefusalHook, Rendezvous, StagedRefusal, StagingListener
from .snapshot import MessengerSnapshot

__all__ = ["ENVELOPE_RESERVE", "Messenger", "StagedRefusal"]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
CAPABILITIES = ("rendezvous", "lanes")

HELLO_HANDLER = "_hello"
"""The system handler that answers this node's protocol version, capabilities and lanes."""

HEALTH_HANDLER = "_health"
"""The system handler that answers ``ok``: the peer's messenger, not only its QUIC stack."""

LIST_HANDLERS_HANDLER = "_list_handlers"
"""The system handler that answers every handler name this node serves."""

ENVELOPE_RESERVE = 2048
"""Bytes kept out of the eager budget for the envelope: fixed header, name, small headers."""

Job = tuple[HandlerSpec, Context, Kind, int]
"""One message for a handler: its registration, context, kind and message id."""

_RESPONSE_TYPE = {Kind.MESSAGE: "fire_and_forget", Kind.SYNC: "ack_nack", Kind.REQUEST: "unary"}
_ANSWERS = (Kind.RESPONSE, Kind.ERROR, Kind.ACK)
# The kinds read per message, bound once: a member read off its enum class runs the enum
# type's attribute hook each time on Python 3.11.
_MESSAGE = Kind.MESSAGE
_REQUEST = Kind.REQUEST
_SYNC = Kind.SYNC

REPLY_OVERHEAD = 512
"""What a reply waiting in an admission gate costs beyond its payload: the envelope and
the frame's bytes object, its SendAdmission, the hook that uncharges it (a closure and
a list) and its place in the gate's queue. Measured at about 470 bytes for an empty reply
(tests/unit/test_reply_cost.py); 128, the figure charged before, let a peer make a node
hold five times ``max_pending_reply_bytes``."""


class Messenger(TransportHandler):
    """One node's messenger. Create with :meth:`start`, close with :meth:`close`.

    Register handlers by name (:meth:`register`), then send to a peer's handlers:
    :meth:`am_send` (fire-and-forget), :meth:`am_sync` (wait until the handler ran) and
    :meth:`unary` (request and response). Failures are the :class:`CallError` subclasses
    of :mod:`velomux_quic.errors`.
    """

    def __init__(
        self,
        config: MessengerConfig,
        registry: CollectorRegistry,
        peers: PeerRegistry,
    ) -> None:
        self.config = config
        """This messenger's settings."""
        self.registry = registry
        """The Prometheus registry its metrics (and the layers above's) are in."""
        self.peers = peers
        """The peers it knows where to reach (add with :meth:`add_peer` or discovery)."""
        self.metrics = MessengerMetrics(registry)
        self._handlers = HandlerRegistry()
        self._header_codecs: dict[str, HeaderCodec[Any]] = {}
        self._call_headers: Callable[[dict[str, str] | None], dict[str, str] | None] | None = None
        self._calls = PendingCalls()
        self._rendezvous = Rendezvous(
            config,
            self.metrics,
            request=self._request_stream,
            deliver=self._deliver,
            refuse=self._refuse_caller,
            keep=self._background_task,
        )
        self._transport: QuicEndpoint | None = None
        self._dispatcher = OrderedDispatcher(
            self._run,
            max_backlog=config.max_ordered_backlog,
            pause=self._pause_lane,
            resume=self._resume_lane,
            observe_wait=lambda handler, wait: self.metrics.lane_wait_of(handler).observe(wait),
        )
        self._prefixes: dict[str, bytes] = {}
        self._lane_reset_hooks: list[Callable[[InstanceId, int], None]] = []
        self._background: set[asyncio.Future[None]] = set()
        self._closed = False
        self._discovery: PeerDiscovery | None = None
        self._unwatch: Callable[[], None] | None = None
        self._stream_acceptor: TransportHandler | None = None
        self._pending_replies: dict[InstanceId, int] = {}
        """Bytes of replies waiting in each peer's admission gates (entries go at zero)."""
        self._pending_reply_total = 0
        self._reply_drops_logged: set[InstanceId] = set()
        self._held: dict[InstanceId, HeldReplies] = {}
        """Replies to peers whose return dial is in its handshake (see held_replies)."""
        rendezvous = self._rendezvous
        self.metrics.bind_gauges(
            pending=lambda: len(self._calls),
            lanes=lambda: self._dispatcher.queues(),
            depth=lambda: self._dispatcher.depth(),
            staged_bytes=lambda: rendezvous.staged_bytes,
            staged_count=lambda: rendezvous.staged_count,
            pulls_outstanding=lambda: rendezvous.pulls_outstanding,
            pending_reply_bytes=lambda: self._pending_reply_total,
        )
        self._register_system_handlers()
        peers.subscribe(self._peer_changed)

    @classmethod
    async def start(
        cls,
        credentials: NodeCredentials,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: MessengerConfig | None = None,
        transport_config: TransportConfig | None = None,
        registry: CollectorRegistry | None = None,
        peers: PeerRegistry | None = None,
        discovery: PeerDiscovery | None = None,
        name: str = "",
        publish: bool = True,
    ) -> Messenger:
        """Start the node's transport with this messenger as its handler.

        With ``discovery``, the node publishes its own record there (unless ``publish``
        is False: a client that only looks others up), loads every record it finds, and
        looks up a peer it does not know the first time it calls it. A backend that is
        also a :class:`~velomux_quic.discovery.PeerWatch` (etcd) exports its
        metrics in ``registry`` and pushes joins, moves and leaves into the peer registry
        as they happen, through a :class:`~velomux_quic.messenger.peers.DiscoveryFeed`.
        """
        registry = registry or CollectorRegistry()
        messenger = cls(config or MessengerConfig(), registry, peers or PeerRegistry())
        messenger._transport = await QuicEndpoint.start(
            credentials,
            host=host,
            port=port,
            config=transport_config,
            handler=messenger,
            registry=registry,
        )
        for record in messenger.peers:
            messenger._transport.register_peer(record.instance_id, record.address)
        if discovery is not None:
            messenger._discovery = discovery
            try:
                if isinstance(discovery, PeerWatch):
                    discovery.bind_metrics(registry)
                if publish:
                    await discovery.publish(messenger.own_record(name))
                if isinstance(discovery, PeerWatch):
                    feed = DiscoveryFeed(
                        messenger.peers,
                        own=messenger.instance_id,
                        on_moved=messenger._peer_moved,
                    )
                    messenger._unwatch = discovery.watch(feed)
                else:
                    await sync_registry(messenger.peers, discovery)
            except BaseException:
                await messenger.close()
                raise
        return messenger

    async def __aenter__(self) -> Messenger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def transport(self) -> QuicEndpoint:
        """The node's QUIC transport; MessengerClosed before :meth:`start` set it."""
        if self._transport is None:
            raise MessengerClosed("the messenger has not been started: use Messenger.start()")
        return self._transport

    # -- identity and peers --------------------------------------------------------------

    @property
    def instance_id(self) -> InstanceId:
        """This node's InstanceId, as its certificate proves it to peers."""
        return self.transport.instance_id

    @property
    def address(self) -> tuple[str, int]:
        """Where this node listens (host, UDP port)."""
        return self.transport.address

    def own_record(self, name: str = "") -> PeerRecord:
        """This node's peer record: what a peer needs to reach it (publish it, or hand it
        to the peer's ``add_peer``)."""
        return PeerRecord(
            instance_id=self.instance_id,
            address=self.address,
            name=name,
            lanes=self.transport.config.lanes,
            updated_at=time.time(),
        )

    @property
    def discovery(self) -> PeerDiscovery | None:
        """The discovery backend the node was started with (None: static peers only)."""
        return self._discovery

    def add_peer(
        self, instance_id: InstanceId, address: tuple[str, int] | str, name: str = ""
    ) -> None:
        """Learn where a peer listens (its identity is still proven by its certificate).

        ``address`` is ``(host, port)`` or ``"host:port"``; a malformed one, or an
        ``instance_id`` that is not an :class:`InstanceId`, raises ConfigurationError.
        A known peer added at another address moved: the connection dialed to the old
        address is closed, as for a move discovery reports.
        """
        if not isinstance(instance_id, InstanceId):
            raise ConfigurationError(
                f"add_peer takes an InstanceId, got {type(instance_id).__name__} "
                f"{instance_id!r}: use InstanceId.parse(text) for a UUID in text"
            )
        if not isinstance(name, str):
            raise ConfigurationError(f"add_peer: name must be a string, got {name!r}")
        previous = self.peers.get(instance_id)
        record = PeerRecord(
            instance_id=instance_id,
            address=peer_address(address),
            name=name,
            updated_at=time.time(),
        )
        self.peers.add(record)
        if previous is not None and previous.address != record.address:
            self._peer_moved(instance_id)

    def remove_peer(self, instance_id: InstanceId) -> None:
        """Forget a peer (eviction): its address goes, and the mux ends its streams."""
        self.peers.remove(instance_id)

    async def resolve(self, peer: InstanceId) -> bool:
        """Make sure the transport knows where ``peer`` is, asking discovery if needed;
        False when nobody knows (then :meth:`add_peer` it)."""
        if self.transport.peer_address(peer) is not None:
            return True
        if self._discovery is None:
            return False
        record = await self._discovery.lookup(peer)
        if record is None:
            return False
        try:
            self.peers.add(record)
        except WorkerIdCollision:
            logger.warning("discovery returned %s, whose WorkerId another peer holds", peer)
            return False
        return True

    def _peer_changed(self, record: PeerRecord | None, instance_id: InstanceId) -> None:
        if self._transport is None:
            return
        if record is None:
            self._transport.unregister_peer(instance_id)
        else:
            self._transport.register_peer(record.instance_id, record.address)

    def _peer_moved(self, instance_id: InstanceId) -> None:
        # Discovery says the peer listens elsewhere now (it restarted there): a connection
        # to the old address leads nowhere, and the next send dials the new one.
        if self._transport is not None and not self._closed:
            self._transport.disconnect(instance_id, outbound=True, inbound=False)

    # -- handlers ------------------------------------------------------------------------

    def register(self, name: str, handler: Handler, *, dispatch: Dispatch | None = None) -> None:
        """Serve ``name``: call ``handler(ctx)`` for every message a peer sends to it.

        ``handler`` takes a :class:`Context` (the proven sender, the lane, the headers, the
        payload) and returns the response of a unary call as bytes (or None for an empty
        one); it may be a plain function or a coroutine function. If it raises, a waiting
        caller gets :class:`HandlerFailed` with the error's text.

        ``dispatch`` says how it runs:

        * ``"inline"`` (the default for a plain function): on the receive path, before
          the lane's next frame is read; cheapest, but it must never block.
        * ``"ordered"`` (the default for a coroutine function): one queue per
          (sender, lane), one message at a time, in arrival order. An awaiting handler
          therefore serialises each sender's requests: a frontend's second request
          waits for the first one's handler to return. Tried with a handler that opens
          a token stream, first-token p50 was 196-353 ms ordered against 49-78 ms with
          ``"spawn"``.
        * ``"spawn"``: each message in a task of its own, concurrently, in no order. Use
          it for a handler that awaits something long (opens a stream, calls another
          node) when the order of one sender's requests does not matter.

        Raises :class:`~velomux_quic.errors.HandlerExists` when the name is taken or
        starts with ``_`` (reserved for the library), ConfigurationError when the name is
        not 1 to 255 bytes of UTF-8 or a coroutine function is asked to run inline.
        """
        self._handlers.register(name, handler, dispatch=dispatch)

    def wrap_handler(self, name: str, wrap: Callable[[HandlerSpec], Handler]) -> None:
        """Run ``name``'s messages through ``wrap(its registration)`` from now on, with the
        same dispatch: how a layer around the messenger (tracing) instruments a handler
        another registered, system ones included. ConfigurationError when nothing is
        registered under ``name``."""
        if not self._handlers.wrap(name, wrap):
            raise ConfigurationError(f"no handler named {name!r} is registered here")

    def set_call_headers(
        self, headers: Callable[[dict[str, str] | None], dict[str, str] | None] | None
    ) -> None:
        """Give every call this messenger makes (``unary``, ``am_sync``: attaches included)
        the headers ``headers(the call's own)`` returns: how tracing puts the caller's
        trace context into the request. None stops it. Messages (``am_send``) and the
        mux's batches are not calls and never pass through it."""
        self._call_headers = headers

    def unregister(self, name: str) -> None:
        """Stop serving ``name``: messages to it are then answered UnknownHandler.

        Raises ConfigurationError when nothing is registered under ``name`` (a typo
        would otherwise go unnoticed). Messages already queued for it still run.
        """
        if not self._handlers.unregister(name):
            raise ConfigurationError(f"no handler named {name!r} is registered here")

    def register_system(
        self, name: str, handler: Handler, *, dispatch: Dispatch | None = None
    ) -> None:
        """Register a reserved (``_``-prefixed) handler: how a layer built on the messenger
        claims its names (the mux its batch handlers, streaming its attach handlers).

        As :meth:`register`, but only for reserved names; HandlerExists when another layer
        holds the name already.
        """
        if not isinstance(name, str) or not name.startswith(RESERVED_PREFIX):
            raise ConfigurationError(
                f"register_system is for reserved '_' names, got {name!r}: use register()"
            )
        self._handlers.register(name, handler, dispatch=dispatch, system=True)

    def register_header(self, codec: HeaderCodec[Any]) -> None:
        """Reserve the header ``codec.name`` for the layer that registers it.

        The messenger carries the header and never reads it; the layer writes it with
        ``codec.write(value)`` and reads it with ``codec.read(ctx.headers)`` (or from a
        :class:`StagedRefusal`). Only a registered codec's ``_`` header may be sent: any
        other raises ConfigurationError at the send, so a misspelt header fails where it
        is written. ConfigurationError too when another layer registered that header.
        """
        if codec.name in self._header_codecs:
            raise ConfigurationError(
                f"the header {codec.name!r} is registered already (by another layer?)"
            )
        self._header_codecs[codec.name] = codec

    def set_stream_acceptor(self, acceptor: TransportHandler) -> None:
        """Hand the transport's non-lane QUIC streams (the per-stream path) to ``acceptor``."""
        self._stream_acceptor = acceptor

    def add_lane_reset_hook(self, hook: Callable[[InstanceId, int], None]) -> None:
        """Be told when a peer cuts one lane's stream (the mux ends that lane's slots)."""
        self._lane_reset_hooks.append(hook)

    def add_staged_refusal_hook(self, hook: RefusalHook) -> None:
        """Be told when this node refuses a staged payload (for its size or past the pull
        bounds) or fails to pull one: the record will never arrive (the mux ends the slot)."""
        self._rendezvous.add_refusal_hook(hook)

    def add_staging_listener(self, listener: StagingListener) -> None:
        """Be told ``(reason, size)`` whenever a payload this node staged is released
        (``pulled``, ``refused``, ``expired``, ``unsent`` or ``closed``)."""
        self._rendezvous.add_staging_listener(listener)

    # -- introspection -------------------------------------------------------------------

    def snapshot(self) -> MessengerSnapshot:
        """What this messenger holds now: handlers, waiting calls, staged payloads and
        pulls, known peers. For operators and tests; not meant for a per-message path."""
        rendezvous = self._rendezvous
        return MessengerSnapshot(
            handlers=tuple(self._handlers.names()),
            reserved_headers=tuple(sorted(self._header_codecs)),
            pending_calls=len(self._calls),
            ordered_queues=self._dispatcher.queues(),
            ordered_depth=self._dispatcher.depth(),
            staged_count=rendezvous.staged_count,
            staged_bytes=rendezvous.staged_bytes,
            pulls_outstanding=rendezvous.pulls_outstanding,
            pull_bytes_outstanding=rendezvous.pull_bytes_outstanding,
            releases_outstanding=rendezvous.releases_outstanding,
            pending_reply_bytes=self._pending_reply_total,
            peers=tuple(sorted(self.peers, key=lambda record: str(record.instance_id))),
            closed=self._closed,
        )

    # -- sending -------------------------------------------------------------------------

    def eager_budget(self, peer: InstanceId) -> int:
        """The largest payload carried inline to ``peer``; larger ones are staged and pulled."""
        limit = min(self.transport.max_message_size(peer), self.config.staging_threshold)
        return max(0, limit - ENVELOPE_RESERVE)

    def send_message_on_lane(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        payload: bytes | bytearray | memoryview,
        *,
        headers: dict[str, str] | None = None,
        on_staged_release: Callable[[str], None] | None = None,
    ) -> SendOutcome:
        """Fire-and-forget without waiting: the transport's admission outcome, at once.

        The outcome is admitted, or a :class:`~velomux_quic.transport.SendAdmission` to
        await (or observe) when the lane is backpressured. For callers that pace
        themselves (the mux); :meth:`am_send` is the awaiting form. A payload over the
        eager budget is staged; ``on_staged_release`` is then told, once, why it was
        released (``pulled``: the receiver has it; ``refused``, ``expired``, ``closed``,
        ``unsent``: it never will), and is never called for an inline payload.
        """
        return self._send(peer, lane, _MESSAGE, handler, payload, 0, headers, on_staged_release)

    async def am_send(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Fire-and-forget: returns once the transport admitted the message.

        The sender learns nothing about its handling (use :meth:`am_sync` or
        :meth:`unary` for that). It waits only while ``lane`` is backpressured; with
        ``timeout``, a message still not admitted then is withdrawn and
        :class:`~velomux_quic.errors.SendTimeout` raised. Raises the transport's
        errors (PeerNotRegistered: ``add_peer`` it first) and MessengerClosed.
        """
        outcome = self.send_message_on_lane(peer, lane, handler, payload, headers=headers)
        if isinstance(outcome, SendAdmission):
            if timeout is None:
                await outcome
            else:
                await self._admitted_within(outcome, timeout, peer, handler)

    @staticmethod
    async def _admitted_within(
        admission: SendAdmission, timeout: float, peer: InstanceId, handler: str
    ) -> None:
        async def admitted() -> None:
            await admission

        try:
            await asyncio.wait_for(admitted(), timeout)
        except TimeoutError:
            if not admission.cancel():
                return  # admitted (or refused) just as the time ran out: the outcome stands
            raise SendTimeout(
                f"the message to {peer}'s {handler!r} was not admitted within {timeout:g} s"
                " (the lane is backpressured: the peer reads slowly); it was withdrawn"
            ) from None

    async def am_sync(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Send and wait until the peer's handler finished (acknowledged).

        Raises, within ``timeout`` (default ``MessengerConfig.default_timeout``):
        UnknownHandler, HandlerFailed, RemoteRefused, UnaryTimeout, PeerGone or
        MessengerClosed, all :class:`CallError`.
        """
        await self._call(peer, lane, Kind.SYNC, handler, payload, timeout, headers)

    async def unary(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """Request and response: the bytes the peer's handler returned.

        Raises, within ``timeout`` (default ``MessengerConfig.default_timeout``):
        UnknownHandler (no such handler there), HandlerFailed (it raised; see
        ``remote_message``), RemoteRefused (the peer declined, e.g. a size limit),
        UnaryTimeout (no answer in time), PeerGone (unreachable, or its connection
        closed) or MessengerClosed, all :class:`CallError`.
        """
        result: bytes = await self._call(
            peer, lane, Kind.REQUEST, handler, payload, timeout, headers
        )
        return result

    async def _call(
        self,
        peer: InstanceId,
        lane: int,
        kind: Kind,
        handler: str,
        payload: bytes | bytearray | memoryview,
        timeout: float | None,
        headers: dict[str, str] | None,
    ) -> Any:
        if self._closed:
            raise MessengerClosed("the messenger is closed", handler=handler)
        timeout = self.config.default_timeout if timeout is None else timeout
        if self._call_headers is not None:
            headers = self._call_headers(headers)
        if self._discovery is not None and self.transport.peer_address(peer) is None:
            await self.resolve(peer)
        message_id, future = self._calls.start(peer, handler, timeout)
        started = time.monotonic()
        outcome_label = "error"
        try:
            try:
                outcome = self._send(peer, lane, kind, handler, payload, message_id, headers)
            except PeerNotRegistered as exc:
                raise CallPeerNotRegistered(str(exc), peer=peer, handler=handler) from exc
            if isinstance(outcome, SendAdmission):
                # Never admitted (the dial failed, the connection died first): fail now,
                # not at the timeout.
                def never_admitted(admission: SendAdmission) -> None:
                    if admission.error is not None:
                        # The address tried, so a wrong one in the configuration shows.
                        address = self.transport.peer_address(peer)
                        where = "" if address is None else f" at {address[0]}:{address[1]}"
                        dial_error = admission.error.__cause__
                        hint = (
                            "; check the address this node has for it (add_peer, [[peers]] "
                            "or discovery) and that the peer runs there"
                            if isinstance(dial_error, DialError)
                            and dial_error.reason in ("handshake_timeout", "unreachable")
                            else ""
                        )
                        gone = PeerGone(
                            f"{peer}{where} unreachable: {admission.error}{hint}",
                            peer=peer,
                            handler=handler,
                        )
                        # No connection could be made at all (not one that ended under
                        # the call): a caller that resends (an attach) tells them apart.
                        gone.__cause__ = dial_error if isinstance(dial_error, DialError) else None
                        self._calls.fail(peer, message_id, gone)

                outcome.on_resolved(never_admitted)
            result = await future
            outcome_label = "success"
            return result
        finally:
            if not future.done():
                future.cancel()
            self.metrics.unary_duration_of(handler, outcome_label).observe(
                time.monotonic() - started
            )

    def _send(
        self,
        peer: InstanceId,
        lane: int,
        kind: Kind,
        handler: str,
        payload: bytes | bytearray | memoryview,
        message_id: int,
        headers: dict[str, str] | None,
        on_staged_release: Callable[[str], None] | None = None,
    ) -> SendOutcome:
        """The one path of every outgoing envelope (once per message: keep it lean)."""
        if self._closed:
            raise MessengerClosed("the messenger is closed", handler=handler)
        size = len(payload)
        staged_id = 0
        if headers:
            self._check_headers(headers)
        if size > self.eager_budget(peer):
            staged_id = self._rendezvous.stage(bytes(payload), peer, on_staged_release)
            body = encode_envelope(
                kind,
                handler=handler,
                message_id=message_id,
                headers=headers,
                payload=StagedDescriptor(staged_id, size).encode(),
                staged=True,
            )
        elif kind is _MESSAGE and headers is None:
            prefix = self._prefixes.get(handler)
            if prefix is None:
                prefix = self._prefixes[handler] = message_prefix(Kind.MESSAGE, handler)
            body = prefix + payload
        else:
            body = encode_envelope(
                kind, handler=handler, message_id=message_id, headers=headers, payload=payload
            )
        try:
            outcome = self.transport.send(peer, lane, body)
        except BaseException:
            if staged_id:
                self._rendezvous.unstage(staged_id, peer)
            raise
        if handler:
            self.metrics.count_message(handler, "outbound", size)
        return outcome

    def _check_headers(self, headers: dict[str, str]) -> None:
        codecs = self._header_codecs
        for name in headers:
            if name.startswith(RESERVED_PREFIX) and name not in codecs:
                raise ConfigurationError(
                    f"the header {name!r} starts with '_', which is reserved for the headers"
                    " a layer registered (register_header): drop the leading underscore"
                )

    async def _request_stream(
        self, peer: InstanceId, request: bytes, max_response: int, timeout: float
    ) -> bytes:
        """The rendezvous' one way to the peer: a request stream of the transport."""
        return await self.transport.request(
            peer, request, max_response=max_response, timeout=timeout
        )

    def _background_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run ``coro`` as a task the messenger's close cancels and awaits."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- receiving and dispatch ----------------------------------------------------------

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        """Every frame of every lane: decode it, then deliver it (or have it pulled)."""
        try:
            envelope = decode_envelope(body)
        except MalformedEnvelope as exc:
            self.metrics.dispatch_failures.labels("decode", "active_message").inc()
            logger.debug("malformed envelope from %s lane %d: %s", peer, lane, exc)
            return
        if envelope.staged:
            self._rendezvous.resolve(peer, lane, envelope)
        else:
            self._deliver(peer, lane, envelope, envelope.payload)

    def _deliver(
        self, peer: InstanceId, lane: int, envelope: Envelope, payload: bytes | memoryview
    ) -> None:
        kind = envelope.kind
        if kind in _ANSWERS:
            self._answer(peer, envelope, payload)
            return
        spec = self._handlers.get(envelope.handler)
        if spec is None:
            self.metrics.dispatch_failures.labels("dispatch", "unknown_handler").inc()
            self.metrics.count_message("_unknown", "inbound", len(payload))
            if kind is not Kind.MESSAGE:
                self._reply(
                    peer,
                    lane,
                    Kind.ERROR,
                    envelope.message_id,
                    encode_error(
                        ErrorCode.UNKNOWN_HANDLER, f"no handler named {envelope.handler!r}"
                    ),
                )
            return
        self.metrics.count_message(spec.name, "inbound", len(payload))
        ctx = Context(peer, lane, spec.name, envelope.headers, payload)
        job: Job = (spec, ctx, kind, envelope.message_id)
        if spec.dispatch == "inline":
            self._run_inline(job)
        elif spec.dispatch == "ordered":
            self._dispatcher.submit(spec.name, peer, lane, job)
        else:
            self._dispatcher.spawn(job)

    def _run_inline(self, job: Job) -> None:
        spec, ctx, _, _ = job
        started = time.monotonic()
        try:
            result = spec.fn(ctx)
            if isinstance(result, Awaitable):  # registered as inline but returned a coroutine
                raise TypeError(f"inline handler {spec.name!r} returned an awaitable")
        except Exception as exc:
            self._handler_failed(job, exc, started)
            return
        self._handler_done(job, result, started)

    async def _run(self, job: tuple[Any, ...]) -> None:
        spec, ctx, _, _ = job
        started = time.monotonic()
        try:
            result = spec.fn(ctx)
            if isinstance(result, Awaitable):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._handler_failed(job, exc, started)
            return
        self._handler_done(job, result, started)

    def _handler_done(self, job: tuple[Any, ...], result: Any, started: float) -> None:
        spec, ctx, kind, message_id = job
        response_type = _RESPONSE_TYPE[kind]
        self._observe(spec.name, response_type, "success", started, len(ctx.payload))
        if kind is _REQUEST:
            payload = b"" if result is None else bytes(result)
            self.metrics.response_bytes_of(spec.name, response_type, "success").inc(len(payload))
            self._reply(ctx.sender, ctx.lane, Kind.RESPONSE, message_id, payload)
        elif kind is _SYNC:
            self._reply(ctx.sender, ctx.lane, Kind.ACK, message_id, b"")

    def _handler_failed(self, job: tuple[Any, ...], exc: Exception, started: float) -> None:
        spec, ctx, kind, message_id = job
        self._observe(spec.name, _RESPONSE_TYPE[kind], "error", started, len(ctx.payload))
        if kind is Kind.MESSAGE:
            logger.warning("handler %r failed on a message from %s: %r", spec.name, ctx.sender, exc)
            return
        logger.debug("handler %r failed for %s: %r", spec.name, ctx.sender, exc)
        self._reply(
            ctx.sender,
            ctx.lane,
            Kind.ERROR,
            message_id,
            encode_error(ErrorCode.HANDLER_FAILED, repr(exc)),
        )

    def _observe(
        self, handler: str, response_type: str, outcome: str, started: float, size: int
    ) -> None:
        self.metrics.observe_handler(
            handler, response_type, outcome, time.monotonic() - started, size
        )

    def _answer(self, peer: InstanceId, envelope: Envelope, payload: bytes | memoryview) -> None:
        message_id = envelope.message_id
        if envelope.kind is Kind.ERROR:
            try:
                code, text = decode_error(payload)
            except MalformedEnvelope:
                code, text = ErrorCode.MALFORMED, "unreadable error from peer"
            matched = self._calls.fail(peer, message_id, self._remote_error(peer, code, text))
        else:
            matched = self._calls.resolve(peer, message_id, bytes(payload))
        if not matched:  # late (timed out) or not ours: drop, but count
            self.metrics.dispatch_failures.labels("response", "unmatched").inc()

    @staticmethod
    def _remote_error(peer: InstanceId, code: ErrorCode, text: str) -> CallError:
        if code is ErrorCode.UNKNOWN_HANDLER:
            return UnknownHandler(f"{peer}: {text}", peer=peer)
        if code is ErrorCode.HANDLER_FAILED:
            return HandlerFailed(f"{peer}'s handler failed: {text}", remote_message=text, peer=peer)
        return RemoteRefused(f"{peer} refused the message ({code.value}): {text}", peer=peer)

    def _refuse_caller(self, peer: InstanceId, lane: int, envelope: Envelope, message: str) -> None:
        """A staged SYNC or REQUEST that will never be handled: its caller gets
        RemoteRefused with ``message`` (a MESSAGE has no caller to tell)."""
        if envelope.kind in (Kind.SYNC, Kind.REQUEST):
            self._reply(
                peer,
                lane,
                Kind.ERROR,
                envelope.message_id,
                encode_error(ErrorCode.REFUSED, message),
            )

    def _reply(
        self, peer: InstanceId, lane: int, kind: Kind, message_id: int, payload: bytes
    ) -> None:
        waiting = self._pending_replies.get(peer, 0)
        if waiting > self.config.max_pending_reply_bytes:
            # The peer sends requests and does not read their answers: queueing more
            # would hold its replies here without bound. Its callers time out instead.
            self.metrics.replies_dropped_of("peer_not_reading").inc()
            if peer not in self._reply_drops_logged:
                self._reply_drops_logged.add(peer)
                logger.warning(
                    "%s is not reading its replies (%d bytes waiting, max_pending_reply_bytes"
                    " %d): dropping further replies to it (velo_messenger_replies_dropped_total)",
                    peer,
                    waiting,
                    self.config.max_pending_reply_bytes,
                )
            return
        transport = self._transport
        if transport is not None and not self._closed:
            if transport.is_dialing(peer) and len(payload) <= self.eager_budget(peer):
                self._hold_reply(peer, lane, kind, message_id, payload, waiting)
                return
            if peer in self._held:  # the dial is over: what it held goes first, in order
                self._release_held(peer)
        try:
            outcome = self._send(peer, lane, kind, "", payload, message_id, None)
        except (TransportError, MessengerClosed) as exc:
            self.metrics.dispatch_failures.labels("response_send", "no_route").inc()
            logger.warning("could not answer %s on lane %d: %s", peer, lane, exc)
            return
        self._charge_reply(peer, outcome, len(payload) + REPLY_OVERHEAD)

    def _charge_reply(self, peer: InstanceId, outcome: object, cost: int) -> None:
        """A reply waits in a gate: charge it to its peer until the gate resolves it."""
        if isinstance(outcome, SendAdmission):
            self._pending_replies[peer] = self._pending_replies.get(peer, 0) + cost
            self._pending_reply_total += cost
            outcome.on_resolved(lambda admission: self._reply_resolved(peer, cost, admission))

    def _hold_reply(
        self,
        peer: InstanceId,
        lane: int,
        kind: Kind,
        message_id: int,
        payload: bytes,
        waiting: int,
    ) -> None:
        held = self._held.get(peer)
        if held is None:
            held = self._held[peer] = HeldReplies()
            # Released when the dial completes (peer_connected); a dial that fails tells
            # nobody, so this releases them into a new dial (or its failure) after it.
            self._arm_held_backstop(peer, held)
        body = encode_envelope(kind, handler="", message_id=message_id, payload=payload)
        cost = held.add(lane, body)
        self._pending_replies[peer] = waiting + cost
        self._pending_reply_total += cost

    def _arm_held_backstop(self, peer: InstanceId, held: HeldReplies) -> None:
        delay = self.transport.config.handshake_timeout
        asyncio.get_running_loop().call_later(delay, self._held_backstop, peer, held)

    def _held_backstop(self, peer: InstanceId, held: HeldReplies) -> None:
        if self._held.get(peer) is not held or self._closed:
            return
        if self.transport.is_dialing(peer):
            self._arm_held_backstop(peer, held)
        else:
            self._release_held(peer)

    def _release_held(self, peer: InstanceId) -> None:
        """Hand the peer's held replies to its lanes' gates, oldest first."""
        held = self._held.pop(peer, None)
        if held is None:
            return
        charged = held.charged
        self._pending_reply_total -= charged
        left = self._pending_replies.get(peer, 0) - charged
        if left > 0:
            self._pending_replies[peer] = left
        else:
            self._pending_replies.pop(peer, None)
        transport = self.transport
        for lane, body in held.drain():
            try:
                outcome = transport.send(peer, lane, body)
            except TransportError as exc:
                self.metrics.dispatch_failures.labels("response_send", "no_route").inc()
                logger.warning("could not answer %s on lane %d: %s", peer, lane, exc)
                continue
            self._charge_reply(peer, outcome, len(body) + REPLY_OVERHEAD)

    def peer_connected(self, peer: InstanceId, outbound: bool) -> None:
        """The return dial completed: the replies held for it go to its lanes now."""
        if outbound and peer in self._held:
            self._release_held(peer)

    def _reply_resolved(self, peer: InstanceId, cost: int, admission: SendAdmission) -> None:
        self._pending_reply_total -= cost
        left = self._pending_replies.get(peer, 0) - cost
        if left > 0:
            self._pending_replies[peer] = left
        else:
            self._pending_replies.pop(peer, None)
            self._reply_drops_logged.discard(peer)  # it reads again: warn anew next time
        if admission.error is not None:
            self.metrics.dispatch_failures.labels("response_send", "refused").inc()

    # -- system handlers, and the calls that ask a peer's --------------------------------

    def _register_system_handlers(self) -> None:
        self._handlers.register(HELLO_HANDLER, self._hello_handler, system=True)
        self._handlers.register(HEALTH_HANDLER, lambda ctx: b"ok", system=True)
        self._handlers.register(
            LIST_HANDLERS_HANDLER,
            lambda ctx: msgpack.packb(self._handlers.names()),
            system=True,
        )

    def _hello_handler(self, ctx: Context) -> bytes:
        return self._hello_payload()

    def _hello_payload(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "version": PROTOCOL_VERSION,
                "capabilities": list(CAPABILITIES),
                "lanes": self.transport.config.lanes,
            }
        )
        return packed

    async def hello(self, peer: InstanceId, timeout: float | None = None) -> dict[str, Any]:
        """Exchange ``_hello`` with ``peer``: its protocol version, capabilities and lanes.

        ``timeout`` defaults to ``MessengerConfig.default_timeout``; raises as :meth:`unary`.
        """
        answer: dict[str, Any] = msgpack.unpackb(
            await self.unary(peer, HELLO_HANDLER, self._hello_payload(), timeout=timeout)
        )
        return answer

    async def check_health(self, peer: InstanceId, timeout: float | None = None) -> None:
        """A ``_health`` round trip: the peer's messenger (not just its QUIC stack) answers.

        ``timeout`` defaults to ``MessengerConfig.health_check_timeout``; raises as
        :meth:`unary` (UnaryTimeout, PeerGone, ...) when the peer is not healthy.
        """
        if timeout is None:
            timeout = self.config.health_check_timeout
        await self.unary(peer, HEALTH_HANDLER, timeout=timeout)

    async def list_handlers(self, peer: InstanceId, timeout: float | None = None) -> list[str]:
        """The handler names ``peer`` serves, sorted (the system's ``_`` names included).

        ``timeout`` defaults to ``MessengerConfig.default_timeout``; raises as :meth:`unary`.
        """
        names: list[str] = msgpack.unpackb(
            await self.unary(peer, LIST_HANDLERS_HANDLER, timeout=timeout)
        )
        return names

    # -- transport events ----------------------------------------------------------------

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        """A non-lane stream's data: the stream acceptor's (the per-stream path), if any."""
        acceptor = self._stream_acceptor
        return acceptor is not None and acceptor.stream_received(link, event)

    def stream_reset(self, link: PeerLink, event: StreamReset) -> None:
        """A non-lane stream the peer reset: the stream acceptor's to handle."""
        if self._stream_acceptor is not None:
            self._stream_acceptor.stream_reset(link, event)

    def stream_stopped(self, link: PeerLink, event: StreamStopped) -> None:
        """A stream we opened that the peer stopped: the stream acceptor's to forget."""
        if self._stream_acceptor is not None:
            self._stream_acceptor.stream_stopped(link, event)

    def send_failed(self, peer: InstanceId, lane: int, error: TransportError) -> None:
        """Admitted data its peer never acknowledged: a warning, unless this node is
        closing (an orderly close of a node whose peer died loses that data by design, and
        says so once per lane at DEBUG)."""
        if self._closed or (self._transport is not None and self._transport.closing):
            logger.debug("send to %s on lane %d lost at close: %s", peer, lane, error)
            return
        logger.warning("send to %s on lane %d failed after admission: %s", peer, lane, error)

    def connection_lost(self, link: PeerLink) -> None:
        """A connection ended: its non-lane streams (the stream acceptor's) are over."""
        if self._stream_acceptor is not None:
            self._stream_acceptor.connection_lost(link)

    def lane_reset(self, peer: InstanceId, lane: int) -> None:
        """The peer cut one lane's stream: its frames in flight are lost; tell the hooks."""
        logger.warning("%s reset lane %d: the frames in flight on it are lost", peer, lane)
        for hook in self._lane_reset_hooks:
            try:
                hook(peer, lane)
            except Exception:
                logger.exception("lane reset hook failed")

    def peer_disconnected(self, peer: InstanceId, outbound: bool) -> None:
        """A connection to or from ``peer`` ended: the calls waiting on the peer fail
        (PeerGone), unless what they wait for can still come.

        Requests leave on the connection this node dialed, so losing that one fails them
        unless another dialed connection took its place, established or still in its
        handshake: a connection closed because the peer moved ends (its closing period
        over) while the re-dial to the new address may still be handshaking under load,
        and the calls queued on that dial are its successor's to answer (a dial that
        fails fails them, through their admission). Answers come on one the peer dialed
        (or dials again), so losing one of those fails them only when no connection with
        the peer is left at all: an old process of the peer's identity closing (it
        restarted elsewhere) must not fail the calls its successor answers.
        """
        transport = self._transport
        if transport is not None and (
            transport.is_connected(peer, outbound=True if outbound else None)
            or (outbound and transport.is_dialing(peer))
        ):
            return
        self._calls.fail_peer(
            peer,
            lambda handler: PeerGone(
                f"connection {'to' if outbound else 'from'} {peer} closed while waiting",
                peer=peer,
                handler=handler,
            ),
        )

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        """A peer's request stream: a pull or release of a payload staged for it."""
        return await self._rendezvous.serve(peer, request)

    def _pause_lane(self, peer: InstanceId, lane: int) -> None:
        self.transport.pause_reading(peer, lane)

    def _resume_lane(self, peer: InstanceId, lane: int) -> None:
        if self._transport is not None and not self._closed:
            self._transport.resume_reading(peer, lane)

    # -- shutdown ------------------------------------------------------------------------

    async def close(self) -> None:
        """Fail waiting calls (MessengerClosed), stop dispatch, release staged payloads,
        withdraw from discovery, close the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._held.clear()
        self._calls.fail_all(
            lambda handler: MessengerClosed("the messenger closed", handler=handler)
        )
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._dispatcher.close()
        self._rendezvous.close()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._discovery is not None:
            try:
                await self._discovery.close()  # withdraws our record
            except Exception:
                logger.warning("discovery close failed", exc_info=True)
        if self._transport is not None:
            await self._transport.close()
