"""A connection's receive side alone: no engine, no socket, no loop, a clock of its own.

:class:`InboundStreams` is given its connection, its endpoint and its engine as doubles
that record what it asks of them, STREAM events as the engine would hand them over, and
``now``; each test reads what reached the handler, what was counted and what it asked
its connection to do (close, transmit, wake for an opening).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from velomux_quic.ids import InstanceId
from velomux_quic.transport.admission import PeerHoldings
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.events import PeerLink, StreamData, StreamReset
from velomux_quic.transport.framing import frame_header
from velomux_quic.transport.handler import TransportHandler
from velomux_quic.transport.inbound import InboundStreams
from velomux_quic.transport.lanes import FIRST_EXTRA_STREAM, stream_of_lane
from velomux_quic.transport.metrics import TransportStats
from velomux_quic.transport.requests import IncomingRequests, OutgoingRequests
from velomux_quic.transport.seam import StreamDataReceived
from velomux_quic.transport.states import CloseCode

PEER = InstanceId(uuid.UUID(int=7))


def frame(body: bytes) -> bytes:
    return frame_header(len(body)) + body


class Handler(TransportHandler):
    def __init__(self) -> None:
        self.frames: list[tuple[int, bytes]] = []
        self.streams: list[StreamData] = []
        self.resets: list[StreamReset] = []
        self.lane_resets: list[int] = []
        self.claim = True
        self.on_frame: Callable[[], None] | None = None

    def frame_received(self, peer: InstanceId, lane: int, body: bytes) -> None:
        self.frames.append((lane, body))
        if self.on_frame is not None:
            self.on_frame()

    def lane_reset(self, peer: InstanceId, lane: int) -> None:
        self.lane_resets.append(lane)

    def stream_received(self, link: PeerLink, event: StreamData) -> bool:
        self.streams.append(event)
        return self.claim

    def stream_reset(self, link: PeerLink, event: StreamReset) -> None:
        self.resets.append(event)


class Engine:
    """What the receive side asks of an engine, recorded."""

    def __init__(self) -> None:
        self.windows: dict[int, tuple[Callable[[], int], int]] = {}
        self.forgotten: list[int] = []
        self.stopped: list[tuple[int, int]] = []

    def manage_receive_window(
        self, stream_id: int, consumed: Callable[[], int], window: int
    ) -> None:
        self.windows[stream_id] = (consumed, window)

    def forget_stream(self, stream_id: int) -> None:
        self.forgotten.append(stream_id)

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        self.stopped.append((stream_id, error_code))


class Side:
    """The connection and the endpoint around one InboundStreams: its host and its owner."""

    def __init__(self, is_client: bool = False, **settings: object) -> None:
        self.now = 100.0
        self.config = TransportConfig(**settings)  # type: ignore[arg-type]
        self.handler = Handler()
        self.stats = TransportStats()
        self.paused: set[int] = set()
        self.engine = Engine()
        self.closes: list[tuple[CloseCode, str]] = []
        self.transmits = 0
        self.openings_at: list[float] = []
        self.link = PeerLink(PEER, is_client, self)  # type: ignore[arg-type]
        self.inbound = InboundStreams(
            self,
            self,
            self.engine,
            lambda: self.now,
            is_client=is_client,
            requests_in=IncomingRequests(self.engine, self.transmit_soon, None, lambda: PEER),  # type: ignore[arg-type]
            requests_out=OutgoingRequests(self.engine, self.transmit_soon),  # type: ignore[arg-type]
        )

    # the host (the connection)
    def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None:
        self.closes.append((code, reason))
        self.inbound.closing()

    def transmit_soon(self) -> None:
        self.transmits += 1

    def openings_due(self, at: float) -> None:
        self.openings_at.append(at)

    # the owner (the endpoint)
    def is_reading_paused(self, peer: InstanceId, lane: int) -> bool:
        return lane in self.paused

    def establish(self, holdings: PeerHoldings | None = None) -> float | None:
        return self.inbound.established(self.link, holdings, self.now)

    def data(self, stream_id: int, data: bytes, end: bool = False) -> None:
        self.inbound.stream_data(StreamDataReceived(stream_id=stream_id, data=data, end_stream=end))


def test_a_lanes_frames_reach_the_handler_whatever_the_cut_of_its_bytes() -> None:
    side = Side()
    side.establish()
    wire = frame(b"one") + frame(b"two") + frame(b"three")
    lane2 = stream_of_lane(2)
    for cut in (wire[:5], wire[5:9], wire[9:]):
        side.data(lane2, cut)
    assert side.handler.frames == [(2, b"one"), (2, b"two"), (2, b"three")]
    assert side.stats.frames_in == 3
    consumed, window = side.engine.windows[lane2]
    assert consumed() == len(wire) and window == side.config.lane_window
    assert side.inbound.lanes == (2,)
    side.data(lane2, b"", end=True)
    assert side.inbound.lanes == () and side.engine.forgotten == [lane2]
    assert side.closes == []


def test_data_before_the_peer_is_verified_closes_the_connection() -> None:
    side = Side()
    side.data(stream_of_lane(0), frame(b"early"))
    assert side.handler.frames == []
    assert side.stats.rejections["unverified_data"] == 1
    assert side.closes == [(CloseCode.UNVERIFIED_PEER, "data before verification")]


def test_a_paused_lane_holds_its_frames_and_resuming_delivers_them_in_order() -> None:
    side = Side()
    side.establish()
    lane = stream_of_lane(1)
    side.handler.on_frame = lambda: side.inbound.pause_reading(1)  # paused by its first frame
    side.data(lane, frame(b"a") + frame(b"b"))
    side.data(lane, frame(b"c"))  # kept raw, unconsumed
    assert side.handler.frames == [(1, b"a")]
    assert side.engine.windows[lane][0]() == len(frame(b"a") + frame(b"b"))
    side.handler.on_frame = None
    side.inbound.resume_reading(1)
    assert side.handler.frames == [(1, b"a"), (1, b"b"), (1, b"c")]
    assert side.transmits == 1  # what was consumed opens the peer's window


def test_a_lane_the_endpoint_has_paused_starts_paused() -> None:
    side = Side()
    side.paused.add(3)
    side.establish()
    side.data(stream_of_lane(3), frame(b"held"))
    assert side.handler.frames == []
    side.inbound.resume_reading(3)
    assert side.handler.frames == [(3, b"held")]


def test_unfinished_frames_past_the_peers_bound_close_the_connection_that_passed_it() -> None:
    holdings = PeerHoldings(1 << 30)
    bounds = {"max_message_size": 1000, "max_partial_frame_bytes": 1000}
    first, second = Side(**bounds), Side(**bounds)
    first.establish(holdings)
    second.establish(holdings)
    first.data(stream_of_lane(0), frame_header(900) + b"x" * 600)
    held = len(frame_header(900)) + 600  # the header is part of the unfinished frame
    assert first.inbound.partial_bytes == holdings.partial_bytes == held
    second.data(stream_of_lane(0), frame_header(900) + b"x" * 600)  # twice that for the peer
    assert first.closes == []
    assert second.closes == [(CloseCode.FRAME_TOO_LARGE, "too many bytes of unfinished frames")]
    assert second.stats.rejections["partial_frame_bytes"] == 1
    # Closing (as the connection does on its close) lets its unfinished frame go at once,
    # not when the close has drained: the peer's other connection goes on under the bound.
    second.inbound.closing()
    assert holdings.partial_bytes == held
    assert second.inbound.partial_bytes == 0 and second.inbound.lanes == ()
    first.data(stream_of_lane(0), b"x" * 90)
    assert first.closes == []
    second.inbound.ended()
    assert holdings.partial_bytes == held + 90


def test_an_oversized_frame_closes_the_connection_after_the_frames_before_it() -> None:
    side = Side(max_message_size=100)
    side.establish()
    side.data(stream_of_lane(0), frame(b"ok") + frame_header(101))
    assert side.handler.frames == [(0, b"ok")]
    assert side.stats.rejections["oversized_frame"] == 1
    assert side.closes[0][0] is CloseCode.FRAME_TOO_LARGE


def test_the_sweep_closes_on_a_frame_that_stalled_and_spares_one_that_moves() -> None:
    side = Side(partial_frame_timeout=5.0)
    at = side.establish()
    assert at == side.now + 5.0
    moving, stalled = stream_of_lane(0), stream_of_lane(1)
    side.data(moving, frame_header(100) + b"x")
    side.data(stalled, frame_header(100) + b"x")
    side.now = at
    at = side.inbound.sweep(side.now)  # the first look: both began since
    assert at == side.now + 5.0 and side.closes == []
    side.data(moving, b"y")
    side.now = at
    assert side.inbound.sweep(side.now) is None
    assert side.closes == [(CloseCode.FRAME_TOO_LARGE, "an unfinished frame stalled")]
    assert side.stats.rejections["partial_frame_timeout"] == 1
    assert side.inbound.sweep(side.now + 5.0) is None  # closing: no more sweeps


def test_a_dialed_connection_reads_no_lanes_and_is_never_swept() -> None:
    side = Side(is_client=True)
    assert side.establish() is None
    side.data(stream_of_lane(0), frame(b"x"))
    assert side.stats.rejections["unexpected_stream"] == 1
    assert side.engine.stopped == [(stream_of_lane(0), int(CloseCode.SHUTDOWN))]
    assert side.closes == []


def test_an_opening_not_finished_in_time_is_refused_at_the_deadline_it_reported() -> None:
    side = Side(stream_opening_timeout=2.0)
    side.establish()
    stream = FIRST_EXTRA_STREAM
    side.data(stream, frame_header(16) + b"half")
    assert side.openings_at == [side.now + 2.0]
    assert side.inbound.openings_pending == 1
    side.now += 1.0
    side.data(stream + 4, frame_header(16))  # a second: the deadline reported stays the first
    assert side.openings_at == [side.now + 1.0]
    assert side.inbound.expire_openings(side.now + 1.0) == side.now + 2.0
    assert side.handler.resets == [StreamReset(stream, int(CloseCode.SHUTDOWN))]
    assert side.stats.rejections["stream_opening_timeout"] == 1
    assert (stream, int(CloseCode.SHUTDOWN)) in side.engine.stopped
    side.data(stream, b"late")  # dropped, counted once
    assert side.stats.rejections["stream_opening_timeout"] == 1
    assert side.inbound.expire_openings(side.now + 2.0) is None
    assert side.inbound.openings_pending == 0


def test_an_opening_past_its_size_is_refused_at_once() -> None:
    side = Side(max_stream_opening_size=16)
    side.establish()
    side.data(FIRST_EXTRA_STREAM, frame_header(17))
    assert side.stats.rejections["stream_opening_size"] == 1
    assert side.handler.streams == [] and side.openings_at == []


def test_a_stream_no_receiver_claims_is_refused_without_harm() -> None:
    side = Side()
    side.establish()
    side.handler.claim = False
    side.data(FIRST_EXTRA_STREAM, frame(b"x" * 16))
    assert side.stats.rejections["unexpected_stream"] == 1
    assert side.engine.stopped == [(FIRST_EXTRA_STREAM, int(CloseCode.SHUTDOWN))]
    assert side.closes == []


def test_resets_reach_the_lane_or_the_streams_receiver() -> None:
    holdings = PeerHoldings(1 << 30)
    side = Side()
    side.establish(holdings)
    lane = stream_of_lane(4)
    side.data(lane, frame_header(50) + b"x" * 10)
    assert holdings.partial_bytes == len(frame_header(50)) + 10
    side.inbound.stream_reset(lane, int(CloseCode.READER_BEHIND))
    assert side.handler.lane_resets == [4]
    assert side.stats.rejections["reader_behind"] == 1
    assert holdings.partial_bytes == side.inbound.partial_bytes == 0
    side.inbound.stream_reset(FIRST_EXTRA_STREAM, 9)
    assert side.handler.resets == [StreamReset(FIRST_EXTRA_STREAM, 9)]


def test_a_peer_past_its_turn_waits_for_the_next_one() -> None:
    soon: list[Callable[[], None]] = []
    holdings = PeerHoldings(1 << 30, turn_bytes=10, call_soon=soon.append)
    side = Side()
    side.establish(holdings)
    lane = stream_of_lane(0)
    side.data(lane, frame(b"x" * 12))  # cut at the share: the rest waits for the next turn
    side.data(lane, frame(b"y"))  # kept behind it
    assert side.handler.frames == []
    assert side.stats.turns_waited == 1
    for call in soon:  # the loop turns, each scheduling the next while data waits
        call()
        assert side.stats.turns_waited <= len(soon)
    assert len(soon) >= 2  # the rest took more than one further turn of 10 bytes
    assert side.handler.frames == [(0, b"x" * 12), (0, b"y")]
    assert side.transmits >= 1  # the consumed bytes open the peer's window


def test_nothing_arrives_once_the_connection_is_closing() -> None:
    side = Side()
    side.establish()
    side.inbound.closing()
    side.data(stream_of_lane(0), frame(b"late"))
    assert side.handler.frames == []
    # Data in flight when this side closed is nobody's now, not a refusal of the peer.
    assert side.stats.rejections["unverified_data"] == 0
    assert side.closes == []


def test_data_before_verification_is_refused() -> None:
    side = Side()
    side.data(stream_of_lane(0), frame(b"early"))
    assert side.handler.frames == []
    assert side.stats.rejections["unverified_data"] == 1
    assert side.closes == [(CloseCode.UNVERIFIED_PEER, "data before verification")]
