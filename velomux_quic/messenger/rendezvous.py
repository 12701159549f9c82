"""Rendezvous: how payloads too large to travel inline reach their receiver.

The sender registers such a payload with its staging store (on the send path, in
:mod:`.outbound`) and sends only a descriptor. This part owns the rest of the exchange,
on both nodes. As the receiver it refuses a descriptor larger than
``staged_payload_max`` before allocating anything (telling the sender to release it, the
refusal hooks, and a waiting caller), and otherwise pulls the payload over a request
stream in the background, so the lane never waits for the transfer, then hands it to
:mod:`.inbound` as if it had arrived inline. As the sender it serves those pulls and
releases, and reports every release of a staged payload to its listeners.

Pulls of one (sender, lane) run one after another, in the order their descriptors arrived,
so a lane's staged payloads are delivered in lane order among themselves (inline messages
do not wait for them). Pulled side by side, a small payload staged after a large one could
land first: the mux would then have to hold the second record of a stream, possibly
megabytes, until the first arrived, and its per-stream hold is bounded far below that.
One lane's transfers share one connection anyway, so pulling them in turn costs a round
trip per payload, not bandwidth.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..ids import InstanceId
from ..transport import TransportError
from .base import LOGGER_NAME, MessengerBase
from .envelope import Envelope, ErrorCode, Kind, StagedDescriptor, encode_error
from .registry import Context
from .staging import PullOp, decode_pull, encode_pull

__all__ = ["MessengerRendezvous", "RefusalHook", "StagedRefusal"]

logger = logging.getLogger(LOGGER_NAME)


class StagedRefusal:
    """A staged payload this node refused for its size, as told to refusal hooks."""

    __slots__ = ("handler", "headers", "lane", "limit", "peer", "size")

    def __init__(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        headers: dict[str, str] | None,
        size: int,
        limit: int,
    ) -> None:
        self.peer = peer
        self.lane = lane
        self.handler = handler
        self.headers = headers
        self.size = size
        self.limit = limit


RefusalHook = Callable[[StagedRefusal], None]


class MessengerRendezvous(MessengerBase):
    """The Messenger's rendezvous methods; see the module docstring.

    A :class:`Context` names the :class:`Messenger` that these methods are mixed into,
    which the type checker cannot see from here: hence the ``type: ignore`` where one is
    built.
    """

    _refusal_hooks: list[RefusalHook]
    _staging_listeners: list[Callable[[str, int], None]]
    _pull_tails: dict[tuple[InstanceId, int], asyncio.Future[None]]
    """The last pull queued on each (sender, lane): the next one waits for it."""

    def add_staged_refusal_hook(self, hook: RefusalHook) -> None:
        """Be told when this node refuses a staged payload for its size (the mux ends the slot)."""
        self._refusal_hooks.append(hook)

    def add_staging_listener(self, listener: Callable[[str, int], None]) -> None:
        """Be told ``(reason, size)`` whenever a staged payload is released
        (``pulled``, ``refused``, ``expired``, ``unsent`` or ``closed``)."""
        self._staging_listeners.append(listener)

    @property
    def staged_bytes(self) -> int:
        return self._staging.bytes_held

    def _resolve_staged(self, peer: InstanceId, lane: int, envelope: Envelope) -> None:
        descriptor = envelope.descriptor
        assert descriptor is not None
        limit = self.config.staged_payload_max
        if descriptor.size > limit:
            # Refused before allocating: the descriptor is all we ever read of it.
            self.metrics.refusals.labels("too_large").inc()
            self.metrics.rendezvous_ops.labels("get", "refused").inc()
            self._background_task(self._release_remote(peer, descriptor.staged_id))
            refusal = StagedRefusal(
                peer, lane, envelope.handler, envelope.headers, descriptor.size, limit
            )
            for hook in self._refusal_hooks:
                try:
                    hook(refusal)
                except Exception:
                    logger.exception("staged refusal hook failed")
            self._refuse_caller(
                peer,
                lane,
                envelope,
                f"staged payload of {descriptor.size} bytes exceeds staged_payload_max {limit}",
            )
            return
        key = (peer, lane)
        previous = self._pull_tails.get(key)
        task = self._background_task(self._pull_in_turn(previous, peer, lane, envelope, descriptor))
        self._pull_tails[key] = task
        task.add_done_callback(lambda done: self._pull_done(key, done))

    def _pull_done(self, key: tuple[InstanceId, int], task: asyncio.Future[None]) -> None:
        if self._pull_tails.get(key) is task:
            del self._pull_tails[key]

    async def _pull_in_turn(
        self,
        previous: asyncio.Future[None] | None,
        peer: InstanceId,
        lane: int,
        envelope: Envelope,
        descriptor: StagedDescriptor,
    ) -> None:
        """Pull after the lane's previous pull finished, whatever its outcome (each pull
        handles its own failure; a cancelled one, at close, ends the chain's wait too)."""
        if previous is not None and not previous.done():
            await asyncio.wait((previous,))
        await self._pull_and_deliver(peer, lane, envelope, descriptor)

    async def _pull_and_deliver(
        self, peer: InstanceId, lane: int, envelope: Envelope, descriptor: StagedDescriptor
    ) -> None:
        started = time.monotonic()
        try:
            payload = await self.transport.request(
                peer,
                encode_pull(PullOp.PULL, descriptor.staged_id),
                max_response=descriptor.size,
                timeout=self.config.pull_timeout,
            )
            if len(payload) != descriptor.size:
                raise TransportError(
                    f"pulled {len(payload)} bytes, descriptor said {descriptor.size}"
                )
        except (TransportError, TimeoutError) as exc:
            self.metrics.rendezvous_ops.labels("get", "error").inc()
            logger.warning(
                "could not pull a staged %r payload from %s: %r", envelope.handler, peer, exc
            )
            self._refuse_caller(peer, lane, envelope, f"staged payload lost: {exc}")
            return
        self.metrics.rendezvous_ops.labels("get", "success").inc()
        self.metrics.rendezvous_bytes.labels("get").inc(len(payload))
        logger.debug(
            "pulled %d bytes from %s in %.3f s", len(payload), peer, time.monotonic() - started
        )
        self._deliver(peer, lane, envelope, payload)

    def _refuse_caller(self, peer: InstanceId, lane: int, envelope: Envelope, message: str) -> None:
        """A staged SYNC or REQUEST that will never be handled: its caller gets
        RemoteRefused with ``message`` (a MESSAGE has no caller to tell)."""
        if envelope.kind in (Kind.SYNC, Kind.REQUEST):
            ctx = Context(self, peer, lane, envelope.handler, envelope.headers, b"")  # type: ignore[arg-type]
            self._reply(
                ctx, Kind.ERROR, envelope.message_id, encode_error(ErrorCode.REFUSED, message)
            )

    async def _release_remote(self, peer: InstanceId, staged_id: int) -> None:
        try:
            await self.transport.request(
                peer, encode_pull(PullOp.RELEASE, staged_id), max_response=0, timeout=10.0
            )
        except (TransportError, TimeoutError) as exc:
            logger.debug("could not tell %s to release staged %x: %r", peer, staged_id, exc)

    async def serve_request(self, peer: InstanceId, request: bytes) -> bytes:
        """The sender's side of a pull: hand over (or drop) what we staged for ``peer``."""
        op, staged_id = decode_pull(request)
        if op is PullOp.RELEASE:
            self._staging.release(staged_id, peer, "refused")
            return b""
        payload = self._staging.take(staged_id, peer)
        if payload is None:
            self.metrics.rendezvous_ops.labels("pull", "unknown").inc()
            raise LookupError(f"nothing staged under {staged_id:#x} for {peer}")
        self.metrics.rendezvous_ops.labels("pull", "success").inc()
        self.metrics.rendezvous_bytes.labels("pull").inc(len(payload))
        return payload

    def _released(self, reason: str, size: int) -> None:
        self.metrics.rendezvous_ops.labels("release", reason).inc()
        for listener in self._staging_listeners:
            try:
                listener(reason, size)
            except Exception:  # a listener's bug must not break the release that called it
                logger.exception("staging listener failed on a %s release", reason)
