"""The QUIC transport: one UDP endpoint per node, mutual TLS, ordered lanes, admission gates.

Everything engine-specific stays in its adapter (:mod:`.aioquic_engine`,
:mod:`.qh3_engine`) and the TLS hooks of ``velomux_quic.security``; the layers above see
:class:`QuicEndpoint`, :class:`TransportHandler`, the admission types, the stream events
of :mod:`.events` with their :class:`PeerLink`, the per-stream path's
:class:`PerStreamOutbound` and the :class:`TransportSnapshot` of
:meth:`QuicEndpoint.snapshot`.
"""

import warnings
from typing import TYPE_CHECKING

from .admission import ADMITTED, AdmissionState, Admitted, SendAdmission, SendOutcome
from .config import MAX_LANES, TransportConfig
from .endpoint import Address, QuicEndpoint
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
    "QuicEndpoint",
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

if TYPE_CHECKING:
    QuicTransport = QuicEndpoint
    """Deprecated: the endpoint's old name."""
else:

    def __getattr__(name: str) -> object:
        # The old name warns where it is used; hidden from type checkers, to which a
        # module __getattr__ would make every misspelt name of the package an Any.
        if name == "QuicTransport":
            warnings.warn(
                "velomux_quic.transport.QuicTransport is now QuicEndpoint (the node's UDP "
                "endpoint; 'transport' names the layer and the chapter's frame transports); "
                "the old name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return QuicEndpoint
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
