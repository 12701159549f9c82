"""Rendezvous: how payloads too large to travel inline reach their receiver.

:class:`Rendezvous` is the messenger's collaborator for the whole exchange, on both nodes.
As the sender it keeps such a payload in its :class:`~.staging.StagingStore` (the
messenger sends only a descriptor), serves the receiver's pull of it and its release, and
reports every release to its listeners. As the receiver it refuses a descriptor larger
than ``staged_payload_max`` before allocating anything (telling the sender to release it,
the refusal hooks, and a waiting caller), and otherwise pulls the payload over a request
stream in the background, so the lane never waits for the transfer, then hands it back to
the messenger to dispatch as if it had arrived inline.

What it needs of the messenger is narrow and named, given to its constructor: a way to
open a request stream to a peer (:data:`PullRequester`), to deliver a pulled payload
(:data:`Deliver`), to refuse a waiting caller (:data:`RefuseCaller`), to keep a background
task that the messenger's close cancels (:data:`KeepTask`), and the metrics to count in.
None of it runs for an inline message.

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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..errors import TransportError
from ..ids import InstanceId
from .config import MessengerConfig
from .envelope import Envelope, StagedDescriptor
from .metrics import MessengerMetrics
from .staging import PullOp, ReleaseCallback, StagingStore, decode_pull, encode_pull

__all__ = [
    "Deliver",
    "KeepTask",
    "PullRequester",
    "RefusalHook",
    "RefuseCaller",
    "Rendezvous",
    "StagedRefusal",
    "StagingListener",
]

logger = logging.getLogger(__name__)


class StagedRefusal:
    """A staged payload this node refused (for its size, or past the pull bounds) or could
    not pull, as told to refusal hooks: the record it carried will never arrive."""

    __slots__ = ("detail", "handler", "headers", "lane", "limit", "peer", "reason", "size")

    def __init__(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        headers: dict[str, str] | None,
        size: int,
        limit: int,
        reason: str = "too_large",
        detail: str = "",
    ) -> None:
        self.peer = peer
        """The node that staged it."""
        self.lane = lane
        """The lane its descriptor arrived on."""
        self.handler = handler
        """The handler it was sent to."""
        self.headers = headers
        """Its envelope's headers (a layer reads its own with its HeaderCodec)."""
        self.size = size
        """The size its descriptor stated."""
        self.limit = limit
        """The bound it broke: ``staged_payload_max`` for ``too_large``, the per-peer pull
        bound (``max_pulls_per_peer`` or ``max_pull_bytes_per_peer``) for ``pull_count`` /
        ``pull_bytes``; 0 for ``lost``."""
        self.reason = reason
        """``too_large``; ``pull_count`` / ``pull_bytes`` when the peer already had as many
        pulls outstanding as this node accepts; ``lost`` when the pull failed (the sender
        no longer held it, the pull timed out, the connection failed)."""
        self.detail = detail
        """For ``lost``, why the pull failed."""


RefusalHook = Callable[[StagedRefusal], None]
"""Told of each staged payload this node refused (for its size, or past the pull bounds) or
failed to pull."""

StagingListener = Callable[[str, int], None]
"""Told ``(reason, size)`` of each release of a payload this node staged."""

PullRequester = Callable[[InstanceId, bytes, int, float], Awaitable[bytes]]
"""Open a request stream to ``peer`` with ``request`` and return its answer, at most
``max_response`` bytes, within ``timeout`` seconds (TransportError or TimeoutError)."""

Deliver = Callable[[InstanceId, int, Envelope, bytes], None]
"""Dispatch a pulled payload as if its envelope had carried it inline."""

RefuseCaller = Callable[[InstanceId, int, Envelope, str], None]
"""Tell the caller waiting on ``envelope`` (a SYNC or REQUEST) that it was refused, why."""

KeepTask = Callable[[Coroutine[Any, Any, None]], "asyncio.Future[None]"]
"""Run a coroutine as a task the messenger's close cancels and awaits."""


class _PeerPulls:
    """One peer's accepted, undelivered staged payloads, and whether it was warned of."""

    __slots__ = ("bytes", "count", "limit_logged", "loss_logged")

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.limit_logged = False
        self.loss_logged = False


class Rendezvous:
    """Staged payloads of one node, sent and received; see the module docstring."""

    def __init__(
        self,
        config: MessengerConfig,
        metrics: MessengerMetrics,
        *,
        request: PullRequester,
        deliver: Deliver,
        refuse: RefuseCaller,
        keep: KeepTask,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._request = request
        self._deliver = deliver
        self._refuse = refuse
        self._keep = keep
        self._store = StagingStore(
            max_bytes=config.max_staged_bytes, ttl=config.staged_ttl, on_release=self._released
        )
        self._refusal_hooks: list[RefusalHook] = []
        self._staging_listeners: list[StagingListener] = []
        self._pull_tails: dict[tuple[InstanceId, int], asyncio.Future[None]] = {}
        """The last pull queued on each (sender, lane): the next one waits for it."""
        self.pulls_outstanding = 0
        """Descriptors accepted whose payload is not delivered (or failed) yet."""
        self.pull_bytes_outstanding = 0
        """The bytes those descriptors state."""
        self._per_peer: dict[InstanceId, _PeerPulls] = {}
        """Peers with pulls outstanding (an entry goes with the peer's last pull)."""
        self._releases: dict[InstanceId, int] = {}
        """Release requests in flight to each peer (an entry goes with its last one)."""

    # -- hooks ---------------------------------------------------------------------------

    def add_refusal_hook(self, hook: RefusalHook) -> None:
        """Be told when this node refuses a staged payload for its size."""
        self._refusal_hooks.append(hook)

    def add_staging_listener(self, listener: StagingListener) -> None:
        """Be told of every release of a payload this node staged."""
        self._staging_listeners.append(listener)

    # -- the sender's side ---------------------------------------------------------------

    @property
    def staged_bytes(self) -> int:
        """Bytes held for peers that have not pulled them yet."""
        return self._store.bytes_held

    @property
    def staged_count(self) -> int:
        """Payloads held for peers that have not pulled them yet."""
        return len(self._store)

    def stage(
        self, payload: bytes, peer: InstanceId, on_release: ReleaseCallback | None = None
    ) -> int:
        """Hold ``payload`` for ``peer`` and return its staged id (StagingFull at the bound);
        ``on_release`` is told why it was released (see :class:`StagingStore`)."""
        staged_id = self._store.stage(payload, peer, on_release)
        self._metrics.rendezvous_ops.labels("register", "success").inc()
        self._metrics.rendezvous_bytes.labels("register").inc(len(payload))
        return staged_id

    def unstage(self, staged_id: int, peer: InstanceId) -> None:
        """Drop a payload whose descriptor never left (its send raised)."""
        self._store.release(staged_id, peer, "unsent")

    async def serve(self, peer: InstanceId, request: bytes) -> bytes:
        """The sender's side of a pull: hand over (or drop) what we staged for ``peer``."""
        op, staged_id = decode_pull(request)
        if op is PullOp.RELEASE:
            self._store.release(staged_id, peer, "refused")
            return b""
        payload = self._store.take(staged_id, peer)
        if payload is None:
            self._metrics.rendezvous_ops.labels("pull", "unknown").inc()
            raise LookupError(f"nothing staged under {staged_id:#x} for {peer}")
        self._metrics.rendezvous_ops.labels("pull", "success").inc()
        self._metrics.rendezvous_bytes.labels("pull").inc(len(payload))
        return payload

    def _released(self, reason: str, size: int) -> None:
        self._metrics.rendezvous_ops.labels("release", reason).inc()
        for listener in self._staging_listeners:
            try:
                listener(reason, size)
            except Exception:  # a listener's bug must not break the release that called it
                logger.exception("staging listener failed on a %s release", reason)

    # -- the receiver's side -------------------------------------------------------------

    def resolve(self, peer: InstanceId, lane: int, envelope: Envelope) -> None:
        """A STAGED envelope arrived: refuse it for its size, or pull it in its lane's turn."""
        descriptor = envelope.descriptor
        assert descriptor is not None
        limit = self._config.staged_payload_max
        if descriptor.size > limit:
            self._refuse_too_large(peer, lane, envelope, descriptor, limit)
            return
        pulls = self._per_peer.get(peer)
        if pulls is None:
            pulls = self._per_peer[peer] = _PeerPulls()
        config = self._config
        if pulls.count >= config.max_pulls_per_peer:
            self._refuse_past_bound(
                peer, lane, envelope, descriptor, pulls, "count", config.max_pulls_per_peer
            )
            return
        if pulls.count and pulls.bytes + descriptor.size > config.max_pull_bytes_per_peer:
            self._refuse_past_bound(
                peer, lane, envelope, descriptor, pulls, "bytes", config.max_pull_bytes_per_peer
            )
            return
        pulls.count += 1
        pulls.bytes += descriptor.size
        key = (peer, lane)
        previous = self._pull_tails.get(key)
        self.pulls_outstanding += 1
        self.pull_bytes_outstanding += descriptor.size
        task = self._keep(self._pull_in_turn(previous, peer, lane, envelope, descriptor))
        self._pull_tails[key] = task
        task.add_done_callback(lambda done: self._pull_done(key, done))

    def _refuse_too_large(
        self,
        peer: InstanceId,
        lane: int,
        envelope: Envelope,
        descriptor: StagedDescriptor,
        limit: int,
    ) -> None:
        # Refused before allocating: the descriptor is all we ever read of it.
        self._metrics.refusals.labels("too_large").inc()
        self._metrics.rendezvous_ops.labels("get", "refused").inc()
        self._ask_release(peer, descriptor.staged_id)
        self._tell_refusal(peer, lane, envelope, descriptor, limit, "too_large")
        self._refuse(
            peer,
            lane,
            envelope,
            f"staged payload of {descriptor.size} bytes exceeds staged_payload_max {limit}",
        )

    def _refuse_past_bound(
        self,
        peer: InstanceId,
        lane: int,
        envelope: Envelope,
        descriptor: StagedDescriptor,
        pulls: _PeerPulls,
        bound: str,
        limit: int,
    ) -> None:
        """The peer has as many pulls outstanding as it may: refuse this one unread.

        Unlike a refusal for size, the sender is not asked to release the payload: that
        would cost a request stream per refused descriptor, which is what the bound is
        there to stop; the payload expires after the sender's ``staged_ttl``.
        """
        self._metrics.staged_pulls_refused.labels(bound).inc()
        self._metrics.refusals.labels(f"pull_{bound}").inc()
        self._metrics.rendezvous_ops.labels("get", "refused").inc()
        if not pulls.limit_logged:
            pulls.limit_logged = True  # once per peer until its outstanding pulls drain
            logger.warning(
                "%s has %d staged payloads (%d bytes) outstanding here, the most"
                " max_pulls_per_peer/max_pull_bytes_per_peer allow: refusing its further"
                " descriptors (velo_messenger_staged_pulls_refused_total)",
                peer,
                pulls.count,
                pulls.bytes,
            )
        self._tell_refusal(peer, lane, envelope, descriptor, limit, f"pull_{bound}")
        self._refuse(
            peer,
            lane,
            envelope,
            f"too many staged payloads outstanding from this sender ({bound} bound {limit})",
        )

    def _tell_refusal(
        self,
        peer: InstanceId,
        lane: int,
        envelope: Envelope,
        descriptor: StagedDescriptor,
        limit: int,
        reason: str,
        detail: str = "",
    ) -> None:
        """Tell every refusal hook that this descriptor's payload will never be delivered;
        one hook's bug must not keep the others from hearing."""
        refusal = StagedRefusal(
            peer, lane, envelope.handler, envelope.headers, descriptor.size, limit, reason, detail
        )
        for hook in self._refusal_hooks:
            try:
                hook(refusal)
            except Exception:
                logger.exception("staged refusal hook failed")

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
        try:
            if previous is not None and not previous.done():
                await asyncio.wait((previous,))
            await self._pull_and_deliver(peer, lane, envelope, descriptor)
        finally:
            self.pulls_outstanding -= 1
            self.pull_bytes_outstanding -= descriptor.size
            pulls = self._per_peer.get(peer)
            if pulls is not None:
                pulls.count -= 1
                pulls.bytes -= descriptor.size
                if pulls.count <= 0:
                    del self._per_peer[peer]

    async def _pull_and_deliver(
        self, peer: InstanceId, lane: int, envelope: Envelope, descriptor: StagedDescriptor
    ) -> None:
        started = time.monotonic()
        try:
            payload = await self._request(
                peer,
                encode_pull(PullOp.PULL, descriptor.staged_id),
                descriptor.size,
                self._config.pull_timeout,
            )
            if len(payload) != descriptor.size:
                raise TransportError(
                    f"pulled {len(payload)} bytes, descriptor said {descriptor.size}"
                )
        except (TransportError, TimeoutError) as exc:
            self._metrics.rendezvous_ops.labels("get", "error").inc()
            pulls = self._per_peer.get(peer)
            if pulls is None or not pulls.loss_logged:
                # Once per peer while it has pulls outstanding: a lost connection fails
                # them all, and one line says so (the count is in the metric).
                if pulls is not None:
                    pulls.loss_logged = True
                logger.warning(
                    "could not pull a staged %r payload from %s: %r", envelope.handler, peer, exc
                )
            else:
                logger.debug("could not pull a staged payload from %s: %r", peer, exc)
            detail = f"could not pull it from {peer}: {exc}"
            self._tell_refusal(peer, lane, envelope, descriptor, 0, "lost", detail)
            self._refuse(peer, lane, envelope, f"staged payload lost: {exc}")
            return
        self._metrics.rendezvous_ops.labels("get", "success").inc()
        self._metrics.rendezvous_bytes.labels("get").inc(len(payload))
        logger.debug(
            "pulled %d bytes from %s in %.3f s", len(payload), peer, time.monotonic() - started
        )
        self._deliver(peer, lane, envelope, payload)

    @property
    def releases_outstanding(self) -> int:
        """Requests to release a refused payload in flight, to every peer together."""
        return sum(self._releases.values())

    def _ask_release(self, peer: InstanceId, staged_id: int) -> None:
        """Ask ``peer`` to drop a payload refused for its size, within the per-peer bound.

        Each request is a task and a request stream for up to ``release_timeout``: without
        a bound, a peer sending oversized descriptors (a few dozen bytes each) made this
        node hold one of each per descriptor. Past ``max_releases_per_peer`` in flight the
        release is skipped and counted; the sender's ``staged_ttl`` frees the payload.
        """
        in_flight = self._releases.get(peer, 0)
        if in_flight >= self._config.max_releases_per_peer:
            self._metrics.staged_releases_skipped.inc()
            return
        self._releases[peer] = in_flight + 1
        self._keep(self._release_remote(peer, staged_id))

    async def _release_remote(self, peer: InstanceId, staged_id: int) -> None:
        try:
            await self._request(
                peer, encode_pull(PullOp.RELEASE, staged_id), 0, self._config.release_timeout
            )
        except (TransportError, TimeoutError) as exc:
            logger.debug("could not tell %s to release staged %x: %r", peer, staged_id, exc)
        finally:
            left = self._releases.get(peer, 0) - 1
            if left > 0:
                self._releases[peer] = left
            else:
                self._releases.pop(peer, None)

    def close(self) -> None:
        """Release everything staged (``closed``); the pulls ended with the messenger's
        tasks (one cancelled before it ran never counted itself out: nothing is left)."""
        self._store.close()
        self._per_peer.clear()
        self._releases.clear()
        self.pulls_outstanding = self.pull_bytes_outstanding = 0
