"""The streaming layer's errors, defined in :mod:`velomux_quic.errors` and named here too.

A consumer sees :class:`StreamError` subclasses from its anchor; a producer sees
:class:`SendError` subclasses from ``send``; an attach that fails raises an
:class:`AttachError` subclass that says why.
"""

from __future__ import annotations

from ..errors import (
    AlreadyAttached,
    AnchorNotFound,
    AttachError,
    AttachRefused,
    ChannelClosed,
    DeserializationError,
    MaxSendersReached,
    ReadTimeout,
    SenderDropped,
    SenderError,
    SendError,
    SendTimeout,
    SerializationError,
    StreamCancelled,
    StreamError,
    StreamTransportError,
    TicketError,
    UsageError,
    WrongHandleKind,
)

__all__ = [
    "AlreadyAttached",
    "AnchorNotFound",
    "AttachError",
    "AttachRefused",
    "ChannelClosed",
    "DeserializationError",
    "MaxSendersReached",
    "ReadTimeout",
    "SendError",
    "SendTimeout",
    "SenderDropped",
    "SenderError",
    "SerializationError",
    "StreamCancelled",
    "StreamError",
    "StreamTransportError",
    "TicketError",
    "UsageError",
    "WrongHandleKind",
]
