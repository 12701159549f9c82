"""The QUIC transport: one UDP endpoint per node, mutual TLS, ordered lanes, admission gates.

Everything engine-specific stays in its adapter (:mod:`.aioquic_engine`,
:mod:`.qh3_engine`) and the TLS hooks of ``velomux_quic.security``; the layers above see
:class:`QuicTransport`, :class:`TransportHandler`, the admission types, the stream events
of :mod:`.events` with their :class:`PeerLink`, the per-stream path's
:class:`PerStreamOutbound` and the :class:`TransportSnapshot` of
:meth:`QuicTransport.snapshot`.
"""

from .admission import ADMITTED, AdmissionState, Admitted, SendAdmission, SendOutcome
from .config import MAX_LANES, TransportConfig
from .endpoint import Address, QuicTransport
from .events import PeerLink, StreamData, StreamReset, StreamStopped
from .framing import FrameDecoder
from .handler import TransportHandler
from .lanes import CONTROL_LANE, lane_of_stream
from .perstream_send import PerStreamOutbound
from .snapshot import ConnectionSnapshot, TransportSnapshot
from .states import CloseCode

__all__ = [
    "ADMITTED",
    "CONTROL_LANE",
    "MAX_LANES",
    "Address",
    "AdmissionState",
    "Admitted",
    "CloseCode",
    "ConnectionSnapshot",
    "FrameDecoder",
    "PeerLink",
    "PerStreamOutbound",
    "QuicTransport",
    "SendAdmission",
    "SendOutcome",
    "StreamData",
    "StreamReset",
    "StreamStopped",
    "TransportConfig",
    "TransportHandler",
    "TransportSnapshot",
    "lane_of_stream",
]
