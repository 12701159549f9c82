"""Handlers by name, and the context a handler is called with.

A handler runs one of three ways, its *dispatch*:

* ``"inline"``: on the receive path, in arrival order, before the next frame of the lane
  is read. No task and no queue per message, so it must not block: the mux's batch
  handlers run this way. The default for a plain (non-``async``) function.
* ``"ordered"``: through a queue per (handler, sender, lane), one message at a time, so
  one sender's messages on one lane are handled in arrival order while other senders and
  lanes go on. The default for a coroutine function.
* ``"spawn"``: each message in a task of its own, concurrently, in no order.

Names starting with ``_`` are reserved for the layers built on the messenger (streaming,
the mux); an application's handler cannot take one.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigurationError, HandlerExists
from ..ids import InstanceId
from .headers import RESERVED_PREFIX

__all__ = [
    "Context",
    "Dispatch",
    "Handler",
    "HandlerRegistry",
    "HandlerResult",
    "HandlerSpec",
]

Dispatch = Literal["inline", "ordered", "spawn"]
"""How a handler runs; see the module docstring."""

HandlerResult = bytes | bytearray | memoryview | None
"""What a handler returns: the response of a unary call (None is an empty one)."""

Handler = Callable[["Context"], HandlerResult | Awaitable[HandlerResult]]
"""A handler: called with the :class:`Context` of one message, sync or ``async``."""


class Context:
    """What a handler is told about one message.

    ``sender`` is the InstanceId the sender's certificate proved, never something the
    message says. ``payload`` is a read-only view into the received frame (zero copy);
    keep it or ``bytes()`` it as you like. ``headers`` is None when the message had none.
    """

    __slots__ = ("handler", "headers", "lane", "payload", "sender")

    def __init__(
        self,
        sender: InstanceId,
        lane: int,
        handler: str,
        headers: dict[str, str] | None,
        payload: bytes | memoryview,
    ) -> None:
        self.sender = sender
        """The node that sent the message, as its certificate proved."""
        self.lane = lane
        """The lane the message arrived on (a reply goes back on it)."""
        self.handler = handler
        """The name the message was sent to."""
        self.headers = headers
        """The message's headers, None when it had none."""
        self.payload = payload
        """The message's payload (for a staged one, the pulled bytes)."""

    def __repr__(self) -> str:
        return f"<Context {self.handler} from {self.sender} lane {self.lane}>"


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """One registration: the name, the function and how it runs."""

    name: str
    fn: Handler
    dispatch: Dispatch


class HandlerRegistry:
    """Name -> handler; names starting with ``_`` are the system's (see the module docstring)."""

    def __init__(self) -> None:
        self._handlers: dict[str, HandlerSpec] = {}

    def register(
        self, name: str, fn: Handler, *, dispatch: Dispatch | None = None, system: bool = False
    ) -> HandlerSpec:
        """Add a handler; HandlerExists when the name is taken or reserved,
        ConfigurationError when the name or the dispatch cannot work."""
        if not isinstance(name, str) or not name or len(name.encode()) > 255:
            raise ConfigurationError(
                f"a handler name is 1 to 255 bytes of UTF-8, got {name!r}: choose a shorter one"
            )
        if name.startswith(RESERVED_PREFIX) and not system:
            raise HandlerExists(
                f"handler names starting with '_' are reserved for the library: {name!r};"
                " choose a name without the leading underscore"
            )
        if name in self._handlers:
            raise HandlerExists(
                f"a handler named {name!r} is already registered: unregister it first"
            )
        is_async = inspect.iscoroutinefunction(fn)
        if dispatch is None:
            dispatch = "ordered" if is_async else "inline"
        if dispatch not in ("inline", "ordered", "spawn"):
            raise ConfigurationError(
                f"dispatch must be 'inline', 'ordered' or 'spawn', got {dispatch!r}"
            )
        if dispatch == "inline" and is_async:
            raise ConfigurationError(
                f"handler {name!r} is a coroutine function; it cannot run inline:"
                " use dispatch='ordered' or 'spawn'"
            )
        spec = HandlerSpec(name, fn, dispatch)
        self._handlers[name] = spec
        return spec

    def wrap(self, name: str, wrap: Callable[[HandlerSpec], Handler]) -> bool:
        """Replace ``name``'s function with ``wrap(its registration)``, keeping its name and
        dispatch; False when none had that name."""
        spec = self._handlers.get(name)
        if spec is None:
            return False
        self._handlers[name] = HandlerSpec(name, wrap(spec), spec.dispatch)
        return True

    def unregister(self, name: str) -> bool:
        """Remove a handler; False when none had that name."""
        return self._handlers.pop(name, None) is not None

    def get(self, name: str) -> HandlerSpec | None:
        """The registration of ``name`` (the per-message lookup)."""
        return self._handlers.get(name)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._handlers)
