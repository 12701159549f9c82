"""The contract between the anchor manager and a streaming transport, and their registry.

A streaming transport moves one stream's records from a producer's node to the anchor.
The attach handler chooses one by key (negotiation), asks it to :meth:`~StreamTransport.bind`
the consumer's end, and answers the producer with the terms the bind returned; the producer
then calls :meth:`~StreamTransport.connect` with that answer and gets the channel its
sender writes into. Two implement it: the per-stream QUIC path (``quic-stream-v1``) and the
messenger mux (``messenger-mux-v2``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..ids import InstanceId, StreamAnchorHandle

if TYPE_CHECKING:
    from .anchor import AnchorEntry, RemoteSender
    from .channels import ProducerChannel

__all__ = ["AttachTerms", "BindTerms", "PrebindTransport", "StreamTransport", "TransportRegistry"]


@dataclass(frozen=True, slots=True)
class BindTerms:
    """What a bind adds to the attach answer (zeros mean "not this feature")."""

    initial_credit: int = 0
    slot_byte_budget: int = 0
    lane: int = 0


@dataclass(frozen=True, slots=True)
class AttachTerms:
    """What the producer learned from the attach answer, handed to ``connect``."""

    peer: InstanceId
    handle: StreamAnchorHandle
    routing_session_id: int
    heartbeat_interval: float
    sender_id: int
    initial_credit: int = 0
    slot_byte_budget: int = 0
    lane: int = 0


class StreamTransport(Protocol):
    """One way of moving a stream's records (see the module docstring)."""

    @property
    def key(self) -> str:
        """The transport key negotiated in the attach (``quic-stream-v1``, ...)."""

    def bind(self, entry: AnchorEntry, remote: RemoteSender) -> BindTerms:
        """Consumer side: expect ``remote``'s records for ``entry`` (the attach handler)."""

    def unbind(self, entry: AnchorEntry, remote: RemoteSender) -> None:
        """Consumer side: forget a bind (anchor finished, watchdog fired, detach read)."""

    async def connect(self, terms: AttachTerms) -> ProducerChannel:
        """Producer side: open the channel the sender writes into."""

    async def close(self) -> None:
        """Release everything (the node is closing)."""


@runtime_checkable
class PrebindTransport(StreamTransport, Protocol):
    """A transport that can bind a stream before any sender asks (the mux): what the
    zero-RTT pre-bind, its adoption by an attach, and stops and cancels of a stream opened
    with a ticket (whose producer has no cancel handle) need from it."""

    on_bind_expired: Callable[[AnchorEntry, RemoteSender], None] | None
    """Called when a pre-bind's accept window closed unclaimed (the manager reaps it)."""

    def adopt(self, entry: AnchorEntry, remote: RemoteSender, peer: InstanceId) -> BindTerms:
        """An ordinary attach from ``peer`` takes over the unclaimed pre-bind ``remote``."""

    def claimed(self, entry: AnchorEntry, remote: RemoteSender) -> bool:
        """Whether a ticket's first batch already claimed the bind of ``remote``."""

    def post_stream_lifecycle(
        self, entry: AnchorEntry, remote: RemoteSender, *, stop: bool
    ) -> None:
        """Tell a ticket-opened stream's producer to stop (gracefully) or cancel."""


class TransportRegistry:
    """Installed transports by key; the per-stream one is the default for old senders."""

    def __init__(self, default_key: str) -> None:
        self._transports: dict[str, StreamTransport] = {}
        self.default_key = default_key

    def install(self, transport: StreamTransport) -> None:
        if transport.key in self._transports:
            raise ValueError(f"a transport with key {transport.key!r} is already installed")
        self._transports[transport.key] = transport

    def get(self, key: str) -> StreamTransport | None:
        return self._transports.get(key)

    def keys(self) -> list[str]:
        return sorted(self._transports)

    def __iter__(self) -> Iterator[StreamTransport]:
        return iter(list(self._transports.values()))
