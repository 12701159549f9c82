"""The QUIC transport: one UDP endpoint per node, mutual TLS, ordered lanes, admission gates.

Everything aioquic-specific stays inside this package and ``velomux_quic.security``; the
layers above see :class:`QuicTransport`, :class:`TransportHandler` and the admission types.
"""

from .admission import ADMITTED, AdmissionState, Admitted, SendAdmission, SendOutcome
from .config import MAX_LANES, TransportConfig
from .endpoint import Address, QuicTransport, TransportHandler
from .errors import (
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
    "ADMITTED",
    "MAX_LANES",
    "Address",
    "AdmissionCancelled",
    "AdmissionError",
    "AdmissionState",
    "Admitted",
    "ChannelClosed",
    "ConnectionReplaced",
    "DialError",
    "LaneError",
    "MessageTooLarge",
    "PeerNotRegistered",
    "QuicTransport",
    "RequestRefused",
    "ResponseTooLarge",
    "SendAdmission",
    "SendOutcome",
    "TransportClosed",
    "TransportConfig",
    "TransportError",
    "TransportHandler",
]
