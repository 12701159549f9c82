"""Optional OpenTelemetry tracing: spans for attach, a stream's life and calls.

With the ``otel`` extra installed (``pip install 'velomux_quic[otel]'``) every node
traces, through OpenTelemetry's global tracer provider, once the application has set one:
an attach, a stream from its opening
to its retirement with the outcome, on both nodes, and every call and the handler that
answers it. The caller's trace context travels to the peer inside the request (reserved
envelope headers, written by the propagator the application configured, W3C trace
context by default), so the spans of one request share one trace id across nodes.

Without the extra, or with ``VELOMUX_TRACING=off``, :func:`node_tracing` returns None
without importing anything of OpenTelemetry, and a node installs no hook: nothing is
added to any path, per record or otherwise. With it, the hooks sit where a stream is
attached, opened, bound and retired and where a call is made or answered, never on the
per-record path, and each first asks :attr:`Tracing.active`: while the provider is still
OpenTelemetry's default no-op (the extra pulled in by some dependency, nobody tracing)
they do no span work at all, since a non-recording span costs as much to make as a real
one. ``VELOMUX_TRACING=on`` routes every open and call through OpenTelemetry even then
(its propagator still forwards an upstream trace context that way).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..ids import InstanceId, StreamAnchorHandle
    from ..messenger import Messenger
    from ..streaming.manager import AnchorManager
    from ..streaming.sender import StreamSender

__all__ = ["ENV_SWITCH", "Tracing", "node_tracing", "tracing_available"]


class Tracing(Protocol):
    """What a node asks of its tracing (the spans it opens around its own calls)."""

    @property
    def active(self) -> Callable[[], bool]:
        """Whether spans can record now: the node calls its tracing only when true."""

    async def open_stream(
        self,
        how: str,
        handle: StreamAnchorHandle,
        opener: Callable[[], Awaitable[StreamSender]],
    ) -> StreamSender:
        """Run ``opener`` (an attach, or a ticket's open: ``how``) inside the stream's
        span, which then lasts until the sender retires."""

    async def call(self, peer: InstanceId, name: str, run: Callable[[], Awaitable[bytes]]) -> bytes:
        """Run ``run`` (a call to ``peer``'s handler ``name``) inside a client span."""

    def message_headers(self) -> dict[str, str] | None:
        """The headers that carry the current trace context in a message."""

    def serve(self, name: str) -> None:
        """Answer the handler ``name`` (just registered) inside a span whose parent is
        the caller's trace context."""


ENV_SWITCH = "VELOMUX_TRACING"
"""``off`` (or 0, false, no) keeps tracing off even where the extra is installed; ``on``
(or 1, true, yes) traces even while no tracer provider is set; unset: trace once the
application sets one."""

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def _switch() -> str:
    return os.environ.get(ENV_SWITCH, "").strip().lower()


def tracing_available() -> bool:
    """True when the extra is installed and not switched off; imports nothing."""
    if _switch() in _OFF:
        return False
    return importlib.util.find_spec("opentelemetry") is not None


def node_tracing(messenger: Messenger, anchors: AnchorManager, node_id: str) -> Tracing | None:
    """Install the tracing hooks on a node's layers and return what the node calls for
    its spans (an :class:`~velomux_quic.tracing.otel.NodeTracing`), or None when tracing
    is off or not installed (then nothing is imported and nothing installed)."""
    if not tracing_available():
        return None
    from .otel import NodeTracing

    return NodeTracing(messenger, anchors, node_id, forced=_switch() in _ON)
