"""What state a connection is in, and the codes it closes with.

:class:`ConnectionState` is the connection's lifecycle (handshaking, established, closing,
closed) and :class:`CloseCode` the application error codes it puts in CONNECTION_CLOSE,
RESET_STREAM and STOP_SENDING. They are read by the connection (:mod:`.connection`), its
:class:`~.events.PeerLink` and the layers above that refuse a stream with a code, so they
live apart from all of them; :mod:`.connection` re-exports them.
"""

from __future__ import annotations

import enum

__all__ = ["CloseCode", "ConnectionState"]


class CloseCode(enum.IntEnum):
    """Application error codes we put in CONNECTION_CLOSE."""

    NO_ERROR = 0
    SHUTDOWN = 0x101
    FRAME_TOO_LARGE = 0x102
    UNVERIFIED_PEER = 0x103
    REPLACED = 0x104
    HANDSHAKE_TIMEOUT = 0x105
    KILLED = 0x106
    """Closed abruptly on request (tests and operators cutting a connection)."""
    UNACKNOWLEDGED = 0x107
    """The peer kept the connection alive without acknowledging what it was sent."""
    READER_BEHIND = 0x108
    """A stream stopped because its reader fell too far behind on an engine that cannot
    hold one stream back alone (qh3; see ``EngineFeatures.receive_backpressure``)."""


class ConnectionState(enum.Enum):
    HANDSHAKING = "handshaking"
    ESTABLISHED = "established"
    CLOSING = "closing"
    CLOSED = "closed"
