"""The per-stream send bounds without sockets: SharedRoom over fake streams, and the
send backlog EngineConnection keeps for it over an in-memory pair of connections."""

from __future__ import annotations

from collections.abc import Callable

from tests.unit.engine_pair import WINDOW, drain, engine_pair, exchange
from velomux_quic.errors import ChannelClosed
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport.admission import (
    ADMITTED,
    UNBOUNDED,
    AdmissionState,
    LaneGate,
    SendAdmission,
    SendOutcome,
    SharedRoom,
)

# -- SharedRoom ---------------------------------------------------------------------------


class Wire:
    """What the shared room counts: bytes written that are ready to go, not yet sent."""

    def __init__(self, limit: int) -> None:
        self.backlog = 0
        self.room = SharedRoom(limit, lambda: self.backlog)

    def transmit(self, size: int) -> None:
        self.backlog -= size
        self.room.poll()


class FakeStream:
    """A per-stream stream: its own bound on unsent bytes, plus the wire's shared room.

    A ``stuck`` stream's peer window is closed: what it writes waits for its reader and
    counts against its own bound only.
    """

    def __init__(self, wire: Wire, own_limit: int = 10_000) -> None:
        self.wire = wire
        self.own_limit = own_limit
        self.unsent = 0
        self.stuck = False
        self.written: list[bytes] = []
        self.gate = LaneGate(self._room, lambda: False, self._write)

    def _room(self) -> int:
        own = self.own_limit - self.unsent if self.unsent else UNBOUNDED
        return min(own, self.wire.room.room())

    def _write(self, frame: bytes) -> None:
        self.written.append(frame)
        self.unsent += len(frame)
        if not self.stuck:
            self.wire.backlog += len(frame)

    def send(self, frame: bytes) -> SendOutcome:
        outcome = self.gate.send(frame)
        if isinstance(outcome, SendAdmission) and not outcome.done():
            self.wire.room.waiting(self.gate, len(frame))
        return outcome


def test_a_frame_fits_while_the_room_lasts_and_then_waits_for_a_transmit() -> None:
    wire = Wire(limit=100)
    stream = FakeStream(wire)
    assert stream.send(b"a" * 60) is ADMITTED
    assert stream.gate.try_send(b"b" * 30)  # 90 of 100
    assert not stream.gate.try_send(b"c" * 30)
    waiting = stream.send(b"c" * 30)
    assert isinstance(waiting, SendAdmission) and waiting.state is AdmissionState.PENDING
    wire.transmit(60)
    assert waiting.state is AdmissionState.ADMITTED
    assert stream.written == [b"a" * 60, b"b" * 30, b"c" * 30]


def test_a_frame_larger_than_the_room_goes_alone_once_nothing_is_queued() -> None:
    wire = Wire(limit=100)
    small, large = FakeStream(wire), FakeStream(wire)
    assert small.send(b"s" * 10) is ADMITTED
    big = large.send(b"L" * 500)
    assert isinstance(big, SendAdmission) and not big.done()
    wire.transmit(10)
    assert big.state is AdmissionState.ADMITTED


def test_a_waiting_frame_is_not_overtaken_by_smaller_frames_of_other_streams() -> None:
    wire = Wire(limit=100)
    first, second, third = FakeStream(wire), FakeStream(wire), FakeStream(wire)
    assert first.send(b"1" * 80) is ADMITTED
    big = second.send(b"2" * 60)  # 20 left: waits, and the room is now saturated
    assert isinstance(big, SendAdmission) and wire.room.saturated
    assert not third.gate.try_send(b"3")  # 1 byte would fit, but it would overtake
    small = third.send(b"3" * 5)
    assert isinstance(small, SendAdmission)
    order: list[str] = []
    big.on_resolved(lambda _: order.append("big"))
    small.on_resolved(lambda _: order.append("small"))
    wire.transmit(80)  # all free: the big one fits, then the small one
    assert order == ["big", "small"] and not wire.room.saturated
    assert third.gate.try_send(b"3")


def test_a_stream_stuck_on_its_own_bound_holds_up_no_other_stream() -> None:
    wire = Wire(limit=100)
    stuck, free = FakeStream(wire, own_limit=50), FakeStream(wire)
    stuck.stuck = True  # its reader stopped: nothing it writes can be transmitted
    assert stuck.send(b"s" * 50) is ADMITTED
    held = stuck.send(b"s" * 10)
    assert isinstance(held, SendAdmission) and not wire.room.saturated
    for _ in range(10):  # the other stream uses the whole shared room, again and again
        assert free.send(b"f" * 100) is ADMITTED
        wire.transmit(100)
    assert held.state is AdmissionState.PENDING
    stuck.unsent = 0  # its reader took everything and QUIC sent the rest
    wire.transmit(0)
    assert held.state is AdmissionState.ADMITTED


def test_the_poll_serves_streams_in_the_order_they_began_waiting() -> None:
    wire = Wire(limit=100)
    streams = [FakeStream(wire) for _ in range(5)]
    assert streams[0].send(b"x" * 100) is ADMITTED
    order: list[int] = []
    for index, stream in enumerate(streams[1:], 1):
        outcome = stream.send(b"y" * 40)
        assert isinstance(outcome, SendAdmission)
        outcome.on_resolved(lambda _, index=index: order.append(index))
    wire.transmit(100)  # room for two of the four
    assert order == [1, 2]
    wire.transmit(80)
    assert order == [1, 2, 3, 4] and wire.room.waiting_count == 0


def test_closing_the_gates_refuses_every_waiter_with_a_typed_error() -> None:
    wire = Wire(limit=10)
    streams = [FakeStream(wire) for _ in range(3)]
    assert streams[0].send(b"z" * 10) is ADMITTED
    waiting = [stream.send(b"w" * 10) for stream in streams]
    assert all(isinstance(w, SendAdmission) and not w.done() for w in waiting)
    error = ChannelClosed("connection closed")
    for stream in streams:
        stream.gate.close(error)
    wire.room.clear()
    assert all(w.error is error for w in waiting)  # type: ignore[union-attr]
    assert wire.room.waiting_count == 0 and not wire.room.saturated
    wire.transmit(10)  # nothing left to serve


def test_a_cancelled_waiter_leaves_its_place_to_the_next() -> None:
    wire = Wire(limit=10)
    first, second, third = FakeStream(wire), FakeStream(wire), FakeStream(wire)
    assert first.send(b"a" * 10) is ADMITTED
    withdrawn = second.send(b"b" * 10)
    kept = third.send(b"c" * 10)
    assert isinstance(withdrawn, SendAdmission) and withdrawn.cancel()
    wire.transmit(10)
    assert isinstance(kept, SendAdmission) and kept.state is AdmissionState.ADMITTED
    assert second.written == []


# -- the engine's send backlog ------------------------------------------------------------


STREAM = 66  # the first per-stream stream id


def test_the_backlog_counts_written_bytes_until_they_are_transmitted(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials)
    exchange(client, server)
    client.open_send_stream(STREAM)
    client.track_send_backlog(STREAM)
    client.send_stream_data(STREAM, bytes(10_000))
    assert client.send_backlog == 10_000 and client.stream_unsent(STREAM) == 10_000
    exchange(client, server)
    assert client.send_backlog == 0 and client.stream_unsent(STREAM) == 0
    client.send_stream_data(STREAM, b"", end_stream=True)
    exchange(client, server)
    assert not client.tracks_send_backlog(STREAM)  # sent through: no longer tracked


def test_bytes_beyond_the_peer_window_count_for_the_stream_not_the_connection(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials)
    exchange(client, server)
    consumed = 0
    server.manage_receive_window(STREAM, lambda: consumed, WINDOW)
    client.open_send_stream(STREAM)
    client.track_send_backlog(STREAM)
    client.send_stream_data(STREAM, bytes(3 * WINDOW))
    assert client.send_backlog == WINDOW  # the rest waits for the reader, not the network
    exchange(client, server)
    assert client.send_backlog == 0 and client.stream_unsent(STREAM) == 2 * WINDOW
    received = sum(len(e.data) for e in drain(server) if hasattr(e, "data"))
    consumed = received  # the reader took it: MAX_STREAM_DATA makes more transmittable
    exchange(client, server)
    assert client.send_backlog == 0 and client.stream_unsent(STREAM) == WINDOW


def test_a_reset_or_a_stop_sending_takes_the_stream_out_of_the_backlog(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials)
    exchange(client, server)
    client.open_send_stream(STREAM)
    client.track_send_backlog(STREAM)
    client.send_stream_data(STREAM, bytes(5_000))
    client.reset_stream(STREAM, 0x101)
    assert client.send_backlog == 0 and not client.tracks_send_backlog(STREAM)

    other = STREAM + 4
    consumed = 0
    server.manage_receive_window(other, lambda: consumed, WINDOW)
    client.open_send_stream(other)
    client.track_send_backlog(other)
    client.send_stream_data(other, bytes(WINDOW // 2))
    exchange(client, server)
    drain(server)
    server.stop_stream(other, 0x101)  # the reader gives up on it
    client.send_stream_data(other, bytes(WINDOW // 4))
    assert client.send_backlog == WINDOW // 4
    exchange(client, server)
    assert client.send_backlog == 0 and not client.tracks_send_backlog(other)
