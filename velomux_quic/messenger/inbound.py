"""The receiving side of the Messenger: frames turned into handler calls, and their replies.

Every frame on every lane enters here (``frame_received``). A request is matched to its
handler by name and run the way the handler was registered: inline on the receive path,
through the ordered per-(handler, sender, lane) queue, or spawned. When the handler
returns (or raises), its outcome is measured and, for acknowledged and unary messages,
answered on this node's own connection to the sender, on the lane the request came on.
An answer to one of this node's own calls completes the call waiting for it, with the
remote error typed. A staged request is handed to :mod:`.rendezvous`, which pulls its
payload and comes back to ``_deliver``.

``frame_received``, ``_deliver``, ``_run_inline`` and ``_handler_done`` run once per
message (the mux's batch handlers are inline): keep them free of extra calls and
attribute lookups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from ..ids import InstanceId
from ..transport import SendAdmission, TransportError
from .base import LOGGER_NAME, MessengerBase
from .dispatch import OrderedDispatcher
from .envelope import (
    Envelope,
    ErrorCode,
    Kind,
    MalformedEnvelope,
    decode_envelope,
    decode_error,
    encode_error,
)
from .errors import CallError, HandlerFailed, MessengerClosed, RemoteRefused, UnknownHandler
from .registry import Context, HandlerSpec

__all__ = ["Job", "MessengerInbound"]

logger = logging.getLogger(LOGGER_NAME)

_RESPONSE_TYPE = {Kind.MESSAGE: "fire_and_forget", Kind.SYNC: "ack_nack", Kind.REQUEST: "unary"}
_ANSWERS = (Kind.RESPONSE, Kind.ERROR, Kind.ACK)

Job = tuple[HandlerSpec, Context, Kind, int]


class MessengerInbound(MessengerBase):
    """The Messenger's receiving and dispatching methods; see the module docstring.

    A :class:`Context` names the :class:`Messenger` that these methods are mixed into,
    which the type checker cannot see from here: hence the ``type: ignore`` where one is
    built.
    """

    _dispatcher: OrderedDispatcher

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        try:
            envelope = decode_envelope(body)
        except MalformedEnvelope as exc:
            self.metrics.dispatch_failures.labels("decode", "active_message").inc()
            logger.debug("malformed envelope from %s lane %d: %s", peer, lane, exc)
            return
        if envelope.staged:
            self._resolve_staged(peer, lane, envelope)
        else:
            self._deliver(peer, lane, envelope, envelope.payload)

    def _deliver(
        self, peer: InstanceId, lane: int, envelope: Envelope, payload: bytes | memoryview
    ) -> None:
        kind = envelope.kind
        if kind in _ANSWERS:
            self._answer(peer, envelope, payload)
            return
        spec = self.handlers.get(envelope.handler)
        if spec is None:
            self.metrics.dispatch_failures.labels("dispatch", "unknown_handler").inc()
            self.metrics.count_message("_unknown", "inbound", len(payload))
            if kind is not Kind.MESSAGE:
                ctx = Context(self, peer, lane, envelope.handler, envelope.headers, payload)  # type: ignore[arg-type]
                self._reply(
                    ctx,
                    Kind.ERROR,
                    envelope.message_id,
                    encode_error(
                        ErrorCode.UNKNOWN_HANDLER, f"no handler named {envelope.handler!r}"
                    ),
                )
            return
        self.metrics.count_message(spec.name, "inbound", len(payload))
        ctx = Context(self, peer, lane, spec.name, envelope.headers, payload)  # type: ignore[arg-type]
        job: Job = (spec, ctx, kind, envelope.message_id)
        if spec.dispatch == "inline":
            self._run_inline(job)
        elif spec.dispatch == "ordered":
            self._dispatcher.submit(spec.name, peer, lane, job)
        else:
            self._dispatcher.spawn(job)

    def _run_inline(self, job: Job) -> None:
        spec, ctx, _, _ = job
        started = time.monotonic()
        try:
            result = spec.fn(ctx)
            if isinstance(result, Awaitable):  # registered as inline but returned a coroutine
                raise TypeError(f"inline handler {spec.name!r} returned an awaitable")
        except Exception as exc:
            self._handler_failed(job, exc, started)
            return
        self._handler_done(job, result, started)

    async def _run(self, job: tuple[Any, ...]) -> None:
        spec, ctx, _, _ = job
        started = time.monotonic()
        try:
            result = spec.fn(ctx)
            if isinstance(result, Awaitable):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._handler_failed(job, exc, started)
            return
        self._handler_done(job, result, started)

    def _handler_done(self, job: Job, result: Any, started: float) -> None:
        spec, ctx, kind, message_id = job
        response_type = _RESPONSE_TYPE[kind]
        self._observe(spec.name, response_type, "success", started, len(ctx.payload))
        if kind is Kind.REQUEST:
            payload = b"" if result is None else bytes(result)
            self.metrics.response_bytes.labels(spec.name, response_type, "success").inc(
                len(payload)
            )
            self._reply(ctx, Kind.RESPONSE, message_id, payload)
        elif kind is Kind.SYNC:
            self._reply(ctx, Kind.ACK, message_id, b"")

    def _handler_failed(self, job: Job, exc: Exception, started: float) -> None:
        spec, ctx, kind, message_id = job
        self._observe(spec.name, _RESPONSE_TYPE[kind], "error", started, len(ctx.payload))
        if kind is Kind.MESSAGE:
            logger.warning("handler %r failed on a message from %s: %r", spec.name, ctx.sender, exc)
            return
        logger.debug("handler %r failed for %s: %r", spec.name, ctx.sender, exc)
        self._reply(ctx, Kind.ERROR, message_id, encode_error(ErrorCode.HANDLER_FAILED, repr(exc)))

    def _observe(
        self, handler: str, response_type: str, outcome: str, started: float, size: int
    ) -> None:
        self.metrics.observe_handler(
            handler, response_type, outcome, time.monotonic() - started, size
        )

    def _answer(self, peer: InstanceId, envelope: Envelope, payload: bytes | memoryview) -> None:
        message_id = envelope.message_id
        if envelope.kind is Kind.ERROR:
            try:
                code, text = decode_error(payload)
            except MalformedEnvelope:
                code, text = ErrorCode.MALFORMED, "unreadable error from peer"
            matched = self._calls.fail(peer, message_id, self._remote_error(peer, code, text))
        else:
            matched = self._calls.resolve(peer, message_id, bytes(payload))
        if not matched:  # late (timed out) or not ours: drop, but count
            self.metrics.dispatch_failures.labels("response", "unmatched").inc()

    @staticmethod
    def _remote_error(peer: InstanceId, code: ErrorCode, text: str) -> CallError:
        if code is ErrorCode.UNKNOWN_HANDLER:
            return UnknownHandler(f"{peer}: {text}", peer=peer)
        if code is ErrorCode.HANDLER_FAILED:
            return HandlerFailed(f"{peer}'s handler failed: {text}", remote_message=text, peer=peer)
        return RemoteRefused(f"{peer} refused the message ({code.value}): {text}", peer=peer)

    def _reply(self, ctx: Context, kind: Kind, message_id: int, payload: bytes) -> None:
        try:
            outcome = self._send(ctx.sender, ctx.lane, kind, "", payload, message_id, None)
        except (TransportError, MessengerClosed) as exc:
            self.metrics.dispatch_failures.labels("response_send", "no_route").inc()
            logger.warning("could not answer %s on lane %d: %s", ctx.sender, ctx.lane, exc)
            return
        if isinstance(outcome, SendAdmission):
            outcome.on_resolved(self._reply_resolved)

    def _reply_resolved(self, admission: SendAdmission) -> None:
        if admission.error is not None:
            self.metrics.dispatch_failures.labels("response_send", "refused").inc()
