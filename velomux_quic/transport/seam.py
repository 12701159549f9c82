"""The QUIC engine seam: what a connection asks of the QUIC implementation under it.

Two engines sit behind it (docs/transport.md, "Two QUIC engines"): aioquic
(the default, :mod:`.aioquic_engine`) and qh3, whose transport core is Rust (:mod:`.qh3_engine`,
the optional ``velomux_quic[qh3]`` extra). The seam is aioquic's own shape: a sans-IO
connection fed datagrams and ``now``, which returns datagrams to send, its next timer and
the small events below. :class:`~.connection.PeerConnection` (lanes, requests, admission,
keep-alive, the snapshot) talks to a :class:`QuicEngine` only, never to aioquic's or
qh3's classes; whatever reads an engine's private state lives in that engine's adapter,
pinned by its assumptions test (``tests/unit/test_aioquic_assumptions.py``,
``tests/unit/test_qh3_assumptions.py``).

The events are the project's own, so no engine's event classes cross the seam. They are
built once per STREAM frame on the receive path: keep them small (slotted dataclasses,
not frozen: a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``),
and the connection matches them on their type.

What one engine cannot do the other can is said by its :class:`EngineFeatures`, which the
connection reads (it never asks "which engine?") and the node snapshot reports.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..ids import InstanceId
from ..security.verify import PeerVerificationError

__all__ = [
    "ENGINE_FAILURE_REASON",
    "ENGINE_NAMES",
    "ConnectionIdIssued",
    "ConnectionIdRetired",
    "ConnectionTerminated",
    "EngineEvent",
    "EngineFeatures",
    "EngineName",
    "HandshakeCompleted",
    "NetworkAddress",
    "PingAcknowledged",
    "QuicEngine",
    "StopSendingReceived",
    "StreamDataReceived",
    "StreamReset",
]

EngineName = Literal["aioquic", "qh3"]
ENGINE_NAMES: tuple[EngineName, ...] = ("aioquic", "qh3")

ENGINE_FAILURE_REASON = "engine error"
"""How the reason of a :class:`ConnectionTerminated` begins when the engine itself failed
(its internal state broke, not the peer or the path): the transport counts those."""

NetworkAddress = tuple[str, int]
Consumed = Callable[[], int]


@dataclass(slots=True)
class StreamDataReceived:
    """Bytes that arrived, in order, on a stream (with FIN when ``end_stream``)."""

    stream_id: int
    data: bytes
    end_stream: bool


def gather_stream_data(
    first: Any, queue: collections.deque[Any], piece: type[Any]
) -> StreamDataReceived:
    """An engine's stream-data event ``first`` (of type ``piece``, with ``stream_id``,
    ``data`` and ``end_stream``, just taken off the engine's event ``queue``) and every
    piece of any stream right behind it, as one event a stream.

    One piece costs the layers above far less than several, and an engine's writer takes
    the streams with data in turn, a packet each (qh3's and aioquic's both do), so a burst
    of several lanes arrives as one piece per datagram, the streams interleaved. The first
    stream's event is returned; the others go back to the front of ``queue`` as this
    seam's events, in the order their streams first appeared, for the engine's adapter to
    hand over as they are. Streams are independent, so the order between them is free;
    each stream's own pieces stay in order, and its end comes with its last. The run ends
    at the first event of another type, which keeps its place after them."""
    if not queue or type(queue[0]) is not piece:
        return StreamDataReceived(first.stream_id, first.data, first.end_stream)
    gathered: dict[int, list[bytes]] = {first.stream_id: [first.data]}
    ended = {first.stream_id} if first.end_stream else set()
    while queue and type(queue[0]) is piece:
        event = queue.popleft()
        pieces = gathered.get(event.stream_id)
        if pieces is None:
            gathered[event.stream_id] = [event.data]
        else:
            pieces.append(event.data)
        if event.end_stream:
            ended.add(event.stream_id)
    joined = [
        StreamDataReceived(
            stream_id, pieces[0] if len(pieces) == 1 else b"".join(pieces), stream_id in ended
        )
        for stream_id, pieces in gathered.items()
    ]
    queue.extendleft(reversed(joined[1:]))
    return joined[0]


@dataclass(slots=True)
class StreamReset:
    """The peer aborted a stream it was writing (RESET_STREAM)."""

    stream_id: int
    error_code: int


@dataclass(slots=True)
class StopSendingReceived:
    """The peer asked us to stop writing a stream (STOP_SENDING)."""

    stream_id: int
    error_code: int


@dataclass(slots=True)
class ConnectionIdIssued:
    """The engine made a new host connection ID: the endpoint must route it."""

    connection_id: bytes


@dataclass(slots=True)
class ConnectionIdRetired:
    """A host connection ID is retired: the endpoint stops routing it."""

    connection_id: bytes


@dataclass(slots=True)
class HandshakeCompleted:
    """The TLS handshake finished on this side (for a client: not yet confirmed)."""


@dataclass(slots=True)
class PingAcknowledged:
    """The peer acknowledged the PING sent with ``uid``."""

    uid: int


@dataclass(slots=True)
class ConnectionTerminated:
    """The connection ended: closed by either side, timed out, or refused."""

    error_code: int
    frame_type: int | None
    reason_phrase: str


EngineEvent = (
    StreamDataReceived
    | StreamReset
    | StopSendingReceived
    | ConnectionIdIssued
    | ConnectionIdRetired
    | HandshakeCompleted
    | PingAcknowledged
    | ConnectionTerminated
)


@dataclass(frozen=True, slots=True)
class EngineFeatures:
    """What an engine does, where the two differ. Reported in the node snapshot.

    The connection adapts to these instead of asking which engine it runs on.
    """

    name: EngineName
    """``aioquic`` or ``qh3``."""
    version: str
    """The engine package's version."""
    live_datagram_size: bool
    """The datagram size can change on a live connection (loopback size chosen after the
    handshake, path MTU search, black-hole fallback). Without it the size is fixed when
    the connection is made, from the same plan."""
    mtu_probes: bool
    """Padded PING probes above the current size, kept out of congestion control, and
    losses reported by size: what DPLPMTUD (``pmtu_discovery``) needs."""
    receive_backpressure: Literal["stream", "connection"]
    """How a reader that stops reading holds its writer back. ``stream``: the stream's
    receive window stops growing, nothing else waits. ``connection``: once that stream is
    a whole window ahead of its reader, the connection stops taking stream data from the
    engine until the reader catches up, so the other streams of that connection wait too
    (memory stays bounded either way)."""
    derived_reset_tokens: Literal["all", "first"]
    """Which connection IDs carry a stateless reset token derived from the node's key (so
    this node can reset them after losing the connection): every one, or only the first
    one a server advertises in its transport parameters."""
    gso: bool
    """Can hand the socket several datagrams in one segmentation-offload send."""
    loopback_datagram_size: int
    """The datagram size to a peer on this host when ``TransportConfig.loopback_datagram_size``
    is ``"auto"``: the largest that does not slow the engine's first writes on a new
    connection."""


class QuicEngine(Protocol):
    """One QUIC connection, sans-IO, as :class:`~.connection.PeerConnection` drives it.

    Time is passed in (``now``, the event loop's clock); nothing here does I/O. Datagrams
    go in with :meth:`receive_datagram`, out with :meth:`datagrams_to_send`; the engine
    wants :meth:`handle_timer` at :meth:`get_timer`; :meth:`poll_event` yields what
    happened. Stream offsets and byte counts are per stream, in bytes written by us.
    """

    features: EngineFeatures
    host_cid: bytes
    cid_minted: Callable[[bytes], None] | None
    """Called with each host connection ID as it is made (before it is ever sent)."""
    accepted_datagram_size: int
    """The largest datagram we ask the peer to send (set before the handshake)."""
    mtu_probe_observer: Callable[[int, bool], None] | None
    large_loss_observer: Callable[[int], None] | None
    large_packet_threshold: int

    # -- lifecycle and I/O ---------------------------------------------------------------

    def connect(self, addr: NetworkAddress, now: float) -> None: ...

    def receive_datagram(self, data: bytes, addr: NetworkAddress, now: float) -> None: ...

    def receive_datagrams(self, datagrams: list[bytes], addr: NetworkAddress, now: float) -> None:
        """Datagrams that arrived together, taken as ``receive_datagram`` takes each; the
        events they make are read after the last (an engine may join a stream's pieces)."""

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, NetworkAddress]]: ...

    def get_timer(self) -> float | None: ...

    def handle_timer(self, now: float) -> None: ...

    def poll_event(self) -> EngineEvent | None: ...

    def close(
        self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = ""
    ) -> None: ...

    def send_ping(self, uid: int) -> None: ...

    def ack_due(self, now: float) -> bool:
        """Whether a transmit now would carry an acknowledgement the peer is owed."""

    def acknowledge_now(self) -> None:
        """Make the owed acknowledgement leave with the next transmit."""

    # -- identity ------------------------------------------------------------------------

    @property
    def verified_peer(self) -> InstanceId | None: ...

    @property
    def verification_error(self) -> PeerVerificationError | None: ...

    @property
    def handshake_confirmed(self) -> bool: ...

    def presented_certificates(self) -> tuple[bytes | None, bytes | None]:
        """(our certificate, the peer's once verified), DER."""

    # -- connection IDs and stateless resets ---------------------------------------------

    def peer_reset_tokens(self) -> list[bytes]: ...

    @property
    def peer_close(self) -> ConnectionTerminated | None:
        """The CONNECTION_CLOSE the peer sent, once taken: the connection drains until its
        termination reports it, and a stateless reset that arrives meanwhile only says the
        peer has let go of its closing state (it must not replace the peer's reason)."""

    def adopt_resettable_peer_cid(self) -> bool: ...

    # -- streams -------------------------------------------------------------------------

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int: ...

    def open_send_stream(self, stream_id: int) -> None: ...

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None: ...

    def reset_stream(self, stream_id: int, error_code: int) -> None: ...

    def stop_stream(self, stream_id: int, error_code: int) -> None: ...

    def stream_room(self, stream_id: int, send_buffer: int) -> int: ...

    def stream_idle(self, stream_id: int) -> bool: ...

    def stream_unsent(self, stream_id: int) -> int: ...

    def stream_beyond_window(self, stream_id: int) -> int: ...

    def stream_unacked(self, stream_id: int) -> int: ...

    def track_send_backlog(self, stream_id: int) -> None: ...

    @property
    def send_backlog(self) -> int:
        """Bytes the streams of :meth:`track_send_backlog` hold inside their peer windows,
        never transmitted (the per-stream path's shared bound)."""

    def manage_receive_window(self, stream_id: int, consumed: Consumed, window: int) -> None: ...

    def forget_stream(self, stream_id: int) -> None: ...

    def poll_receive_gate(self) -> bool:
        """Re-check streams held for their readers; True when held stream data became
        available to :meth:`poll_event` (only a ``connection``-backpressure engine holds)."""

    # -- datagram size -------------------------------------------------------------------

    @property
    def datagram_size(self) -> int: ...

    @property
    def peer_max_udp_payload_size(self) -> int: ...

    @property
    def probe_timeout(self) -> float: ...

    def set_datagram_size(self, size: int) -> None: ...

    def send_mtu_probe(self, size: int, now: float) -> list[tuple[bytes, NetworkAddress]]: ...
