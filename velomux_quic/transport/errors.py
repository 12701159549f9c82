"""Typed errors of the transport layer.

Every refusal a caller can see has its own class, so the layers above can tell
"the connection went away, dial again" from "the peer is not who we meant" from
"you sent something too large", without parsing messages.
"""

from __future__ import annotations

__all__ = [
    "AdmissionCancelled",
    "AdmissionError",
    "ChannelClosed",
    "ConnectionReplaced",
    "DialError",
    "LaneError",
    "MessageTooLarge",
    "PeerNotRegistered",
    "RequestRefused",
    "ResponseTooLarge",
    "TransportClosed",
    "TransportError",
]


class TransportError(Exception):
    """Base of every error the transport raises."""


class AdmissionError(TransportError):
    """A send that was not admitted and never will be; the frame never reached the wire."""


class ChannelClosed(AdmissionError):
    """The connection (or the whole transport) closed before the frame was admitted."""


class ConnectionReplaced(AdmissionError):
    """The connection the frame waited on was replaced by a newer one to the same peer."""


class AdmissionCancelled(AdmissionError):
    """The sender cancelled the admission explicitly."""


class DialError(TransportError):
    """A connection to a peer could not be established (handshake refused, timeout, ...).

    ``reason`` is a short machine-readable code (for example ``identity_mismatch``,
    ``handshake_timeout``, ``refused``); the message says it in words.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerNotRegistered(TransportError):
    """No address is known for that peer; register it (or use discovery) first."""


class TransportClosed(TransportError):
    """The transport was closed; it cannot send or dial any more."""


class LaneError(TransportError, ValueError):
    """A lane index outside ``0 .. lanes-1`` (at most 16 lanes)."""


class MessageTooLarge(TransportError, ValueError):
    """A frame larger than ``max_message_size``; refused before anything was queued."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds max_message_size {limit}")
        self.length = length
        self.limit = limit


class RequestRefused(TransportError):
    """The peer refused (reset) a request stream, or has nothing to serve it."""


class ResponseTooLarge(TransportError):
    """A request stream's response grew past the size the requester allowed."""
