"""Node: the one object an application holds (the design chapter's ``Velo``).

It owns the node's QUIC transport, messenger and anchor manager, and one Prometheus
registry for all of their metrics::

    async with await Node.start("certs/dev/node-b") as b, \\
               await Node.start("certs/dev/node-a") as a:
        a.add_peer(b.instance_id, b.address)
        anchor = b.create_anchor()
        sender = await a.attach_anchor(anchor.handle)
        await sender.send({"token": 1})
        await sender.finalize()
        async for item in anchor:
            ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from .ids import InstanceId, StreamAnchorHandle, WorkerId
from .messenger import Messenger, MessengerConfig, PeerDiscovery, PeerRegistry
from .mux.config import MuxConfig
from .mux.transport import MuxTransport
from .security.certs import NodeCredentials
from .streaming.anchor import MpscAnchor, StreamAnchor
from .streaming.control import StreamOpenTicket
from .streaming.manager import AnchorManager, StreamingConfig
from .streaming.sender import StreamSender
from .transport import TransportConfig

__all__ = ["Node"]


class Node:
    """A running node. Create with :meth:`start`; close with :meth:`close` or ``async with``."""

    def __init__(
        self, messenger: Messenger, anchors: AnchorManager, mux: MuxTransport | None
    ) -> None:
        self.messenger = messenger
        self.anchors = anchors
        self.mux = mux

    @classmethod
    async def start(
        cls,
        credentials: NodeCredentials | str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: TransportConfig | None = None,
        messenger: MessengerConfig | None = None,
        streaming: StreamingConfig | None = None,
        mux: MuxConfig | None = None,
        registry: CollectorRegistry | None = None,
        peers: PeerRegistry | None = None,
        discovery: PeerDiscovery | None = None,
        name: str = "",
    ) -> Node:
        """Start a node from its credentials (or the directory holding them)."""
        if not isinstance(credentials, NodeCredentials):
            credentials = NodeCredentials.load(credentials)
        node_messenger = await Messenger.start(
            credentials,
            host=host,
            port=port,
            config=messenger,
            transport_config=transport,
            registry=registry,
            peers=peers,
            discovery=discovery,
            name=name or credentials.name,
        )
        mux = mux or MuxConfig()
        try:
            enabled = mux.effective_enabled()  # a disabled mux-only node fails here
            anchors = AnchorManager(node_messenger, streaming, per_stream=not mux.mux_only)
            mux_transport = MuxTransport(node_messenger, mux) if enabled else None
            if mux_transport is not None:
                anchors.install_transport(mux_transport)
        except BaseException:
            await node_messenger.close()
            raise
        return cls(node_messenger, anchors, mux_transport)

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- identity ------------------------------------------------------------------------

    @property
    def instance_id(self) -> InstanceId:
        return self.messenger.instance_id

    @property
    def worker_id(self) -> WorkerId:
        return self.anchors.worker_id

    @property
    def address(self) -> tuple[str, int]:
        return self.messenger.address

    @property
    def registry(self) -> CollectorRegistry:
        return self.messenger.registry

    def add_peer(self, instance_id: InstanceId, address: tuple[str, int], name: str = "") -> None:
        self.messenger.add_peer(instance_id, address, name)

    def remove_peer(self, instance_id: InstanceId) -> None:
        """Evict a peer: forget its address; every stream this node produces to it ends
        (epoch death on its lanes), so its senders' cancel tokens fire and sends fail."""
        self.messenger.remove_peer(instance_id)

    # -- streams -------------------------------------------------------------------------

    def create_anchor(self, *, unattached_timeout: float | None = None) -> StreamAnchor[Any]:
        return self.anchors.create_anchor(unattached_timeout=unattached_timeout)

    def create_mpsc_anchor(self, **options: Any) -> MpscAnchor:
        return self.anchors.create_mpsc_anchor(**options)

    async def attach_anchor(self, handle: StreamAnchorHandle) -> StreamSender:
        return await self.anchors.attach_anchor(handle)

    async def attach_mpsc_anchor(self, handle: StreamAnchorHandle) -> StreamSender:
        return await self.anchors.attach_mpsc_anchor(handle)

    async def attach_anchor_keyed(self, handle: StreamAnchorHandle, key: int) -> StreamSender:
        """Attach asking the receiver to place the stream on lane ``splitmix64(key) % lanes``:
        streams with one key to one receiver share a lane (a placement hint only)."""
        return await self.anchors.attach_anchor(handle, key=key)

    async def attach_mpsc_anchor_keyed(self, handle: StreamAnchorHandle, key: int) -> StreamSender:
        return await self.anchors.attach_mpsc_anchor(handle, key=key)

    # -- zero-RTT streams ----------------------------------------------------------------

    def prebind_anchor(self, handle: StreamAnchorHandle) -> StreamOpenTicket:
        """Bind the anchor's mux slot now and return the ticket a producer opens it with
        (:meth:`open_anchor_stream`), saving the attach round trip. Raises TicketError
        without a mux, or when the anchor cannot be pre-bound (MPSC, already attached,
        another node's)."""
        return self.anchors.prebind_anchor(handle)

    def prebind_anchor_keyed(self, handle: StreamAnchorHandle, key: int) -> StreamOpenTicket:
        return self.anchors.prebind_anchor(handle, key=key)

    async def open_anchor_stream(
        self, handle: StreamAnchorHandle, ticket: StreamOpenTicket
    ) -> StreamSender:
        """Producer side of a ticket: open the stream with no attach message."""
        return await self.anchors.open_anchor_stream(handle, ticket)

    def flush_batch(self) -> None:
        """Kick every mux batcher to write what is staged (one write per peer per pass).
        Never blocks, never fails; with no mux installed it does nothing."""
        if self.mux is not None:
            self.mux.flush_batch()

    def metrics_text(self) -> str:
        """The node's metrics in the Prometheus text format."""
        return generate_latest(self.registry).decode()

    async def close(self) -> None:
        """Cancel the node's streams, then close its messenger and transport."""
        await self.anchors.close()
        await self.messenger.close()
