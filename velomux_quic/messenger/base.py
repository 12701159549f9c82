"""What the parts of the Messenger share: their common state and the calls between them.

:class:`~velomux_quic.messenger.messenger.Messenger` is one class assembled from parts that
each own one concern: sending (:mod:`.outbound`), receiving and dispatch
(:mod:`.inbound`) and rendezvous for large payloads (:mod:`.rendezvous`). They are mixed
into the one class rather than held as separate objects so that the per-message path
costs exactly what it would in a single class: ``self._send`` and ``self._deliver`` stay
one method lookup each, with no other object's attribute to load and no forwarding call.

This base is the contract between the parts. It declares the state more than one part
reads (the :class:`Messenger` constructor sets it), provides the two helpers every part
may use, and declares, for the type checker only, the methods one part calls on another.
Nothing here runs per message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from ..transport import QuicTransport, TransportHandler
from .errors import MessengerClosed

if TYPE_CHECKING:
    from ..ids import InstanceId
    from ..transport import SendOutcome
    from .calls import PendingCalls
    from .config import MessengerConfig
    from .envelope import Envelope, Kind
    from .metrics import MessengerMetrics
    from .peers import PeerDiscovery
    from .registry import Context, HandlerRegistry
    from .staging import StagingStore

__all__ = ["LOGGER_NAME", "MessengerBase"]

LOGGER_NAME = "velomux_quic.messenger.messenger"
"""The logger every part of the Messenger writes to, named after the module that assembles
them, so one logging setting covers the whole messenger whichever part writes the record.
(Each part binds it to a module global of its own rather than importing one: CPython
compiles ``logger.warning(...)`` on an imported name as an attribute load that builds a
bound method, where a module's own global gets the cheaper method call.)"""


class MessengerBase(TransportHandler):
    """The state and cross-part calls of the Messenger; see the module docstring."""

    config: MessengerConfig
    metrics: MessengerMetrics
    handlers: HandlerRegistry
    _transport: QuicTransport | None
    _calls: PendingCalls
    _staging: StagingStore
    _discovery: PeerDiscovery | None
    _background: set[asyncio.Task[Any]]
    _closed: bool

    @property
    def transport(self) -> QuicTransport:
        if self._transport is None:
            raise MessengerClosed("the messenger has not been started")
        return self._transport

    def _background_task(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``coro`` as a task the messenger's close cancels and awaits."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    if TYPE_CHECKING:
        # Defined by the parts named in each comment; declared here so the others may call them.

        async def resolve(self, peer: InstanceId) -> bool: ...  # the Messenger itself

        def _send(  # .outbound
            self,
            peer: InstanceId,
            lane: int,
            kind: Kind,
            handler: str,
            payload: bytes | bytearray | memoryview,
            message_id: int,
            headers: dict[str, str] | None,
        ) -> SendOutcome: ...

        def _reply(  # .inbound
            self, ctx: Context, kind: Kind, message_id: int, payload: bytes
        ) -> None: ...

        def _deliver(  # .inbound
            self, peer: InstanceId, lane: int, envelope: Envelope, payload: bytes | memoryview
        ) -> None: ...

        def _resolve_staged(  # .rendezvous
            self, peer: InstanceId, lane: int, envelope: Envelope
        ) -> None: ...
