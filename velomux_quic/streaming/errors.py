"""Typed errors of the streaming layer, as the reference names them.

A consumer sees :class:`StreamError` subclasses from its anchor; a producer sees
:class:`SendError` subclasses from ``send``; an attach that fails raises an
:class:`AttachError` subclass that says why.
"""

from __future__ import annotations

from ..ids import StreamAnchorHandle

__all__ = [
    "AlreadyAttached",
    "AnchorNotFound",
    "AttachError",
    "AttachRefused",
    "ChannelClosed",
    "DeserializationError",
    "MaxSendersReached",
    "SendError",
    "SenderDropped",
    "SenderError",
    "SerializationError",
    "StreamCancelled",
    "StreamError",
    "StreamTransportError",
    "WrongHandleKind",
]


class StreamError(Exception):
    """What a consumer's anchor raises instead of yielding an item."""


class SenderError(StreamError):
    """The producer reported a soft error (``send_err``); the stream goes on."""


class SenderDropped(StreamError):
    """The producer vanished without finishing (dropped, watchdog, connection loss)."""


class StreamTransportError(StreamError):
    """Unrecoverable delivery failure or protocol violation; the stream is over."""


class DeserializationError(StreamError):
    """A frame could not be decoded; the stream is over."""


class StreamCancelled(StreamError):
    """The consumer cancelled the anchor (or it was removed); no more items will come."""


class SendError(Exception):
    """What a producer's ``send`` raises."""


class ChannelClosed(SendError):
    """The consumer is gone, cancelled the stream, or the stream's channel closed."""


class SerializationError(SendError, ValueError):
    """The item could not be encoded as MessagePack."""


class AttachError(Exception):
    """An attach that did not produce a sender."""

    def __init__(self, message: str, handle: StreamAnchorHandle | None = None) -> None:
        super().__init__(message)
        self.handle = handle


class AnchorNotFound(AttachError):
    """No such anchor on the consumer's node (never created, finished or cancelled)."""


class AlreadyAttached(AttachError):
    """The single-sender anchor already has a live sender."""


class MaxSendersReached(AttachError):
    """The MPSC anchor's ``max_senders`` cap is reached."""


class WrongHandleKind(AttachError):
    """An SPSC handle given to an MPSC call or the reverse (detected locally)."""


class AttachRefused(AttachError):
    """The attach failed for another reason: no common transport, unreachable node, ..."""
