"""The OpenTelemetry side of :mod:`velomux_quic.tracing`: imported only with the extra.

One :class:`NodeTracing` per node. Its spans:

* ``velomux.stream.send`` (PRODUCER), on the producer's node: from the attach (or a
  ticket's open) to the sender's retirement; ``velomux.stream.outcome`` is the
  :class:`~velomux_quic.Retired` value, or ``not_opened`` when the attach failed.
* ``velomux.attach`` (CLIENT), its child: the attach round trip, whose request carries the
  trace context.
* ``velomux.attach.accept`` (SERVER), on the anchor's node: the attach handler, a child of
  the producer's attach.
* ``velomux.stream.receive`` (CONSUMER), on the anchor's node: from the bind to the end of
  the stream there; its outcome is ``finished``, ``cancelled``, ``detached``,
  ``dropped`` or ``released``.
* ``velomux.call <name>`` (CLIENT) and ``velomux.handle <name>`` (SERVER): a call and the
  handler that answers it, on their two nodes.

Nothing of this runs until there is something to record (:class:`Gate`): while the
global tracer provider is OpenTelemetry's default (the proxy that stays a no-op until the
application sets a provider, or an explicit no-op provider), every hook returns at once:
no span, no context attached, no header injected or extracted. The first look that finds
a real provider turns the node's tracing on for good, as OpenTelemetry lets a process set
its provider only once; ``VELOMUX_TRACING=on`` skips the look (the context of an upstream
trace then still travels with a node's calls when no provider records anything).

The context crosses nodes in reserved envelope headers, one per field of the global
propagator (``_traceparent``, ``_tracestate``, ... for W3C trace context): the messenger
adds them to every call this node makes (:meth:`Messenger.set_call_headers`), and a traced
handler reads them. A field longer than an envelope header may be is left out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
)

from ..ids import InstanceId, StreamAnchorHandle
from ..messenger import Context, Messenger
from ..messenger.envelope import MAX_HEADER_VALUE_SIZE
from ..messenger.headers import RESERVED_PREFIX, HeaderCodec
from ..messenger.registry import Handler, HandlerSpec
from ..streaming.control import ATTACH_HANDLER, MPSC_ATTACH_HANDLER
from ..streaming.manager import AnchorManager
from ..streaming.sender import Retired, StreamSender

__all__ = ["ATTACH_HANDLERS", "TRACER_NAME", "Gate", "NodeTracing"]

TRACER_NAME = "velomux_quic"

ATTACH_HANDLERS = (ATTACH_HANDLER, MPSC_ATTACH_HANDLER)
"""The streaming layer's attach handlers, answered inside ``velomux.attach.accept``."""


def _same(text: str) -> str:
    return text


_NOTHING_RECORDS = (ProxyTracerProvider, NoOpTracerProvider)
"""The providers whose spans record nothing: the API's default proxy (what
``get_tracer_provider`` returns until a provider is set) and the explicit no-op."""


_PEEK = hasattr(trace, "_TRACER_PROVIDER")
"""Whether the API keeps its provider in the module global ``_TRACER_PROVIDER`` (None until
one is set), the private name ``tests/unit/test_otel_assumptions.py`` pins; where it is
gone the gate asks the public ``get_tracer_provider`` instead."""


class Gate:
    """Whether a node's spans can record anything, asked by every hook before any span work.

    Until the application sets a tracer provider, OpenTelemetry's API hands out the proxy
    provider, whose tracers make non-recording spans: making them, and attaching them to
    the context, costs a stream open about what real ones cost, for nothing, and at
    thousands of opens a second that was a large share of a frontend's time
    (docs/performance.md). The public look (``get_tracer_provider()``) reads the
    environment on every call while no provider is set; so while none is set the gate
    reads the API's module global instead, one attribute. Once one is set the answer is
    kept: the API refuses to replace a provider once set. A provider named by
    ``OTEL_PYTHON_TRACER_PROVIDER`` is loaded (and so set) by the first public look, made
    when the gate is.
    """

    __slots__ = ("_decided", "_on")

    def __init__(self, *, forced: bool = False) -> None:
        self._on = forced
        self._decided = forced
        trace.get_tracer_provider()  # sets the provider the environment names, if any

    def __call__(self) -> bool:
        if self._decided:
            return self._on
        if _PEEK and trace._TRACER_PROVIDER is None:
            return False
        provider = trace.get_tracer_provider()
        if isinstance(provider, ProxyTracerProvider):
            return False  # no provider yet (the module global is gone: the public look)
        self._on = not isinstance(provider, _NOTHING_RECORDS)
        self._decided = True
        return self._on


class NodeTracing:
    """A node's spans (see the module docstring); installs its hooks when made."""

    def __init__(
        self, messenger: Messenger, anchors: AnchorManager, node_id: str, *, forced: bool = False
    ) -> None:
        self.active = Gate(forced=forced)
        """True when spans can record (see :class:`Gate`); the node asks it before
        routing an open or a call through here."""
        self._tracer = trace.get_tracer(TRACER_NAME)
        self._propagator = propagate.get_global_textmap()
        self._fields = frozenset(self._propagator.fields)
        self._messenger = messenger
        self._node = {"velomux.node": node_id}
        for field in sorted(self._fields):
            messenger.register_header(HeaderCodec(RESERVED_PREFIX + field, _same, _same))
        messenger.set_call_headers(self._with_context)
        for name in ATTACH_HANDLERS:
            messenger.wrap_handler(name, partial(self._served, "velomux.attach.accept"))
        anchors.observer = _Streams(self._tracer, self._node, self.active)

    # -- the context in a request's headers ------------------------------------------------

    def _with_context(self, headers: dict[str, str] | None) -> dict[str, str] | None:
        if not self.active():
            return headers
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        if not carrier:
            return headers
        merged = dict(headers) if headers else {}
        for field, value in carrier.items():
            if field in self._fields and len(value.encode()) <= MAX_HEADER_VALUE_SIZE:
                merged[RESERVED_PREFIX + field] = value
        return merged or headers

    def _remote(self, headers: Mapping[str, str] | None) -> otel_context.Context:
        """The caller's context from a request's headers; an empty one (a new trace) when
        the request carries none."""
        carrier = {
            name[1:]: value
            for name, value in (headers or {}).items()
            if name.startswith(RESERVED_PREFIX) and name[1:] in self._fields
        }
        return self._propagator.extract(carrier, context=otel_context.Context())

    def message_headers(self) -> dict[str, str] | None:
        return self._with_context(None)

    # -- handlers --------------------------------------------------------------------------

    def serve(self, name: str) -> None:
        self._messenger.wrap_handler(name, partial(self._served, f"velomux.handle {name}"))

    def _served(self, span_name: str, spec: HandlerSpec) -> Handler:
        """``spec``'s handler inside a SERVER span parented on the caller's context: a plain
        function that calls the handler itself while nothing records (the messenger awaits
        what it returns), so an untraced request costs one call and one look."""
        fn, tracer, remote, node, active = (
            spec.fn, self._tracer, self._remote, self._node, self.active
        )  # fmt: skip
        inline = spec.dispatch == "inline"

        def attributes(ctx: Context) -> dict[str, str]:
            return {**node, "rpc.system": "velomux", "rpc.method": spec.name,
                    "velomux.peer": str(ctx.sender)}  # fmt: skip

        async def traced_async(ctx: Context) -> Any:
            with tracer.start_as_current_span(
                span_name, context=remote(ctx.headers), kind=SpanKind.SERVER,
                attributes=attributes(ctx),
            ):  # fmt: skip
                result = fn(ctx)
                if isinstance(result, Awaitable):
                    result = await result
                return result

        def traced(ctx: Context) -> Any:
            if not active():
                return fn(ctx)
            if not inline:
                return traced_async(ctx)
            with tracer.start_as_current_span(
                span_name, context=remote(ctx.headers), kind=SpanKind.SERVER,
                attributes=attributes(ctx),
            ):  # fmt: skip
                return fn(ctx)

        return traced

    # -- the node's own calls --------------------------------------------------------------

    async def call(self, peer: InstanceId, name: str, run: Callable[[], Awaitable[bytes]]) -> bytes:
        if not self.active():
            return await run()
        with self._tracer.start_as_current_span(
            f"velomux.call {name}",
            kind=SpanKind.CLIENT,
            attributes={**self._node, "rpc.system": "velomux", "rpc.method": name,
                        "velomux.peer": str(peer)},
        ):  # fmt: skip
            return await run()

    async def open_stream(
        self,
        how: str,
        handle: StreamAnchorHandle,
        opener: Callable[[], Awaitable[StreamSender]],
    ) -> StreamSender:
        if not self.active():
            return await opener()
        attributes = {**self._node, "velomux.anchor": str(handle), "velomux.stream.open": how}
        stream = self._tracer.start_span(
            "velomux.stream.send", kind=SpanKind.PRODUCER, attributes=attributes
        )
        try:
            with trace.use_span(
                stream, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                if how == "attach":
                    with self._tracer.start_as_current_span(
                        "velomux.attach", kind=SpanKind.CLIENT, attributes=attributes
                    ):
                        sender = await opener()
                else:
                    sender = await opener()
        except BaseException as exc:
            stream.set_attribute("velomux.stream.outcome", "not_opened")
            stream.record_exception(exc)
            stream.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            stream.end()
            raise
        stream.set_attribute("velomux.transport", str(sender.negotiated_transport()))
        sender.on_retired(partial(_retired, stream))
        return sender


def _retired(stream: Span, outcome: Retired) -> None:
    stream.set_attribute("velomux.stream.outcome", outcome.value)
    stream.end()


class _Streams:
    """The anchor manager's stream observer: a CONSUMER span per bound remote stream."""

    def __init__(self, tracer: trace.Tracer, node: dict[str, str], active: Gate) -> None:
        self._tracer = tracer
        self._node = node
        self._active = active

    def bound(
        self, handle: StreamAnchorHandle, peer: InstanceId | None, transport: str
    ) -> Span | None:
        """The stream's span; None while nothing records (the manager then keeps nothing
        and never calls :meth:`ended` for it)."""
        if not self._active():
            return None
        return self._tracer.start_span(
            "velomux.stream.receive",
            kind=SpanKind.CONSUMER,
            attributes={**self._node, "velomux.anchor": str(handle), "velomux.transport":
                        transport, "velomux.peer": str(peer) if peer else "pre-bound"},
        )  # fmt: skip

    def ended(self, observed: Any, outcome: str) -> None:
        span: Span = observed
        span.set_attribute("velomux.stream.outcome", outcome)
        if outcome == "dropped":
            span.set_status(Status(StatusCode.ERROR, "the producer went silent or away"))
        span.end()
