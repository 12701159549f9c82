"""The transport layer's errors, defined in :mod:`velomux_quic.errors` and named here too.

Every refusal a caller can see has its own class, so the layers above can tell
"the connection went away, dial again" from "the peer is not who we meant" from
"you sent something too large", without parsing messages.
"""

from __future__ import annotations

from ..errors import (
    AdmissionCancelled,
    AdmissionError,
    ChannelClosed,
    ConnectionReplaced,
    DialError,
    LaneError,
    MessageTooLarge,
    PeerNotRegistered,
    RequestRefused,
    ResponseTooLarge,
    TransportClosed,
    TransportError,
)

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
