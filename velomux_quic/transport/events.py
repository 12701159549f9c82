"""What the transport tells the layers above about streams that are not lanes.

The per-stream path (``velomux_quic.streaming.perstream``) opens QUIC streams of its own
beside the lanes; what arrives on them is reported to the :class:`TransportHandler
<velomux_quic.transport.endpoint.TransportHandler>` as these small events, never as
an engine's, and together with a :class:`PeerLink`: the layer above's handle on the
connection that carried them. So no layer above the transport imports a QUIC engine,
and an engine upgrade that changes its event classes changes its adapter only.

The events are frozen and carry exactly what the layer above reads. They are built once
per STREAM frame on a non-lane stream (lanes never build one: their bytes go straight
into the lane's frame decoder), which costs about what an engine's own event costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..ids import InstanceId
from .states import CloseCode

__all__ = ["LinkedConnection", "PeerLink", "StreamData", "StreamReset", "StreamStopped"]


@dataclass(frozen=True, slots=True)
class StreamData:
    """Bytes that arrived, in order, on a stream the peer opened toward us."""

    stream_id: int
    data: bytes
    end_stream: bool
    """The peer finished the stream (FIN): no more data will follow on it."""


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The peer aborted a stream it was writing to us (RESET_STREAM): what is lost is lost."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class StreamStopped:
    """The peer asked us to stop writing a stream we opened (STOP_SENDING); it is reset."""

    stream_id: int


class LinkedConnection(Protocol):
    """What a :class:`PeerLink` asks of the connection it stands for (narrow on purpose)."""

    def manage_receive_window(
        self, stream_id: int, consumed: Callable[[], int], window: int
    ) -> None: ...

    def stop_receiving(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None: ...

    def transmit_soon(self) -> None: ...


class PeerLink:
    """One verified connection as the layers above see it: its peer and its stream controls.

    Handed to the handler with every stream event. It is stable for the connection's
    lifetime and hashes by identity, so ``(link, stream_id)`` keys a stream in a dict and
    ``link is other`` tells two connections from the same peer apart (a peer that
    reconnects gets a new link). It offers only what a receiver of its own streams needs:
    the receive window, refusing a stream, and a prompt transmit of granted credit.
    """

    __slots__ = ("_connection", "outbound", "peer")

    def __init__(self, peer: InstanceId, outbound: bool, connection: LinkedConnection) -> None:
        self.peer = peer
        """The peer's InstanceId, proven by its certificate."""
        self.outbound = outbound
        """True on a connection this node dialed (it sends on those, and receives on the
        ones it accepted; see docs/architecture.md)."""
        self._connection = connection

    def manage_receive_window(
        self, stream_id: int, consumed: Callable[[], int], window: int
    ) -> None:
        """Grant the peer ``consumed() + window`` bytes on ``stream_id`` from now on.

        Without this QUIC's stack doubles a stream's window whenever the peer has used half
        of it, read or not, so a reader could never hold its writer back. ``consumed`` is
        read when a packet is built (never per record): return the bytes the reader took.
        Call it before the stream's data is consumed, once per stream.
        """
        self._connection.manage_receive_window(stream_id, consumed, window)

    def grant_soon(self) -> None:
        """Send what the reader's consumption granted in the next transmit, not later.

        A managed window is advertised only when a packet leaves; a reader that consumed
        a good share of its window calls this so the peer hears of it promptly.
        """
        self._connection.transmit_soon()

    def stop_receiving(self, stream_id: int, code: CloseCode = CloseCode.SHUTDOWN) -> None:
        """Refuse a stream the peer writes (STOP_SENDING) and forget its window."""
        self._connection.stop_receiving(stream_id, code)

    def __repr__(self) -> str:
        return f"PeerLink({self.peer}, {'outbound' if self.outbound else 'inbound'})"
