"""Handlers by name, and the context a handler is called with.

A plain function runs *inline*, on the receive path, in arrival order: that is what
``_stream_batch`` needs (nonblocking by construction, no task per message). A coroutine
function runs through an *ordered* queue per (handler, sender, lane), so one sender's
messages on one lane are handled in arrival order while other senders and lanes go on; or,
with ``dispatch="spawn"``, concurrently, in no order.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..ids import InstanceId
from .errors import HandlerExists

if TYPE_CHECKING:
    from .messenger import Messenger

__all__ = [
    "BATCH_HANDLER_NAMES",
    "Context",
    "Dispatch",
    "Handler",
    "HandlerRegistry",
    "HandlerSpec",
    "batch_handler_name",
]

Dispatch = Literal["inline", "ordered", "spawn"]
HandlerResult = bytes | bytearray | memoryview | None
Handler = Callable[["Context"], HandlerResult | Awaitable[HandlerResult]]

BATCH_HANDLER_NAMES: tuple[str, ...] = (
    "_stream_batch",
    *(f"_stream_batch.{lane}" for lane in range(1, 16)),
)
"""The mux's per-lane batch handlers; every node reserves all 16 names when it is built."""


def batch_handler_name(lane: int) -> str:
    return BATCH_HANDLER_NAMES[lane]


class Context:
    """What a handler is told about one message. The sender comes from the certificate."""

    __slots__ = ("handler", "headers", "lane", "messenger", "payload", "sender")

    def __init__(
        self,
        messenger: Messenger,
        sender: InstanceId,
        lane: int,
        handler: str,
        headers: dict[str, str] | None,
        payload: bytes | memoryview,
    ) -> None:
        self.messenger = messenger
        self.sender = sender
        self.lane = lane
        self.handler = handler
        self.headers = headers
        self.payload = payload

    def __repr__(self) -> str:
        return f"<Context {self.handler} from {self.sender} lane {self.lane}>"


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    name: str
    fn: Handler
    dispatch: Dispatch


class HandlerRegistry:
    """Name -> handler. Names starting with ``_`` are the system's."""

    def __init__(self) -> None:
        self._handlers: dict[str, HandlerSpec] = {}

    def register(
        self, name: str, fn: Handler, *, dispatch: Dispatch | None = None, system: bool = False
    ) -> HandlerSpec:
        if not name or len(name.encode()) > 255:
            raise ValueError("a handler name is 1 to 255 bytes of UTF-8")
        if name.startswith("_") and not system:
            raise HandlerExists(f"handler names starting with '_' are reserved: {name!r}")
        if name in self._handlers:
            raise HandlerExists(f"a handler named {name!r} is already registered")
        is_async = inspect.iscoroutinefunction(fn)
        if dispatch is None:
            dispatch = "ordered" if is_async else "inline"
        if dispatch == "inline" and is_async:
            raise ValueError(f"handler {name!r} is a coroutine function; it cannot run inline")
        spec = HandlerSpec(name, fn, dispatch)
        self._handlers[name] = spec
        return spec

    def replace(self, name: str, fn: Handler, *, dispatch: Dispatch | None = None) -> None:
        """Swap a system handler (the mux installs itself over the reserved batch names)."""
        self._handlers.pop(name, None)
        self.register(name, fn, dispatch=dispatch, system=True)

    def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)

    def get(self, name: str) -> HandlerSpec | None:
        return self._handlers.get(name)

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def __iter__(self) -> Iterator[HandlerSpec]:
        return iter(list(self._handlers.values()))
