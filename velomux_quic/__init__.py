"""velomux_quic: batched, credit-controlled streaming between cluster nodes over mutual-TLS QUIC.

Everything an application uses is importable from here, and ``__all__`` is the contract;
the subpackages are the implementation and may change::

    from velomux_quic import open_node, StreamError

    async with open_node("certs/dev/node-b") as b, \\
               open_node("certs/dev/node-a", peers=[b.record]) as a:
        anchor = b.create_anchor()
        sender = await a.attach_anchor(anchor.handle)
        await sender.send({"token": 1})
        await sender.finalize()
        async for item in anchor:   # raises a StreamError subclass if the stream breaks
            ...

Every exception the library raises on purpose derives from :class:`VelomuxError`; the
branches (``ConfigurationError``, ``TransportError``, ``CallError``, ``AttachError``,
``StreamError``, ``SendError``, ``UsageError``, ``ProtocolError``, ...) are listed in
:mod:`velomux_quic.errors` and docs/errors.md.

The package logs through ``logging.getLogger(__name__)`` loggers and installs a
NullHandler, so an application that does not configure logging hears nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

# First: its finder chooses the file each compiled module of the record path loads from.
from . import recordpath as _recordpath  # noqa: F401
from .config import NodeConfig
from .discovery import (
    DirectoryPeers,
    DiscoveryConfig,
    EtcdPeers,
    PeerDiscovery,
    PeerEntry,
    PeerRecord,
    StaticPeers,
)
from .errors import (
    AdmissionCancelled,
    AdmissionError,
    AlreadyAttached,
    AnchorNotFound,
    AttachError,
    AttachRefused,
    CallError,
    CallPeerNotRegistered,
    CapacityError,
    ChannelClosed,
    ConfigurationError,
    ConnectionReplaced,
    ControlDecodeError,
    CredentialsError,
    DeserializationError,
    DialError,
    FrameDecodeError,
    FrameTooLarge,
    FramingError,
    HandlerExists,
    HandlerFailed,
    LaneError,
    MalformedBatch,
    MalformedEnvelope,
    MaxSendersReached,
    MessageTooLarge,
    MessengerClosed,
    PeerGone,
    PeerNotRegistered,
    PeerRecordError,
    PeerVerificationError,
    ProtocolError,
    ProtocolErrorCode,
    ReadTimeout,
    RefusalReason,
    RemoteRefused,
    RequestRefused,
    ResponseTooLarge,
    SenderDropped,
    SenderError,
    SendError,
    SendTimeout,
    SerializationError,
    SlotsExhausted,
    StagingFull,
    StreamCancelled,
    StreamError,
    StreamTransportError,
    TicketError,
    TransportClosed,
    TransportError,
    UnaryTimeout,
    UnknownHandler,
    UsageError,
    VelomuxError,
    WorkerIdCollision,
    WrongHandleKind,
)
from .ids import InstanceId, StreamAnchorHandle, WorkerId
from .messenger import MessengerConfig, PeerRegistry
from .messenger.registry import Context, Dispatch
from .mux.config import (
    AutoFlush,
    FlushPolicy,
    Manual,
    MuxConfig,
)
from .node import Node, NodeSnapshot, RuntimeInfo, open_node, runtime_info
from .ops import OpsConfig, ReadinessReport
from .security.certs import NodeCredentials, ensure_dev_cluster
from .streaming.anchor import (
    MpscAnchor,
    MpscEvent,
    MpscItem,
    StreamAnchor,
)
from .streaming.config import StreamingConfig
from .streaming.control import MESSENGER_MUX_KEY, PER_STREAM_KEY, StreamOpenTicket
from .streaming.sender import PassOutcome, Retired, StreamSender
from .transport.config import TransportConfig

__version__ = "0.1.0"

__all__ = [
    "MESSENGER_MUX_KEY",
    "PER_STREAM_KEY",
    "AdmissionCancelled",
    "AdmissionError",
    "AlreadyAttached",
    "AnchorNotFound",
    "AttachError",
    "AttachRefused",
    "AutoFlush",
    "CallError",
    "CallPeerNotRegistered",
    "CapacityError",
    "ChannelClosed",
    "ConfigurationError",
    "ConnectionReplaced",
    "Context",
    "ControlDecodeError",
    "CredentialsError",
    "DeserializationError",
    "DialError",
    "DirectoryPeers",
    "DiscoveryConfig",
    "Dispatch",
    "EtcdPeers",
    "FlushPolicy",
    "FrameDecodeError",
    "FrameTooLarge",
    "FramingError",
    "HandlerExists",
    "HandlerFailed",
    "InstanceId",
    "LaneError",
    "MalformedBatch",
    "MalformedEnvelope",
    "Manual",
    "MaxSendersReached",
    "MessageTooLarge",
    "MessengerClosed",
    "MessengerConfig",
    "MpscAnchor",
    "MpscEvent",
    "MpscItem",
    "MuxConfig",
    "Node",
    "NodeConfig",
    "NodeCredentials",
    "NodeSnapshot",
    "OpsConfig",
    "PassOutcome",
    "PeerDiscovery",
    "PeerEntry",
    "PeerGone",
    "PeerNotRegistered",
    "PeerRecord",
    "PeerRecordError",
    "PeerRegistry",
    "PeerVerificationError",
    "ProtocolError",
    "ProtocolErrorCode",
    "ReadTimeout",
    "ReadinessReport",
    "RefusalReason",
    "RemoteRefused",
    "RequestRefused",
    "ResponseTooLarge",
    "Retired",
    "RuntimeInfo",
    "SendError",
    "SendTimeout",
    "SenderDropped",
    "SenderError",
    "SerializationError",
    "SlotsExhausted",
    "StagingFull",
    "StaticPeers",
    "StreamAnchor",
    "StreamAnchorHandle",
    "StreamCancelled",
    "StreamError",
    "StreamOpenTicket",
    "StreamSender",
    "StreamTransportError",
    "StreamingConfig",
    "TicketError",
    "TransportClosed",
    "TransportConfig",
    "TransportError",
    "UnaryTimeout",
    "UnknownHandler",
    "UsageError",
    "VelomuxError",
    "WorkerId",
    "WorkerIdCollision",
    "WrongHandleKind",
    "__version__",
    "ensure_dev_cluster",
    "open_node",
    "runtime_info",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from .node import NodeOptions as NodeOptions  # deprecated: NodeConfig declares the settings
else:

    def __getattr__(name: str) -> object:
        # The deprecated name warns where it is used (velomux_quic.node says what replaces
        # it); hidden from type checkers, to which a module __getattr__ would make every
        # misspelt name of the package an Any.
        if name == "NodeOptions":
            from .node import _deprecated_node_options

            return _deprecated_node_options(stacklevel=3)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
