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

Both are charged what they really hold, not their payload: bytes arriving in many small
STREAM frames are appended to one ``bytearray`` per stream (a list of ``bytes`` chunks
cost about 40 bytes of object per chunk, 25 times the payload of 2-byte frames), and an
unfinished incoming request is charged its buffer's allocation plus
:data:`REQUEST_STREAM_COST` for the stream state it keeps here and in the QUIC stack. A
connection's unfinished requests together are held to :data:`MAX_PARTIAL_REQUEST_BYTES`;
the stream that would pass it is refused (``request_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..errors import ChannelClosed, RequestRefused, ResponseTooLarge

if TYPE_CHECKING:
    from ..ids import InstanceId
    from .seam import QuicEngine

__all__ = [
    "MAX_PARTIAL_REQUEST_BYTES",
    "MAX_REQUEST",
    "REQUEST_STREAM_COST",
    "IncomingRequests",
    "OutgoingRequests",
    "Server",
]

logger = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
"""The longest request accepted (a rendezvous pull or release is a few bytes)."""

REQUEST_STREAM_COST = 2048
"""What an unfinished incoming request stream costs beyond its buffer: our entry and the
QUIC stack's stream state (measured in tests/unit/test_requests.py)."""

MAX_PARTIAL_REQUEST_BYTES = 1024 * 1024
"""What one connection's unfinished incoming requests may hold together, each charged its
buffer plus :data:`REQUEST_STREAM_COST`: about 500 request streams half sent, where the
only requests a node sends (pulls and releases) are a few bytes each and whole at once."""
_REFUSED = 0x201
"""Application error code on STOP_SENDING / RESET_STREAM of a refused request stream."""

Server = Callable[["InstanceId", bytes], Awaitable[bytes]]


class _Pending:
    __slots__ = ("buffer", "future", "limit")

    def __init__(self, future: asyncio.Future[bytes], limit: int) -> None:
        self.future = future
        self.limit = limit
        self.buffer = bytearray()


class _Partial:
    """The bytes of one incoming request so far, in one buffer, and what they are charged."""

    __slots__ = ("buffer", "charged")

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.charged = 0

    def add(self, data: bytes) -> int:
        """Append ``data``; returns how much more the request is charged now."""
        self.buffer += data
        # The allocation, not the length: a bytearray over-allocates as it grows.
        charged = sys.getsizeof(self.buffer) + REQUEST_STREAM_COST
        grown = charged - self.charged
        self.charged = charged
        return grown


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
        if len(pending.buffer) + len(data) > pending.limit:
            self._fail(
                stream_id, ResponseTooLarge(f"response exceeds the {pending.limit} bytes asked for")
            )
            self._stop(stream_id)
            return
        pending.buffer += data
        if end_stream:
            del self._pending[stream_id]
            if not pending.future.done():
                pending.future.set_result(bytes(pending.buffer))

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
        """Told why each request was refused: ``request_too_large``, ``request_bytes``
        (the connection's unfinished requests would hold more than
        MAX_PARTIAL_REQUEST_BYTES), ``request_unserved`` (no server here) or
        ``request_failed`` (the server raised)."""
        self._partial: dict[int, _Partial] = {}
        self.partial_bytes = 0
        """What the unfinished requests are charged together (see the module docstring)."""
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
        self.partial_bytes += partial.add(data)
        refusal = None
        if self._serve is None:
            refusal = "request_unserved"
        elif len(partial.buffer) > MAX_REQUEST:
            refusal = "request_too_large"
        elif self.partial_bytes > MAX_PARTIAL_REQUEST_BYTES:
            refusal = "request_bytes"
        if refusal is not None:
            self._forget(stream_id)
            self._count_refusal(refusal)
            self._refuse(stream_id)
            return
        if not end_stream:
            return
        self._forget(stream_id)
        peer = self._peer()
        assert peer is not None
        task = asyncio.get_running_loop().create_task(
            self._answer(stream_id, peer, bytes(partial.buffer))
        )
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

    def _forget(self, stream_id: int) -> None:
        partial = self._partial.pop(stream_id, None)
        if partial is not None:
            self.partial_bytes -= partial.charged

    def stopped(self, stream_id: int) -> None:
        """The requester abandoned the request (STOP_SENDING)."""
        self._forget(stream_id)

    def reset(self, stream_id: int) -> None:
        """The requester reset the stream (RESET_STREAM) before its request was whole.

        Its bytes will never complete, so they are freed now rather than held until the
        connection closes.
        """
        self._forget(stream_id)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._partial.clear()
        self.partial_bytes = 0
