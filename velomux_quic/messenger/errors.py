"""Typed errors of the messenger: each way a call can fail has its own class."""

from __future__ import annotations

__all__ = [
    "CallError",
    "HandlerExists",
    "HandlerFailed",
    "MessengerClosed",
    "MessengerError",
    "PeerGone",
    "RemoteRefused",
    "StagingFull",
    "UnaryTimeout",
    "UnknownHandler",
]


class MessengerError(Exception):
    """Base of every error the messenger raises."""


class HandlerExists(MessengerError, ValueError):
    """A handler of that name is already registered (or the name is reserved)."""


class StagingFull(MessengerError):
    """Staging the payload would exceed the node's ``max_staged_bytes``."""


class CallError(MessengerError):
    """A call (``am_sync`` or ``unary``) did not produce an answer."""

    def __init__(self, message: str, *, peer: object = None, handler: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.handler = handler


class MessengerClosed(CallError):
    """The messenger was closed; it neither sends nor waits for answers any more."""


class UnknownHandler(CallError):
    """The peer has no handler of that name."""


class HandlerFailed(CallError):
    """The peer's handler raised; ``remote_message`` is what it said."""

    def __init__(
        self, message: str, *, remote_message: str, peer: object = None, handler: str = ""
    ) -> None:
        super().__init__(message, peer=peer, handler=handler)
        self.remote_message = remote_message


class RemoteRefused(CallError):
    """The peer refused the message (malformed, too large to stage, shutting down)."""


class UnaryTimeout(CallError, TimeoutError):
    """No answer within the call's timeout."""


class PeerGone(CallError):
    """The peer could not be reached, or its connection died while we waited."""
