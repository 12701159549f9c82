"""A connection's send side alone: no engine, no socket, no loop, a clock of its own.

:class:`OutboundStreams` is given its connection, its endpoint and its engine as doubles:
the engine takes what is written and holds it unacknowledged until the test says the
peer acknowledged it, then the test tells the send side that datagrams arrived, at a
``now`` of its choosing, and reads what was admitted, counted, reported and closed.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

from velomux_quic.errors import ChannelClosed, TransportError
from velomux_quic.ids import InstanceId
from velomux_quic.transport.admission import ADMITTED, AdmissionState, PeerLedger, SendAdmission
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.framing import FRAME_HEADER_SIZE
from velomux_quic.transport.handler import TransportHandler
from velomux_quic.transport.lanes import OutboundStream, stream_of_lane
from velomux_quic.transport.metrics import TransportStats
from velomux_quic.transport.outbound import OutboundStreams
from velomux_quic.transport.states import CloseCode

PEER = InstanceId(uuid.UUID(int=9))


class Engine:
    """Streams that take every write and hold it unacknowledged until :meth:`ack`."""

    def __init__(self) -> None:
        self.unacked: dict[int, int] = defaultdict(int)
        self.resets: list[tuple[int, int]] = []
        self.room = 1 << 30
        self.send_backlog = 0

    def open_send_stream(self, stream_id: int) -> None:
        pass

    def track_send_backlog(self, stream_id: int) -> None:
        pass

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        self.unacked[stream_id] += len(data)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self.resets.append((stream_id, error_code))

    def stream_room(self, stream_id: int, send_buffer: int) -> int:
        return self.room

    def stream_idle(self, stream_id: int) -> bool:
        return True

    def stream_unsent(self, stream_id: int) -> int:
        return 0

    def stream_beyond_window(self, stream_id: int) -> int:
        return 0

    def stream_unacked(self, stream_id: int) -> int:
        return self.unacked[stream_id]

    def ack(self, stream_id: int | None = None) -> None:
        for each in list(self.unacked) if stream_id is None else [stream_id]:
            self.unacked[each] = 0


class Handler(TransportHandler):
    def __init__(self) -> None:
        self.failed: list[tuple[int, str]] = []

    def send_failed(self, peer: InstanceId, lane: int, error: TransportError) -> None:
        self.failed.append((lane, str(error)))


class Side:
    """The connection and the endpoint around one OutboundStreams."""

    def __init__(self, **settings: object) -> None:
        self.now = 0.0
        self.config = TransportConfig(**settings)  # type: ignore[arg-type]
        self.handler = Handler()
        self.stats = TransportStats()
        self.quic = Engine()
        self.established = True
        self.closes: list[tuple[CloseCode, str]] = []
        self.transmits = 0
        self.outbound = OutboundStreams(self, self, self.quic, self.now)  # type: ignore[arg-type]
        self.inflight = self.outbound.inflight

    # the host (the connection), which its streams see as their StreamHost
    def stream_blocked(self, stream: OutboundStream) -> None:
        self.outbound.stream_blocked(stream)

    def stream_done(self, stream: OutboundStream) -> None:
        self.outbound.stream_done(stream)

    def transmit_soon(self) -> None:
        self.transmits += 1

    def transmit(self) -> None:
        self.transmits += 1

    def close(self, code: CloseCode = CloseCode.SHUTDOWN, reason: str = "") -> None:
        self.closes.append((code, reason))
        self.established = False

    def peer_name(self) -> str:
        return str(PEER)

    def arrived(self, seconds: float = 0.0) -> None:
        """Datagrams arrived (``seconds`` later)."""
        self.now += seconds
        self.outbound.datagrams_arrived(self.now)


def written(size: int) -> int:
    return size + FRAME_HEADER_SIZE


def test_past_the_cap_a_send_waits_until_the_peer_acknowledges() -> None:
    side = Side(max_unacked_bytes=written(1000) * 2, max_unacked_bytes_per_peer=1 << 30)
    side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    assert side.outbound.send(0, b"x" * 1000) is ADMITTED
    assert side.outbound.send(0, b"x" * 1000) is ADMITTED
    waiting = side.outbound.send(0, b"y")
    assert isinstance(waiting, SendAdmission) and not waiting.done()
    side.outbound.send(0, b"z")
    assert side.stats.unacked_cap_reached == 1  # once per time the cap is reached
    assert side.outbound.waiting() == (1, 0)
    side.arrived()  # nothing acknowledged yet
    assert not waiting.done()
    side.quic.ack()
    side.arrived()
    assert waiting.state is AdmissionState.ADMITTED
    assert side.outbound.unacked_total() == written(1) * 2


def test_room_acknowledged_on_one_connection_admits_the_peers_other() -> None:
    ledger = PeerLedger(written(100))
    first, second = Side(), Side()
    first.outbound.join(ledger, PEER, 0.0)
    second.outbound.join(ledger, PEER, 0.0)
    assert first.outbound.send(0, b"a" * 100) is ADMITTED
    waiting = second.outbound.send(0, b"b")  # the peer's cap is reached
    assert isinstance(waiting, SendAdmission) and not waiting.done()
    first.quic.ack()
    first.arrived()  # wakes the peer's other connection
    assert waiting.state is AdmissionState.ADMITTED
    first.outbound.leave(ledger, PEER)
    assert len(ledger) == 1


def test_per_stream_writes_count_towards_the_cap_and_wait_past_it_in_their_turn() -> None:
    """A per-stream stream's own bounds count only what was not transmitted; what the peer
    holds unacknowledged is the connection's cap, which these streams count towards as the
    lanes do, however large the windows the peer grants."""
    side = Side(max_unacked_bytes=written(1000) * 2, max_unacked_bytes_per_peer=1 << 30)
    side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    first, second = side.outbound.open_stream(1 << 20), side.outbound.open_stream(1 << 20)
    assert first.send(b"x" * 1000) is ADMITTED
    assert second.send(b"x" * 1000) is ADMITTED
    assert side.inflight.unacked == side.inflight.streams == written(1000) * 2
    waiting = first.send(b"y")
    behind = second.send(b"z")
    assert isinstance(waiting, SendAdmission) and isinstance(behind, SendAdmission)
    assert not waiting.done() and not behind.done()
    assert side.outbound.send(0, b"lane") is not ADMITTED  # the lanes share the cap
    assert side.stats.unacked_cap_reached == 1
    side.arrived()  # nothing acknowledged: the count is taken afresh and still full
    assert not waiting.done() and side.inflight.streams == written(1000) * 2
    side.quic.ack(first.stream_id)
    side.arrived()
    assert waiting.state is AdmissionState.ADMITTED and behind.state is AdmissionState.ADMITTED
    assert side.inflight.streams == written(1000) + written(1) * 2


def test_a_per_stream_frame_larger_than_the_cap_goes_alone_below_it() -> None:
    """As on an idle lane: the most held is the cap plus one frame, never a frame that can
    never be sent."""
    side = Side(max_unacked_bytes=written(100))
    side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    stream = side.outbound.open_stream(1 << 20)
    assert stream.send(b"x" * 1000) is ADMITTED
    waiting = stream.send(b"y")
    assert isinstance(waiting, SendAdmission) and not waiting.done()
    side.quic.ack()
    side.arrived()
    assert waiting.state is AdmissionState.ADMITTED


def test_an_acknowledging_per_stream_peer_is_recounted_only_past_half_the_cap() -> None:
    """Between counts the per-stream part only grows (an estimate that errs towards waiting);
    it is walked afresh once it could decide: past half the cap, where the stall clock
    runs, so an honest peer's streams are never closed for an overestimate."""
    side = Side(max_unacked_bytes=written(100) * 4, unacked_timeout=8.0)
    at = side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    stream = side.outbound.open_stream(1 << 20)
    stream.send(b"x" * 100)
    side.quic.ack()
    side.arrived()
    assert side.inflight.streams == written(100)  # below half: not walked, an upper bound
    for _ in range(20):
        assert stream.send(b"x" * 100) is ADMITTED
        side.quic.ack()
        side.arrived()
        assert side.inflight.unacked * 2 <= side.inflight.limit
        assert at is not None
        side.now = at
        at = side.outbound.check_stall(side.now)
    assert side.closes == [] and side.stats.unacked_cap_reached == 0


def test_a_peer_that_never_acknowledges_per_stream_writes_is_closed_at_the_stall_check() -> None:
    side = Side(max_unacked_bytes=written(100), unacked_timeout=8.0)
    at = side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    side.outbound.open_stream(1 << 20).send(b"x" * 60)  # above half, never acknowledged
    while at is not None:
        side.now = at
        at = side.outbound.check_stall(side.now)
    assert side.closes == [(CloseCode.UNACKNOWLEDGED, "nothing acknowledged for too long")]


def test_a_peer_holding_the_connection_above_half_its_cap_is_closed_at_the_stall_check() -> None:
    side = Side(max_unacked_bytes=written(100), unacked_timeout=8.0)
    at = side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    assert at == 2.0  # a quarter of unacked_timeout
    side.outbound.send(0, b"x" * 60)  # above half, never acknowledged
    while at is not None:
        side.now = at
        at = side.outbound.check_stall(side.now)
    assert side.now == 8.0  # calm last seen before the send, unacked_timeout before
    assert side.closes == [(CloseCode.UNACKNOWLEDGED, "nothing acknowledged for too long")]
    assert side.stats.rejections["unacked_stall"] == 1


def test_an_acknowledging_peer_is_checked_on_and_on() -> None:
    side = Side(max_unacked_bytes=written(100), unacked_timeout=8.0)
    at = side.outbound.join(PeerLedger(1 << 30), PEER, side.now)
    for _ in range(20):
        side.outbound.send(0, b"x" * 60)
        side.quic.ack()
        assert at is not None
        side.now = at
        at = side.outbound.check_stall(side.now)
    assert side.closes == []
    side.established = False
    assert side.outbound.check_stall(side.now) is None


def test_delivery_callers_are_told_when_acknowledged_or_never() -> None:
    side = Side()
    told: list[tuple[str, bool]] = []
    side.outbound.on_delivered(3, lambda ok: told.append(("no lane", ok)))
    side.outbound.send(3, b"x")
    side.outbound.send(4, b"y")
    side.outbound.on_delivered(3, lambda ok: told.append(("three", ok)))
    side.outbound.on_delivered(4, lambda ok: told.append(("four", ok)))
    side.quic.ack(stream_of_lane(3))
    side.arrived()
    side.outbound.reset_lane(4)
    assert told == [("no lane", False), ("three", True), ("four", False)]
    assert side.quic.resets == [(stream_of_lane(4), int(CloseCode.KILLED))]
    side.outbound.send(3, b"z")
    side.outbound.on_delivered(3, lambda ok: told.append(("ended", ok)))
    side.outbound.ended()
    assert told[-1] == ("ended", False)


def test_what_the_peer_never_acknowledged_is_reported_per_lane() -> None:
    side = Side()
    side.outbound.send(1, b"x" * 10)
    side.outbound.send(2, b"y" * 10)
    side.quic.ack(stream_of_lane(2))
    side.outbound.report_unacked(PEER, ChannelClosed("connection closed"))
    assert side.handler.failed == [
        (1, f"connection closed; {written(10)} admitted bytes on lane 1 unacknowledged")
    ]
    assert side.stats.send_failures_after_admission == 1


def test_finished_per_stream_streams_count_until_acknowledged_or_stopped() -> None:
    side = Side()
    first, second = side.outbound.open_stream(1 << 20), side.outbound.open_stream(1 << 20)
    for stream in (first, second):
        assert stream.send(b"x" * 10) is ADMITTED
        stream.finish()
    assert side.outbound.extra_streams == 0
    assert side.outbound.unacked_total() == 2 * written(10)
    side.quic.ack(first.stream_id)
    assert side.outbound.unacked_total() == written(10)
    assert not side.outbound.stopped(second.stream_id)  # finished: not ours to reset
    assert side.outbound.unacked_total() == 0  # the peer wants none of it


def test_a_stopped_stream_is_reset_and_refuses_its_sends() -> None:
    side = Side()
    stream = side.outbound.open_stream(1 << 20)
    stream.send(b"x")
    assert side.outbound.stopped(stream.stream_id)
    assert side.quic.resets == [(stream.stream_id, int(CloseCode.SHUTDOWN))]
    assert side.outbound.extra_streams == 0


def test_closing_refuses_what_waits_and_every_later_send() -> None:
    side = Side(max_unacked_bytes=written(10))
    assert side.outbound.send(0, b"x" * 10) is ADMITTED
    waiting = side.outbound.send(0, b"y")
    assert isinstance(waiting, SendAdmission)
    error = ChannelClosed("closing")
    side.outbound.refuse_pending(error)
    assert waiting.state is AdmissionState.FAILED
    assert side.outbound.close_error is error
    later = side.outbound.open_stream(1 << 20)
    assert later.gate.closed
