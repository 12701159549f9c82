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
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from ..ids import InstanceId, StreamAnchorHandle
from ..messenger import Context, Messenger
from ..messenger.envelope import MAX_HEADER_VALUE_SIZE
from ..messenger.headers import RESERVED_PREFIX, HeaderCodec
from ..messenger.registry import Handler, HandlerSpec
from ..streaming.control import ATTACH_HANDLER, MPSC_ATTACH_HANDLER
from ..streaming.manager import AnchorManager
from ..streaming.sender import Retired, StreamSender

__all__ = ["ATTACH_HANDLERS", "TRACER_NAME", "NodeTracing"]

TRACER_NAME = "velomux_quic"

ATTACH_HANDLERS = (ATTACH_HANDLER, MPSC_ATTACH_HANDLER)
"""The streaming layer's attach handlers, answered inside ``velomux.attach.accept``."""


def _same(text: str) -> str:
    return text


class NodeTracing:
    """A node's spans (see the module docstring); installs its hooks when made."""

    def __init__(self, messenger: Messenger, anchors: AnchorManager, node_id: str) -> None:
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
        anchors.observer = _Streams(self._tracer, self._node)

    # -- the context in a request's headers ------------------------------------------------

    def _with_context(self, headers: dict[str, str] | None) -> dict[str, str] | None:
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
        """``spec``'s handler inside a SERVER span parented on the caller's context; an
        inline handler stays a plain function."""
        fn, tracer, remote, node = spec.fn, self._tracer, self._remote, self._node

        def attributes(ctx: Context) -> dict[str, str]:
            return {**node, "rpc.system": "velomux", "rpc.method": spec.name,
                    "velomux.peer": str(ctx.sender)}  # fmt: skip

        if spec.dispatch == "inline":

            def traced(ctx: Context) -> Any:
                with tracer.start_as_current_span(
                    span_name, context=remote(ctx.headers), kind=SpanKind.SERVER,
                    attributes=attributes(ctx),
                ):  # fmt: skip
                    return fn(ctx)

            return traced

        async def traced_async(ctx: Context) -> Any:
            with tracer.start_as_current_span(
                span_name, context=remote(ctx.headers), kind=SpanKind.SERVER,
                attributes=attributes(ctx),
            ):  # fmt: skip
                result = fn(ctx)
                if isinstance(result, Awaitable):
                    result = await result
                return result

        return traced_async

    # -- the node's own calls --------------------------------------------------------------

    async def call(self, peer: InstanceId, name: str, run: Callable[[], Awaitable[bytes]]) -> bytes:
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

    def __init__(self, tracer: trace.Tracer, node: dict[str, str]) -> None:
        self._tracer = tracer
        self._node = node

    def bound(self, handle: StreamAnchorHandle, peer: InstanceId | None, transport: str) -> Span:
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
