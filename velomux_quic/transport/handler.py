"""What the layer above hears from the transport: :class:`TransportHandler`.

It is its own module because both ends use it: the endpoint takes one when it starts, and
every connection calls it as frames and stream events arrive. Everything it is given is
the transport's own (InstanceIds, lanes, bytes, :mod:`.events`); nothing from an engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from ..errors import RequestRefused, TransportError
from ..ids import InstanceId
from .events import PeerLink, StreamData, StreamReset, StreamStopped

if TYPE_CHECKING:
    from .config import TransportConfig
    from .metrics import TransportStats

__all__ = ["EndpointServices", "TransportHandler"]

logger = logging.getLogger(__name__)


class EndpointServices(Protocol):
    """What a connection's parts ask of the node's endpoint: its configuration, the
    handler the layers above installed, and the counters they add to."""

    @property
    def config(self) -> TransportConfig: ...

    @property
    def handler(self) -> TransportHandler: ...

    @property
    def stats(self) -> TransportStats: ...


class TransportHandler:
    """What the layer above hears from the transport. Override what you need.

    Every method is called on the event loop, synchronously, and must not block:
    ``frame_received`` in particular runs once per frame on the receive path. The
    defaults ignore what they are told, except that a stream nobody claims is refused.
    """

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        """A whole frame arrived from a verified ``peer`` on ``lane``, in lane order.

        The body is exactly what the peer's ``send`` was given; the frames of one lane
        arrive in the order they were admitted, and those of different lanes independently.
        """

    def lane_reset(self, peer: InstanceId, lane: int) -> None:
        """The peer aborted one lane's stream; frames in flight on it are lost.

        The next frame on that lane starts a new stream: state kept per lane (a decoder,
        a table of slots) must be dropped here.
        """

    def send_failed(self, peer: InstanceId, lane: int, error: TransportError) -> None:
        """Admitted data was lost (its connection died before acknowledging it).

        A send that returned ``ADMITTED`` cannot raise any more, so this is the only place
        such a loss shows; the default logs it.
        """
        logger.warning("send to %s on lane %d failed after admission: %s", peer, lane, error)

    def peer_connected(self, peer: InstanceId, outbound: bool) -> None:
        """A connection to (outbound) or from (inbound) ``peer`` completed mutual TLS.

        ``peer`` is proven by its certificate; this is where the layer above learns that
        it may now send to it (outbound) or hear from it (inbound).
        """

    def peer_disconnected(self, peer: InstanceId, outbound: bool) -> None:
        """A connection to or from ``peer`` ended, so what waits on it will never come.

        Called after :meth:`connection_lost`; a later send dials again.
        """

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        """Data on a stream the peer opened that is not a lane; return True to claim it.

        The layers above may carry streams of their own beside the lanes (the per-stream
        path does); ``link`` is the connection they arrived on and what controls them.
        The default refuses: the transport then stops the stream (STOP_SENDING) without
        harming the connection.
        """
        return False

    def stream_reset(self, link: PeerLink, event: StreamReset) -> None:
        """The peer aborted a non-lane stream it was writing to us (a claimed one).

        Whatever the receiver buffered is all it will get.
        """

    def stream_stopped(self, link: PeerLink, event: StreamStopped) -> None:
        """The peer asked us to stop writing a stream we opened (see ``open_stream``).

        The transport has already reset the stream and refused its waiting sends; this is
        for the layer above to forget it.
        """

    def connection_lost(self, link: PeerLink) -> None:
        """An established connection ended (before :meth:`peer_disconnected` is called).

        Every stream claimed on ``link`` is over: nothing more will arrive on it.
        """

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        """Answer a request stream the accepting side opened toward us (see ``request``).

        This is how a peer pulls bytes from the node that dialed it without a lane of its
        own. Raise to refuse: the requester gets :class:`RequestRefused`.
        """
        raise RequestRefused("this node serves no requests")
