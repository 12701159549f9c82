"""The messenger: active messages between nodes over the QUIC transport.

Handlers by name (inline, ordered per (sender, lane), or spawned), fire-and-forget,
acknowledged and unary calls with typed remote errors, rendezvous for large payloads,
and the peer registry that maps identities to addresses.
"""

from .config import MessengerConfig
from .envelope import Kind, MuxSlotRef
from .errors import (
    CallError,
    HandlerExists,
    HandlerFailed,
    MessengerClosed,
    PeerGone,
    RemoteRefused,
    StagingFull,
    UnaryTimeout,
    UnknownHandler,
)
from .messenger import Messenger, StagedRefusal
from .peers import DirectoryPeers, PeerDiscovery, PeerRecord, PeerRegistry, StaticPeers
from .registry import BATCH_HANDLER_NAMES, Context, batch_handler_name

__all__ = [
    "BATCH_HANDLER_NAMES",
    "CallError",
    "Context",
    "DirectoryPeers",
    "HandlerExists",
    "HandlerFailed",
    "Kind",
    "Messenger",
    "MessengerClosed",
    "MessengerConfig",
    "MuxSlotRef",
    "PeerDiscovery",
    "PeerGone",
    "PeerRecord",
    "PeerRegistry",
    "RemoteRefused",
    "StagedRefusal",
    "StagingFull",
    "StaticPeers",
    "UnaryTimeout",
    "UnknownHandler",
    "batch_handler_name",
]
