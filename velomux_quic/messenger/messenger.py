"""The Messenger: active messages between nodes, on the QUIC transport.

It turns frames into calls and back: fire-and-forget messages, acknowledged messages,
unary request/response with typed remote errors and timeouts, ordered per-(sender, lane)
dispatch for coroutine handlers, and rendezvous for payloads too large to travel inline.

Replies go back the way ARCHITECTURE.md decides: on *this* node's own outbound connection
to the sender, on the lane the request arrived on. The sender of every message is the
InstanceId its connection's certificate proved, never something the message says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from aioquic.quic.events import StreamDataReceived
from prometheus_client.registry import CollectorRegistry

from ..ids import InstanceId
from ..security.certs import NodeCredentials
from ..transport import (
    PeerNotRegistered,
    QuicTransport,
    SendAdmission,
    SendOutcome,
    TransportConfig,
    TransportError,
    TransportHandler,
)
from ..transport.connection import PeerConnection
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
from .errors import (
    CallError,
    HandlerFailed,
    MessengerClosed,
    PeerGone,
    RemoteRefused,
    UnknownHandler,
)
from .metrics import MessengerMetrics
from .peers import PeerDiscovery, PeerRecord, PeerRegistry, WorkerIdCollision, sync_registry
from .registry import (
    BATCH_HANDLER_NAMES,
    Context,
    Dispatch,
    Handler,
    HandlerRegistry,
    HandlerSpec,
)
from .staging import PullOp, StagingStore, decode_pull, encode_pull

__all__ = ["ENVELOPE_RESERVE", "Messenger", "StagedRefusal"]

logger = logging.getLogger(__name__)

ENVELOPE_RESERVE = 2048
"""Bytes kept out of the eager budget for the envelope: fixed header, name, small headers."""

PROTOCOL_VERSION = 1
CAPABILITIES = ("rendezvous", "lanes")

_RESPONSE_TYPE = {Kind.MESSAGE: "fire_and_forget", Kind.SYNC: "ack_nack", Kind.REQUEST: "unary"}
_ANSWERS = (Kind.RESPONSE, Kind.ERROR, Kind.ACK)

Job = tuple[HandlerSpec, Context, Kind, int]


class StagedRefusal:
    """A staged payload this node refused for its size, as told to refusal hooks."""

    __slots__ = ("handler", "headers", "lane", "limit", "peer", "size")

    def __init__(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        headers: dict[str, str] | None,
        size: int,
        limit: int,
    ) -> None:
        self.peer = peer
        self.lane = lane
        self.handler = handler
        self.headers = headers
        self.size = size
        self.limit = limit


RefusalHook = Callable[[StagedRefusal], None]
ErrorHandler = Callable[[InstanceId, int, TransportError], None]


class Messenger(TransportHandler):
    """One node's messenger. Create with :meth:`start`, close with :meth:`close`."""

    def __init__(
        self,
        config: MessengerConfig,
        registry: CollectorRegistry,
        peers: PeerRegistry,
    ) -> None:
        self.config = config
        self.registry = registry
        self.peers = peers
        self.metrics = MessengerMetrics(registry)
        self.handlers = HandlerRegistry()
        self._calls = PendingCalls()
        self._staging = StagingStore(
            max_bytes=config.max_staged_bytes, ttl=config.staged_ttl, on_release=self._released
        )
        self._transport: QuicTransport | None = None
        self._dispatcher = OrderedDispatcher(
            self._run,
            max_backlog=config.max_ordered_backlog,
            pause=self._pause_lane,
            resume=self._resume_lane,
            observe_wait=lambda handler, wait: self.metrics.lane_wait.labels(handler).observe(wait),
        )
        self._prefixes: dict[str, bytes] = {}
        self._refusal_hooks: list[RefusalHook] = []
        self._lane_reset_hooks: list[Callable[[InstanceId, int], None]] = []
        self._staging_listeners: list[Callable[[str, int], None]] = []
        self._error_handler: ErrorHandler | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._discovery: PeerDiscovery | None = None
        self._stream_acceptor: TransportHandler | None = None
        self.metrics.bind_gauges(
            pending=lambda: len(self._calls),
            lanes=lambda: self._dispatcher.queues(),
            depth=lambda: self._dispatcher.depth(),
            staged_bytes=lambda: self._staging.bytes_held,
            staged_count=lambda: len(self._staging),
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
    ) -> Messenger:
        """Start the node's transport with this messenger as its handler.

        With ``discovery``, the node publishes its own record there, loads every record
        it finds, and looks up a peer it does not know the first time it calls it.
        """
        registry = registry or CollectorRegistry()
        messenger = cls(config or MessengerConfig(), registry, peers or PeerRegistry())
        messenger._transport = await QuicTransport.start(
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
                await discovery.publish(messenger.own_record(name))
                await sync_registry(messenger.peers, discovery)
            except BaseException:
                await messenger.close()
                raise
        return messenger

    async def resolve(self, peer: InstanceId) -> bool:
        """Make sure the transport knows where ``peer`` is, asking discovery if needed."""
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

    async def __aenter__(self) -> Messenger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- identity and peers --------------------------------------------------------------

    @property
    def transport(self) -> QuicTransport:
        if self._transport is None:
            raise MessengerClosed("the messenger has not been started")
        return self._transport

    @property
    def instance_id(self) -> InstanceId:
        return self.transport.instance_id

    @property
    def address(self) -> tuple[str, int]:
        return self.transport.address

    def own_record(self, name: str = "") -> PeerRecord:
        return PeerRecord(
            instance_id=self.instance_id,
            address=self.address,
            name=name,
            lanes=self.transport.config.lanes,
            updated_at=time.time(),
        )

    def add_peer(self, instance_id: InstanceId, address: tuple[str, int], name: str = "") -> None:
        """Learn where a peer listens (its identity is still proven by its certificate)."""
        self.peers.add(
            PeerRecord(instance_id=instance_id, address=address, name=name, updated_at=time.time())
        )

    def remove_peer(self, instance_id: InstanceId) -> None:
        """Forget a peer (eviction): its address goes, and the mux ends its streams."""
        self.peers.remove(instance_id)

    def _peer_changed(self, record: PeerRecord | None, instance_id: InstanceId) -> None:
        if self._transport is None:
            return
        if record is None:
            self._transport.unregister_peer(instance_id)
        else:
            self._transport.register_peer(record.instance_id, record.address)

    # -- handlers ------------------------------------------------------------------------

    def register(self, name: str, handler: Handler, *, dispatch: Dispatch | None = None) -> None:
        """Register ``handler`` under ``name``: a plain function runs inline, a coroutine
        function through an ordered per-(sender, lane) queue (or ``dispatch="spawn"``)."""
        self.handlers.register(name, handler, dispatch=dispatch)

    def register_system(
        self, name: str, handler: Handler, *, dispatch: Dispatch | None = None
    ) -> None:
        """Register a reserved (``_``-prefixed) handler: for the layers built on the messenger."""
        self.handlers.register(name, handler, dispatch=dispatch, system=True)

    def set_stream_acceptor(self, acceptor: TransportHandler) -> None:
        """Hand non-lane QUIC streams (the per-stream path) to ``acceptor``."""
        self._stream_acceptor = acceptor

    def install_batch_handler(self, lane: int, handler: Callable[[Context], None]) -> None:
        """Install the mux's inline batch handler for one lane (names are reserved at build)."""
        self.handlers.replace(BATCH_HANDLER_NAMES[lane], handler, dispatch="inline")

    def add_lane_reset_hook(self, hook: Callable[[InstanceId, int], None]) -> None:
        """Be told when a peer cuts one lane's stream (the mux ends that lane's slots)."""
        self._lane_reset_hooks.append(hook)

    def lane_reset(self, peer: InstanceId, lane: int) -> None:
        logger.warning("%s reset lane %d: the frames in flight on it are lost", peer, lane)
        for hook in self._lane_reset_hooks:
            try:
                hook(peer, lane)
            except Exception:
                logger.exception("lane reset hook failed")

    def add_staged_refusal_hook(self, hook: RefusalHook) -> None:
        """Be told when this node refuses a staged payload for its size (the mux ends the slot)."""
        self._refusal_hooks.append(hook)

    def set_error_handler(self, handler: ErrorHandler) -> None:
        """Where failures *after* admission go (the node-wide error handler)."""
        self._error_handler = handler

    def _register_system_handlers(self) -> None:
        self.handlers.register("_hello", self._hello_handler, system=True)
        self.handlers.register("_health", lambda ctx: b"ok", system=True)
        self.handlers.register(
            "_list_handlers",
            lambda ctx: msgpack.packb(self.handlers.names()),
            system=True,
        )
        for name in BATCH_HANDLER_NAMES:
            self.handlers.register(name, self._no_mux, system=True)

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

    def _no_mux(self, ctx: Context) -> None:
        self.metrics.dispatch_failures.labels("dispatch", "no_mux").inc()

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
    ) -> SendOutcome:
        """Fire-and-forget, returning the transport's admission outcome at the send site."""
        return self._send(peer, lane, Kind.MESSAGE, handler, payload, 0, headers)

    async def am_send(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Fire-and-forget; returns once the transport admitted the message."""
        outcome = self.send_message_on_lane(peer, lane, handler, payload, headers=headers)
        if isinstance(outcome, SendAdmission):
            await outcome

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
        """Send and wait until the peer's handler finished (acknowledged)."""
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
        """Request/response. Raises UnknownHandler, HandlerFailed, RemoteRefused,
        UnaryTimeout or PeerGone, each within ``timeout``."""
        result: bytes = await self._call(
            peer, lane, Kind.REQUEST, handler, payload, timeout, headers
        )
        return result

    async def hello(self, peer: InstanceId, timeout: float | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = msgpack.unpackb(
            await self.unary(peer, "_hello", self._hello_payload(), timeout=timeout)
        )
        return answer

    async def check_health(self, peer: InstanceId, timeout: float = 5.0) -> None:
        """A ``_health`` round trip: the peer's messenger (not just its QUIC stack) answers."""
        await self.unary(peer, "_health", timeout=timeout)

    async def list_handlers(self, peer: InstanceId, timeout: float | None = None) -> list[str]:
        names: list[str] = msgpack.unpackb(
            await self.unary(peer, "_list_handlers", timeout=timeout)
        )
        return names

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
            raise MessengerClosed("the messenger is closed")
        timeout = self.config.default_timeout if timeout is None else timeout
        if self._discovery is not None and self.transport.peer_address(peer) is None:
            await self.resolve(peer)
        message_id, future = self._calls.start(peer, handler, timeout)
        started = time.monotonic()
        outcome_label = "error"
        try:
            try:
                outcome = self._send(peer, lane, kind, handler, payload, message_id, headers)
            except PeerNotRegistered as exc:
                raise PeerGone(str(exc), peer=peer, handler=handler) from exc
            if isinstance(outcome, SendAdmission):
                # Never admitted (the dial failed, the connection died first): fail now,
                # not at the timeout.
                def never_admitted(admission: SendAdmission) -> None:
                    if admission.error is not None:
                        self._calls.fail(
                            peer,
                            message_id,
                            PeerGone(
                                f"{peer} unreachable: {admission.error}",
                                peer=peer,
                                handler=handler,
                            ),
                        )

                outcome.on_resolved(never_admitted)
            result = await future
            outcome_label = "success"
            return result
        finally:
            if not future.done():
                future.cancel()
            self.metrics.unary_duration.labels(handler, outcome_label).observe(
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
    ) -> SendOutcome:
        if self._closed:
            raise MessengerClosed("the messenger is closed")
        size = len(payload)
        staged_id = 0
        if size > self.eager_budget(peer):
            staged_id = self._staging.stage(bytes(payload), peer)
            self.metrics.rendezvous_ops.labels("register", "success").inc()
            self.metrics.rendezvous_bytes.labels("register").inc(size)
            body = encode_envelope(
                kind,
                handler=handler,
                message_id=message_id,
                headers=headers,
                payload=StagedDescriptor(staged_id, size).encode(),
                staged=True,
            )
        elif kind is Kind.MESSAGE and headers is None:
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
                self._staging.release(staged_id, peer, "unsent")
            raise
        if handler:
            self.metrics.count_message(handler, "outbound", size)
        return outcome

    def _reply(self, ctx: Context, kind: Kind, message_id: int, payload: bytes) -> None:
        try:
            outcome = self._send(ctx.sender, ctx.lane, kind, "", payload, message_id, None)
        except (TransportError, MessengerClosed) as exc:
            self.metrics.dispatch_failures.labels("response_send", "no_route").inc()
            logger.warning("could not answer %s on lane %d: %s", ctx.sender, ctx.lane, exc)
            return
        if isinstance(outcome, SendAdmission):
            outcome.on_resolved(self._reply_resolved)

    def _reply_resolved(self, admission: SendAdmission) -> None:
        if admission.error is not None:
            self.metrics.dispatch_failures.labels("response_send", "refused").inc()

    # -- receiving -----------------------------------------------------------------------

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        try:
            envelope = decode_envelope(body)
        except MalformedEnvelope as exc:
            self.metrics.dispatch_failures.labels("decode", "active_message").inc()
            logger.debug("malformed envelope from %s lane %d: %s", peer, lane, exc)
            return
        if envelope.staged:
            self._resolve_staged(peer, lane, envelope)
        else:
            self._deliver(peer, lane, envelope, envelope.payload)

    def _deliver(
        self, peer: InstanceId, lane: int, envelope: Envelope, payload: bytes | memoryview
    ) -> None:
        kind = envelope.kind
        if kind in _ANSWERS:
            self._answer(peer, envelope, payload)
            return
        spec = self.handlers.get(envelope.handler)
        if spec is None:
            self.metrics.dispatch_failures.labels("dispatch", "unknown_handler").inc()
            self.metrics.count_message("_unknown", "inbound", len(payload))
            if kind is not Kind.MESSAGE:
                ctx = Context(self, peer, lane, envelope.handler, envelope.headers, payload)
                self._reply(
                    ctx,
                    Kind.ERROR,
                    envelope.message_id,
                    encode_error(
                        ErrorCode.UNKNOWN_HANDLER, f"no handler named {envelope.handler!r}"
                    ),
                )
            return
        self.metrics.count_message(spec.name, "inbound", len(payload))
        ctx = Context(self, peer, lane, spec.name, envelope.headers, payload)
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

    def _handler_done(self, job: Job, result: Any, started: float) -> None:
        spec, ctx, kind, message_id = job
        response_type = _RESPONSE_TYPE[kind]
        self._observe(spec.name, response_type, "success", started, len(ctx.payload))
        if kind is Kind.REQUEST:
            payload = b"" if result is None else bytes(result)
            self.metrics.response_bytes.labels(spec.name, response_type, "success").inc(
                len(payload)
            )
            self._reply(ctx, Kind.RESPONSE, message_id, payload)
        elif kind is Kind.SYNC:
            self._reply(ctx, Kind.ACK, message_id, b"")

    def _handler_failed(self, job: Job, exc: Exception, started: float) -> None:
        spec, ctx, kind, message_id = job
        self._observe(spec.name, _RESPONSE_TYPE[kind], "error", started, len(ctx.payload))
        if kind is Kind.MESSAGE:
            logger.warning("handler %r failed on a message from %s: %r", spec.name, ctx.sender, exc)
            return
        logger.debug("handler %r failed for %s: %r", spec.name, ctx.sender, exc)
        self._reply(ctx, Kind.ERROR, message_id, encode_error(ErrorCode.HANDLER_FAILED, repr(exc)))

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

    # -- rendezvous ----------------------------------------------------------------------

    def _resolve_staged(self, peer: InstanceId, lane: int, envelope: Envelope) -> None:
        descriptor = envelope.descriptor
        assert descriptor is not None
        limit = self.config.staged_payload_max
        if descriptor.size > limit:
            # Refused before allocating: the descriptor is all we ever read of it.
            self.metrics.refusals.labels("too_large").inc()
            self.metrics.rendezvous_ops.labels("get", "refused").inc()
            self._background_task(self._release_remote(peer, descriptor.staged_id))
            refusal = StagedRefusal(
                peer, lane, envelope.handler, envelope.headers, descriptor.size, limit
            )
            for hook in self._refusal_hooks:
                try:
                    hook(refusal)
                except Exception:
                    logger.exception("staged refusal hook failed")
            if envelope.kind in (Kind.SYNC, Kind.REQUEST):
                ctx = Context(self, peer, lane, envelope.handler, envelope.headers, b"")
                self._reply(
                    ctx,
                    Kind.ERROR,
                    envelope.message_id,
                    encode_error(
                        ErrorCode.REFUSED,
                        f"staged payload of {descriptor.size} bytes exceeds "
                        f"staged_payload_max {limit}",
                    ),
                )
            return
        self._background_task(self._pull_and_deliver(peer, lane, envelope, descriptor))

    async def _pull_and_deliver(
        self, peer: InstanceId, lane: int, envelope: Envelope, descriptor: StagedDescriptor
    ) -> None:
        started = time.monotonic()
        try:
            payload = await self.transport.request(
                peer,
                encode_pull(PullOp.PULL, descriptor.staged_id),
                max_response=descriptor.size,
                timeout=self.config.pull_timeout,
            )
            if len(payload) != descriptor.size:
                raise TransportError(
                    f"pulled {len(payload)} bytes, descriptor said {descriptor.size}"
                )
        except (TransportError, TimeoutError) as exc:
            self.metrics.rendezvous_ops.labels("get", "error").inc()
            logger.warning(
                "could not pull a staged %r payload from %s: %r", envelope.handler, peer, exc
            )
            if envelope.kind in (Kind.SYNC, Kind.REQUEST):
                ctx = Context(self, peer, lane, envelope.handler, envelope.headers, b"")
                self._reply(
                    ctx,
                    Kind.ERROR,
                    envelope.message_id,
                    encode_error(ErrorCode.REFUSED, f"staged payload lost: {exc}"),
                )
            return
        self.metrics.rendezvous_ops.labels("get", "success").inc()
        self.metrics.rendezvous_bytes.labels("get").inc(len(payload))
        logger.debug(
            "pulled %d bytes from %s in %.3f s", len(payload), peer, time.monotonic() - started
        )
        self._deliver(peer, lane, envelope, payload)

    async def _release_remote(self, peer: InstanceId, staged_id: int) -> None:
        try:
            await self.transport.request(
                peer, encode_pull(PullOp.RELEASE, staged_id), max_response=0, timeout=10.0
            )
        except (TransportError, TimeoutError) as exc:
            logger.debug("could not tell %s to release staged %x: %r", peer, staged_id, exc)

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        """The sender's side of a pull: hand over (or drop) what we staged for ``peer``."""
        op, staged_id = decode_pull(request)
        if op is PullOp.RELEASE:
            self._staging.release(staged_id, peer, "refused")
            return b""
        payload = self._staging.take(staged_id, peer)
        if payload is None:
            self.metrics.rendezvous_ops.labels("pull", "unknown").inc()
            raise LookupError(f"nothing staged under {staged_id:#x} for {peer}")
        self.metrics.rendezvous_ops.labels("pull", "success").inc()
        self.metrics.rendezvous_bytes.labels("pull").inc(len(payload))
        return payload

    def _released(self, reason: str, size: int) -> None:
        self.metrics.rendezvous_ops.labels("release", reason).inc()
        for listener in self._staging_listeners:
            listener(reason, size)

    def add_staging_listener(self, listener: Callable[[str, int], None]) -> None:
        """Be told ``(reason, size)`` whenever a staged payload is released
        (``pulled``, ``refused``, ``expired``, ``unsent`` or ``closed``)."""
        self._staging_listeners.append(listener)

    @property
    def staged_bytes(self) -> int:
        return self._staging.bytes_held

    # -- transport events ----------------------------------------------------------------

    def stream_received(self, connection: PeerConnection, event: StreamDataReceived) -> bool:
        acceptor = self._stream_acceptor
        return acceptor is not None and acceptor.stream_received(connection, event)

    def stream_reset(self, connection: PeerConnection, stream_id: int, error_code: int) -> None:
        if self._stream_acceptor is not None:
            self._stream_acceptor.stream_reset(connection, stream_id, error_code)

    def stream_stopped(self, connection: PeerConnection, stream_id: int) -> None:
        if self._stream_acceptor is not None:
            self._stream_acceptor.stream_stopped(connection, stream_id)

    def connection_lost(self, connection: PeerConnection) -> None:
        if self._stream_acceptor is not None:
            self._stream_acceptor.connection_lost(connection)

    def peer_disconnected(self, peer: InstanceId, outbound: bool) -> None:
        self._calls.fail_peer(
            peer,
            lambda handler: PeerGone(
                f"connection {'to' if outbound else 'from'} {peer} closed while waiting",
                peer=peer,
                handler=handler,
            ),
        )

    def send_failed(self, peer: InstanceId, lane: int, error: TransportError) -> None:
        if self._error_handler is not None:
            self._error_handler(peer, lane, error)
        else:
            super().send_failed(peer, lane, error)

    def _pause_lane(self, peer: InstanceId, lane: int) -> None:
        self.transport.pause_reading(peer, lane)

    def _resume_lane(self, peer: InstanceId, lane: int) -> None:
        if self._transport is not None and not self._closed:
            self._transport.resume_reading(peer, lane)

    def _background_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- shutdown ------------------------------------------------------------------------

    async def close(self) -> None:
        """Fail waiting calls (MessengerClosed), stop dispatch, release staged payloads,
        close the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._calls.fail_all(
            lambda handler: MessengerClosed("the messenger closed", handler=handler)
        )
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._dispatcher.close()
        self._staging.close()
        if self._discovery is not None:
            try:
                await self._discovery.close()  # withdraws our record
            except Exception:
                logger.warning("discovery close failed", exc_info=True)
        if self._transport is not None:
            await self._transport.close()
