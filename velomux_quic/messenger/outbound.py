"""The sending side of the Messenger: sends and calls turned into frames on a lane.

This part owns the one path every outgoing envelope takes (``_send``, shared with the
replies of :mod:`.inbound`): a payload within the peer's eager budget travels inline, with
the fire-and-forget header precomputed per handler name; a larger one is registered with
the staging store and only its descriptor travels (the receiver then pulls it, see
:mod:`.rendezvous`). On top of it sit the public ways to send (fire-and-forget,
acknowledged, unary), and ``_call``, which registers a call with :mod:`.calls` and
waits for its answer.

``send_message_on_lane`` and ``_send`` run once per message: keep them free of extra
calls and attribute lookups.
"""

from __future__ import annotations

import time
from typing import Any

from ..ids import InstanceId
from ..transport import PeerNotRegistered, SendAdmission, SendOutcome
from .base import MessengerBase
from .envelope import Kind, StagedDescriptor, encode_envelope, message_prefix
from .errors import MessengerClosed, PeerGone

__all__ = ["ENVELOPE_RESERVE", "MessengerOutbound"]

ENVELOPE_RESERVE = 2048
"""Bytes kept out of the eager budget for the envelope: fixed header, name, small headers."""


class MessengerOutbound(MessengerBase):
    """The Messenger's sending methods; see the module docstring."""

    _prefixes: dict[str, bytes]

    def eager_budget(self, peer: InstanceId) -> int:
        """The largest payload carried inline to ``peer``; larger ones are staged and pulled."""
        limit = min(self.transport.max_message_size(peer), self.config.staging_threshold)
        return max(0, limit - ENVELOPE_RESERVE)

    def send_message_on_lane(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        payload: bytes | bytearray | memoryview,
        *,
        headers: dict[str, str] | None = None,
    ) -> SendOutcome:
        """Fire-and-forget, returning the transport's admission outcome at the send site."""
        return self._send(peer, lane, Kind.MESSAGE, handler, payload, 0, headers)

    async def am_send(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Fire-and-forget; returns once the transport admitted the message."""
        outcome = self.send_message_on_lane(peer, lane, handler, payload, headers=headers)
        if isinstance(outcome, SendAdmission):
            await outcome

    async def am_sync(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Send and wait until the peer's handler finished (acknowledged)."""
        await self._call(peer, lane, Kind.SYNC, handler, payload, timeout, headers)

    async def unary(
        self,
        peer: InstanceId,
        handler: str,
        payload: bytes | bytearray | memoryview = b"",
        *,
        lane: int = 0,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """Request/response. Raises UnknownHandler, HandlerFailed, RemoteRefused,
        UnaryTimeout or PeerGone, each within ``timeout``."""
        result: bytes = await self._call(
            peer, lane, Kind.REQUEST, handler, payload, timeout, headers
        )
        return result

    async def _call(
        self,
        peer: InstanceId,
        lane: int,
        kind: Kind,
        handler: str,
        payload: bytes | bytearray | memoryview,
        timeout: float | None,
        headers: dict[str, str] | None,
    ) -> Any:
        if self._closed:
            raise MessengerClosed("the messenger is closed")
        timeout = self.config.default_timeout if timeout is None else timeout
        if self._discovery is not None and self.transport.peer_address(peer) is None:
            await self.resolve(peer)
        message_id, future = self._calls.start(peer, handler, timeout)
        started = time.monotonic()
        outcome_label = "error"
        try:
            try:
                outcome = self._send(peer, lane, kind, handler, payload, message_id, headers)
            except PeerNotRegistered as exc:
                raise PeerGone(str(exc), peer=peer, handler=handler) from exc
            if isinstance(outcome, SendAdmission):
                # Never admitted (the dial failed, the connection died first): fail now,
                # not at the timeout.
                def never_admitted(admission: SendAdmission) -> None:
                    if admission.error is not None:
                        self._calls.fail(
                            peer,
                            message_id,
                            PeerGone(
                                f"{peer} unreachable: {admission.error}",
                                peer=peer,
                                handler=handler,
                            ),
                        )

                outcome.on_resolved(never_admitted)
            result = await future
            outcome_label = "success"
            return result
        finally:
            if not future.done():
                future.cancel()
            self.metrics.unary_duration.labels(handler, outcome_label).observe(
                time.monotonic() - started
            )

    def _send(
        self,
        peer: InstanceId,
        lane: int,
        kind: Kind,
        handler: str,
        payload: bytes | bytearray | memoryview,
        message_id: int,
        headers: dict[str, str] | None,
    ) -> SendOutcome:
        if self._closed:
            raise MessengerClosed("the messenger is closed")
        size = len(payload)
        staged_id = 0
        if size > self.eager_budget(peer):
            staged_id = self._staging.stage(bytes(payload), peer)
            self.metrics.rendezvous_ops.labels("register", "success").inc()
            self.metrics.rendezvous_bytes.labels("register").inc(size)
            body = encode_envelope(
                kind,
                handler=handler,
                message_id=message_id,
                headers=headers,
                payload=StagedDescriptor(staged_id, size).encode(),
                staged=True,
            )
        elif kind is Kind.MESSAGE and headers is None:
            prefix = self._prefixes.get(handler)
            if prefix is None:
                prefix = self._prefixes[handler] = message_prefix(Kind.MESSAGE, handler)
            body = prefix + payload
        else:
            body = encode_envelope(
                kind, handler=handler, message_id=message_id, headers=headers, payload=payload
            )
        try:
            outcome = self.transport.send(peer, lane, body)
        except BaseException:
            if staged_id:
                self._staging.release(staged_id, peer, "unsent")
            raise
        if handler:
            self.metrics.count_message(handler, "outbound", size)
        return outcome
