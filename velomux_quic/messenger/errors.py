"""The messenger's errors, defined in :mod:`velomux_quic.errors` and named here too.

Each way a call can fail has its own :class:`CallError` subclass.
"""

from __future__ import annotations

from ..errors import (
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

__all__ = [
    "CallError",
    "HandlerExists",
    "HandlerFailed",
    "MessengerClosed",
    "PeerGone",
    "RemoteRefused",
    "StagingFull",
    "UnaryTimeout",
    "UnknownHandler",
]
