"""Request streams: a receiver asks its peer for bytes on a stream of their own.

Rendezvous needs the *receiving* node (the server of the sender's connection) to pull a
staged payload back from the sender without touching any lane, so a 16 MiB transfer never
holds up the small frames behind it. It does so on a server-initiated bidirectional QUIC
stream of the connection the descriptor arrived on: the request goes out with FIN, the
response comes back with FIN. QUIC's per-stream flow control keeps the transfer from
starving the lanes, and a lost packet of the transfer stalls only this stream.

Requests are small (bounded by ``MAX_REQUEST``); responses are bounded by the caller's
``max_response``, checked as bytes arrive, so a peer cannot make us buffer more than we
asked for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .errors import ChannelClosed, RequestRefused, ResponseTooLarge

if TYPE_CHECKING:
    from ..ids import InstanceId
    from .seam import QuicEngine

__all__ = ["MAX_REQUEST", "IncomingRequests", "OutgoingRequests", "Server"]

logger = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
_REFUSED = 0x201
"""Application error code on STOP_SENDING / RESET_STREAM of a refused request stream."""

Server = Callable[["InstanceId", bytes], Awaitable[bytes]]


class _Pending:
    __slots__ = ("chunks", "future", "limit", "size")

    def __init__(self, future: asyncio.Future[bytes], limit: int) -> None:
        self.future = future
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0


class _Partial:
    """The bytes of one incoming request so far, with their total kept as they arrive."""

    __slots__ = ("chunks", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        if data:
            self.chunks.append(data)
            self.size += len(data)

    def join(self) -> bytes:
        return b"".join(self.chunks)


class OutgoingRequests:
    """Requests this side (the accepting side of a connection) sent to its peer."""

    def __init__(self, quic: QuicEngine, transmit: Callable[[], None]) -> None:
        self._quic = quic
        self._transmit = transmit
        self._pending: dict[int, _Pending] = {}

    def start(self, request: bytes, max_response: int) -> asyncio.Future[bytes]:
        if len(request) > MAX_REQUEST:
            raise ValueError(f"request of {len(request)} bytes exceeds {MAX_REQUEST}")
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        stream_id = self._quic.get_next_available_stream_id(is_unidirectional=False)
        self._quic.send_stream_data(stream_id, request, end_stream=True)
        self._pending[stream_id] = _Pending(future, max_response)
        future.add_done_callback(lambda f: self._abandon(stream_id, f))
        self._transmit()
        return future

    @property
    def pending_count(self) -> int:
        """Requests sent and not yet answered, refused or abandoned (for snapshots)."""
        return len(self._pending)

    def owns(self, stream_id: int) -> bool:
        return stream_id in self._pending

    def data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        pending = self._pending.get(stream_id)
        if pending is None:
            return
        pending.size += len(data)
        if pending.size > pending.limit:
            self._fail(
                stream_id, ResponseTooLarge(f"response exceeds the {pending.limit} bytes asked for")
            )
            self._stop(stream_id)
            return
        if data:
            pending.chunks.append(data)
        if end_stream:
            del self._pending[stream_id]
            if not pending.future.done():
                pending.future.set_result(b"".join(pending.chunks))

    def reset(self, stream_id: int, error_code: int) -> None:
        self._fail(
            stream_id, RequestRefused(f"the peer refused the request (code {error_code:#x})")
        )

    def close(self, error: ChannelClosed) -> None:
        for stream_id in list(self._pending):
            self._fail(stream_id, error)

    def _fail(self, stream_id: int, error: Exception) -> None:
        pending = self._pending.pop(stream_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(error)

    def _abandon(self, stream_id: int, future: asyncio.Future[bytes]) -> None:
        """The caller gave up (cancelled or timed out): stop the peer sending the rest."""
        if future.cancelled() and self._pending.pop(stream_id, None) is not None:
            self._stop(stream_id)

    def _stop(self, stream_id: int) -> None:
        try:
            self._quic.stop_stream(stream_id, _REFUSED)
        except Exception:  # stream already finished: nothing left to stop
            logger.debug("could not stop request stream %d", stream_id, exc_info=True)
        self._transmit()


class IncomingRequests:
    """Requests the peer (the side that accepted our connection) sent to this side."""

    def __init__(
        self,
        quic: QuicEngine,
        transmit: Callable[[], None],
        serve: Server | None,
        peer: Callable[[], InstanceId | None],
        refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._quic = quic
        self._transmit = transmit
        self._serve = serve
        self._peer = peer
        self._count_refusal = refused
        """Told why each request was refused: ``request_too_large``, ``request_unserved``
        (no server here) or ``request_failed`` (the server raised)."""
        self._partial: dict[int, _Partial] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def partial_count(self) -> int:
        """Requests whose bytes are still arriving (for snapshots)."""
        return len(self._partial)

    @property
    def serving_count(self) -> int:
        """Requests received whole and being answered (for snapshots)."""
        return len(self._tasks)

    def data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        partial = self._partial.get(stream_id)
        if partial is None:
            partial = self._partial[stream_id] = _Partial()
        # A running length: re-summing the chunks on every STREAM frame made a peer
        # dribbling one-byte frames cost the receiver quadratic CPU.
        partial.add(data)
        if partial.size > MAX_REQUEST or self._serve is None:
            del self._partial[stream_id]
            self._count_refusal("request_unserved" if self._serve is None else "request_too_large")
            self._refuse(stream_id)
            return
        if not end_stream:
            return
        del self._partial[stream_id]
        peer = self._peer()
        assert peer is not None
        task = asyncio.get_running_loop().create_task(self._answer(stream_id, peer, partial.join()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, stream_id: int, peer: InstanceId, request: bytes) -> None:
        assert self._serve is not None
        try:
            response = await self._serve(peer, request)
        except Exception as exc:
            logger.debug("request on stream %d refused: %s", stream_id, exc)
            self._count_refusal("request_failed")
            self._refuse(stream_id)
            return
        try:
            self._quic.send_stream_data(stream_id, response, end_stream=True)
        except Exception:  # the requester stopped the stream meanwhile
            logger.debug("request stream %d gone before the answer", stream_id, exc_info=True)
        self._transmit()

    def _refuse(self, stream_id: int) -> None:
        try:
            self._quic.reset_stream(stream_id, _REFUSED)
            self._quic.stop_stream(stream_id, _REFUSED)
        except Exception:
            logger.debug("could not refuse request stream %d", stream_id, exc_info=True)
        self._transmit()

    def stopped(self, stream_id: int) -> None:
        """The requester abandoned the request (STOP_SENDING)."""
        self._partial.pop(stream_id, None)

    def reset(self, stream_id: int) -> None:
        """The requester reset the stream (RESET_STREAM) before its request was whole.

        Its bytes will never complete, so they are freed now rather than held until the
        connection closes.
        """
        self._partial.pop(stream_id, None)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._partial.clear()
