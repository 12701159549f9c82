"""The batched socket I/O: how a transmit is cut into GSO trains, how a GRO buffer is split,
and what the I/O layer does when the kernel refuses a train or its buffer is full.

The planning is tested alone (sans-IO). The I/O layer is driven with a test double
socket that records its calls and raises what the brief of each test needs (the kernel's
refusals cannot be caused on demand on loopback); real sockets carry real trains in the
last tests, and the integration tests run whole node pairs over it.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from typing import Any

import pytest

from velomux_quic.transport import batched_udp
from velomux_quic.transport.batched_udp import (
    MAX_PENDING_BYTES,
    MAX_SEGMENTS,
    MAX_TRAIN_BYTES,
    BatchedUdpTransport,
    batching_available,
    gso_wanted,
    plan_trains,
    split_segments,
)
from velomux_quic.transport.metrics import TransportStats

pytestmark = pytest.mark.timeout(30)

PEER = ("127.0.0.1", 4433)
OTHER = ("127.0.0.1", 4434)


# -- planning (sans-IO) --------------------------------------------------------------------


def test_equal_datagrams_make_one_train() -> None:
    assert plan_trains([1452] * 10) == [(0, 10, 1452)]


def test_a_shorter_datagram_ends_its_train() -> None:
    assert plan_trains([1452, 1452, 700, 1452, 1452]) == [(0, 3, 1452), (3, 5, 1452)]


def test_a_longer_datagram_starts_a_train_of_its_own() -> None:
    assert plan_trains([500, 500, 1452, 1452, 1452]) == [(0, 2, 500), (2, 5, 1452)]


def test_a_train_holds_at_most_max_segments() -> None:
    trains = plan_trains([100] * (MAX_SEGMENTS * 2 + 3))
    assert [end - start for start, end, _ in trains] == [MAX_SEGMENTS, MAX_SEGMENTS, 3]


def test_a_train_holds_at_most_max_bytes() -> None:
    trains = plan_trains([16384] * 9)
    assert all(sum([16384] * (end - start)) <= MAX_TRAIN_BYTES for start, end, _ in trains)
    assert [end - start for start, end, _ in trains] == [3, 3, 3]


def test_lone_and_empty() -> None:
    assert plan_trains([]) == []
    assert plan_trains([1452]) == [(0, 1, 1452)]


def test_every_train_has_equal_segments_but_its_last() -> None:
    sizes = [1452, 1452, 1200, 1452, 9000, 9000, 100, 100, 100, 50, 1452] * 7
    trains = plan_trains(sizes)
    assert trains[0][0] == 0 and trains[-1][1] == len(sizes)
    for (start, end, segment), following in zip(
        trains, [*trains[1:], (len(sizes), 0, 0)], strict=True
    ):
        assert following[0] == end
        assert all(size == segment for size in sizes[start : end - 1])
        assert sizes[end - 1] <= segment


def test_a_gro_buffer_splits_at_the_segment_size() -> None:
    data = bytes(range(256)) * 20  # 5120 bytes
    parts = split_segments(data, 1452)
    assert [len(p) for p in parts] == [1452, 1452, 1452, 764]
    assert b"".join(parts) == data
    assert split_segments(data, 0) == [data]
    assert split_segments(b"abc", 1452) == [b"abc"]


def test_the_switch_reads_configuration_before_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(batched_udp.GSO_ENVIRONMENT, "0")
    assert gso_wanted(None) is False
    assert gso_wanted(True) is True
    monkeypatch.delenv(batched_udp.GSO_ENVIRONMENT)
    assert gso_wanted(None) is True
    assert gso_wanted(False) is False


# -- the I/O layer with a test double socket ----------------------------------------------


class FakeSocket:
    """Records sends; ``refuse`` raises that errno for any GSO sendmsg, ``full_after`` makes
    the buffer full (EAGAIN) after that many datagrams."""

    def __init__(self, *, refuse: int | None = None, full_after: int | None = None) -> None:
        self.sent: list[tuple[list[bytes], int, Any]] = []
        """(datagrams, segment size or 0 for a plain sendto, address) per call."""
        self.refuse = refuse
        self.full_after = full_after
        self.closed = False
        self._reader, self._other = socket.socketpair()  # a real fd for add_reader

    def fileno(self) -> int:
        return -1 if self.closed else self._reader.fileno()

    def getsockname(self) -> Any:
        return ("127.0.0.1", 1)

    def getsockopt(self, level: int, option: int) -> int:
        return 0

    def setsockopt(self, level: int, option: int, value: int) -> None:
        pass

    def _room(self, count: int) -> None:
        queued = sum(len(d) for d, _, _ in self.sent)
        if self.full_after is not None and queued + count > self.full_after:
            raise BlockingIOError(errno.EAGAIN, "full")

    def sendto(self, data: bytes, addr: Any) -> int:
        self._room(1)
        self.sent.append(([data], 0, addr))
        return len(data)

    def sendmsg(self, buffers: list[bytes], ancdata: Any, flags: int, addr: Any) -> int:
        ((level, kind, value),) = ancdata
        assert (level, kind) == (17, 103)
        if self.refuse is not None:
            raise OSError(self.refuse, "refused")
        self._room(len(buffers))
        self.sent.append((list(buffers), struct.unpack("=H", value)[0], addr))
        return sum(len(b) for b in buffers)

    def close(self) -> None:
        self.closed = True
        self._reader.close()
        self._other.close()


class Receiver:
    def __init__(self) -> None:
        self.datagrams: list[tuple[bytes, Any]] = []
        self.bursts: list[int] = []
        self.errors: list[Exception] = []
        self.lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.datagrams.append((data, addr))

    def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
        self.bursts.append(len(datagrams))
        self.datagrams.extend((data, addr) for data in datagrams)

    def error_received(self, exc: Exception) -> None:
        self.errors.append(exc)


def io(
    sock: FakeSocket, *, gso: bool = True, receiver: Receiver | None = None
) -> tuple[BatchedUdpTransport, TransportStats]:
    stats = TransportStats()
    transport = BatchedUdpTransport.open(
        sock,  # type: ignore[arg-type]
        asyncio.get_running_loop(),
        receiver or Receiver(),
        stats,
        gso=gso,
    )
    return transport, stats


def datagrams(sizes: list[int], addr: Any = PEER) -> list[tuple[bytes, Any]]:
    return [(bytes([i % 256]) * size, addr) for i, size in enumerate(sizes)]


async def test_a_transmit_leaves_in_trains_per_destination() -> None:
    sock = FakeSocket()
    transport, stats = io(sock)
    out = datagrams([1452] * 5 + [300]) + datagrams([1452] * 2, OTHER) + datagrams([1452])
    transport.send_datagrams(out)
    assert [(len(d), seg, addr) for d, seg, addr in sock.sent] == [
        (6, 1452, PEER),
        (2, 1452, OTHER),
        (1, 0, PEER),
    ]
    assert [d for call in sock.sent for d in call[0]] == [d for d, _ in out]
    assert stats.gso_trains == 2
    transport.abort()


async def test_gso_off_sends_one_datagram_a_call() -> None:
    sock = FakeSocket()
    transport, stats = io(sock, gso=False)
    transport.send_datagrams(datagrams([1452] * 4))
    assert [seg for _, seg, _ in sock.sent] == [0, 0, 0, 0]
    assert stats.gso_trains == 0
    assert transport.batching.gso is False and transport.batching.gro is False
    transport.abort()


@pytest.mark.parametrize("refusal", [errno.EIO, errno.EINVAL])
async def test_a_refused_train_falls_back_for_its_destination_and_is_counted(
    refusal: int,
) -> None:
    sock = FakeSocket(refuse=refusal)
    transport, stats = io(sock)
    out = datagrams([1452] * 3)
    transport.send_datagrams(out)
    assert [(d, seg) for d, seg, _ in sock.sent] == [([d], 0) for d, _ in out]
    assert stats.gso_fallbacks == 1
    assert transport.batching.refused_paths == 1 and transport.batching.gso is True
    transport.send_datagrams(datagrams([1452] * 3))  # no train tried again to that path
    assert stats.gso_fallbacks == 1 and len(sock.sent) == 6
    sock.refuse = None
    transport.send_datagrams(datagrams([1452] * 3, OTHER))  # another path still trains
    assert sock.sent[-1][1:] == (1452, OTHER)
    transport.abort()


async def test_past_the_refused_paths_bound_gso_stops_for_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batched_udp, "MAX_REFUSED_PATHS", 2)
    sock = FakeSocket(refuse=errno.EIO)
    transport, stats = io(sock)
    for port in range(3):
        transport.send_datagrams(datagrams([1452] * 2, ("127.0.0.1", 5000 + port)))
    assert stats.gso_fallbacks == 3
    assert transport.batching.gso is False and transport.batching.refused_paths == 0
    transport.abort()


async def test_a_full_buffer_queues_in_order_until_writable() -> None:
    sock = FakeSocket(full_after=3)
    receiver = Receiver()
    transport, _ = io(sock, receiver=receiver)
    out = datagrams([1452] * 3 + [1452] * 4)
    transport.send_datagrams(out)  # the first train of 7 does not fit: all wait
    assert sock.sent == [] and transport.get_write_buffer_size() == 7 * 1452
    transport.sendto(b"probe", PEER)  # behind them, not ahead
    sock.full_after = None
    transport.close()  # closes once the queue has gone (a socketpair end is writable)
    async with asyncio.timeout(5):
        await receiver.lost.wait()
    sent = [d for call in sock.sent for d in call[0]]
    assert sent == [d for d, _ in out] + [b"probe"]
    assert sock.closed


async def test_the_queue_is_bounded_and_drops_are_counted() -> None:
    sock = FakeSocket(full_after=0)
    transport, stats = io(sock)
    size = 60_000
    count = MAX_PENDING_BYTES // size + 5
    for _ in range(count):
        transport.sendto(b"x" * size, PEER)
    assert stats.udp_send_drops == 5
    assert transport.get_write_buffer_size() == (count - 5) * size
    transport.abort()
    assert transport.get_write_buffer_size() == 0


async def test_other_send_errors_go_to_the_protocol() -> None:
    sock = FakeSocket(refuse=errno.EMSGSIZE)
    receiver = Receiver()
    transport, stats = io(sock, receiver=receiver)
    transport.send_datagrams(datagrams([1452] * 2))
    assert [e.errno for e in receiver.errors if isinstance(e, OSError)] == [errno.EMSGSIZE]
    assert stats.gso_fallbacks == 0 and sock.sent == []
    transport.abort()


# -- real sockets ---------------------------------------------------------------------------


needs_gso = pytest.mark.skipif(
    batching_available() != (True, True), reason="the kernel offers no UDP GSO/GRO here"
)


@needs_gso
async def test_a_real_train_arrives_as_its_datagrams() -> None:
    """Over loopback a train reaches a GRO socket whole: the receiver splits it back and
    hands the protocol its datagrams in one call."""
    loop = asyncio.get_running_loop()
    send_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receive_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for s in (send_sock, receive_sock):
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    sender_stats, receiver_stats = TransportStats(), TransportStats()
    sender = BatchedUdpTransport.open(send_sock, loop, Receiver(), sender_stats, gso=True)
    receiver_side = Receiver()
    receiver = BatchedUdpTransport.open(receive_sock, loop, receiver_side, receiver_stats, gso=True)
    try:
        out = datagrams([1452] * 20 + [99], receive_sock.getsockname())
        sender.send_datagrams(out)
        async with asyncio.timeout(5):
            while len(receiver_side.datagrams) < len(out):
                await asyncio.sleep(0.01)
        assert [d for d, _ in receiver_side.datagrams] == [d for d, _ in out]
        assert receiver_side.bursts == [len(out)]
        assert sender_stats.gso_trains == 1
        assert receiver.batching.gro is True
    finally:
        sender.close()
        receiver.close()
    assert send_sock.fileno() == -1 and receive_sock.fileno() == -1
