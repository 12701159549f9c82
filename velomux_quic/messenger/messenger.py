"""The Messenger: active messages between nodes, on the QUIC transport.

It turns frames into calls and back: fire-and-forget messages, acknowledged messages,
unary request/response with typed remote errors and timeouts, ordered per-(sender, lane)
dispatch for coroutine handlers, and rendezvous for payloads too large to travel inline.

Replies go back the way ARCHITECTURE.md decides: on *this* node's own outbound connection
to the sender, on the lane the request arrived on. The sender of every message is the
InstanceId its connection's certificate proved, never something the message says.

This module is the façade: :class:`Messenger` builds the shared state and wires it to the
transport, the peer registry and discovery, and owns the node's lifecycle, its handler
registrations, the system handlers every node serves, and the transport events the other
parts do not handle. The message paths themselves live in their own modules, mixed into
:class:`Messenger` (see :mod:`.base` for why): sending in :mod:`.outbound`, receiving,
dispatch and replies in :mod:`.inbound`, large payloads in :mod:`.rendezvous`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack
from prometheus_client.registry import CollectorRegistry

from ..ids import InstanceId
from ..security.certs import NodeCredentials
from ..transport import (
    PeerLink,
    QuicTransport,
    StreamData,
    StreamReset,
    StreamStopped,
    TransportConfig,
    TransportError,
    TransportHandler,
)
from .calls import PendingCalls
from .config import MessengerConfig
from .dispatch import OrderedDispatcher
from .errors import MessengerClosed, PeerGone
from .inbound import MessengerInbound
from .metrics import MessengerMetrics
from .outbound import ENVELOPE_RESERVE, MessengerOutbound
from .peers import PeerDiscovery, PeerRecord, PeerRegistry, WorkerIdCollision, sync_registry
from .registry import BATCH_HANDLER_NAMES, Context, Dispatch, Handler, HandlerRegistry
from .rendezvous import MessengerRendezvous, RefusalHook, StagedRefusal
from .staging import StagingStore

__all__ = ["ENVELOPE_RESERVE", "Messenger", "StagedRefusal"]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
CAPABILITIES = ("rendezvous", "lanes")

ErrorHandler = Callable[[InstanceId, int, TransportError], None]


class Messenger(MessengerOutbound, MessengerInbound, MessengerRendezvous):
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
        self._pull_tails: dict[tuple[InstanceId, int], asyncio.Future[None]] = {}
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

    def set_error_handler(self, handler: ErrorHandler) -> None:
        """Where failures *after* admission go (the node-wide error handler)."""
        self._error_handler = handler

    # -- system handlers, and the calls that ask a peer's --------------------------------

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

    def connection_lost(self, link: PeerLink) -> None:
        """A connection ended: its non-lane streams (the stream acceptor's) are over."""
        if self._stream_acceptor is not None:
            self._stream_acceptor.connection_lost(link)

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
