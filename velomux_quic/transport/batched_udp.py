"""The node's socket I/O in batches: UDP GSO out, UDP GRO in, one loop callback per burst.

A ``sendto`` per datagram and a loop callback per received datagram cost more CPU than
QUIC's own work at full-size datagrams. On Linux the kernel takes a whole train of
datagrams to one peer in one ``sendmsg`` (``UDP_SEGMENT``: it cuts the buffer into
segments of one size, the last may be shorter) and hands a receiver many datagrams of one
flow in one buffer (``UDP_GRO``: a control message gives the segment size). The
transport owns its non-blocking socket for this (``sendmsg``/``recvmsg`` with control
messages are not in asyncio's datagram transports, which read the socket themselves, and
uvloop's hands out a stand-in socket whose ``sendmsg`` refuses): it reads with
``loop.add_reader`` until the socket is empty, and writes at once, queueing behind
``loop.add_writer`` only when the kernel's buffer is full. A GRO buffer's datagrams go to
the protocol in one ``datagrams_received`` call, so the layers above can take a burst's
work once rather than once a datagram.

The planning is sans-IO (:func:`plan_trains`, :func:`split_segments`), tested alone;
:class:`BatchedUdpTransport` does the system calls. Where the kernel or a path refuses
GSO (EIO: a device without checksum offload; EINVAL) the datagrams of that train are
sent one by one, and that destination gets no more trains (counted, in the snapshot).
A path MTU probe never rides in a train: it leaves alone, through :meth:`sendto`, at its
own size (a train of mixed sizes would make the probe's loss take others with it).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .metrics import TransportStats

__all__ = [
    "GSO_ENVIRONMENT",
    "MAX_SEGMENTS",
    "MAX_TRAIN_BYTES",
    "BatchedUdpTransport",
    "UdpBatching",
    "batching_available",
    "gso_wanted",
    "plan_trains",
    "split_segments",
]

logger = logging.getLogger(__name__)

GSO_ENVIRONMENT = "VELOMUX_UDP_GSO"
"""``0`` turns GSO and GRO off for nodes whose configuration leaves ``gso`` unset."""

# <linux/udp.h>; Python's socket module names neither.
_SOL_UDP = 17
_UDP_SEGMENT = 103
_UDP_GRO = 104

MAX_SEGMENTS = 64
"""Datagrams in one GSO ``sendmsg`` at most (older kernels' ``UDP_MAX_SEGMENTS``)."""

MAX_TRAIN_BYTES = 65000
"""Bytes in one GSO ``sendmsg`` at most: the whole train is one UDP payload to the
kernel, below 64 KiB with the IP and UDP headers."""

_RECEIVE_BUFFER = 65536
"""One ``recvmsg`` reads this much: a GRO buffer of many datagrams, or one of up to the
largest datagram size."""

_GRO_CMSG_SPACE = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0

_READS_PER_CALLBACK = 256
"""Reads in one reader callback at most, so a flood leaves the loop's other callbacks
their turn; what is left wakes the reader again at once."""

MAX_PENDING_BYTES = 4 * 1024 * 1024
"""Datagram bytes held while the kernel's send buffer is full, at most; beyond, a
datagram is dropped (counted): QUIC's loss recovery resends what mattered, as it does
for a drop in the network."""

MAX_REFUSED_PATHS = 1024
"""Destinations remembered as refusing GSO; past this many, GSO stops for the socket."""

_GSO_REFUSALS = frozenset((errno.EIO, errno.EINVAL))

Address = Any
"""What the socket module gives and takes: (host, port) or IPv6's 4-tuple."""


class _Receiver(Protocol):
    """What the transport tells the endpoint: asyncio.DatagramProtocol's calls."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def datagram_received(self, data: bytes, addr: Address) -> None: ...

    def datagrams_received(self, datagrams: list[bytes], addr: Address) -> None:
        """The datagrams of one GRO buffer (one sender, in the order sent)."""

    def error_received(self, exc: Exception) -> None: ...


@dataclass(frozen=True, slots=True)
class UdpBatching:
    """Whether the node's socket batches datagrams, as the transport snapshot reports it."""

    gso: bool
    """Trains leave in one ``sendmsg`` with ``UDP_SEGMENT`` (off: by configuration, or
    the kernel lacks it, or it refused GSO for the socket)."""
    gro: bool
    """The kernel coalesces received datagrams (``UDP_GRO`` accepted by the socket)."""
    refused_paths: int = 0
    """Destinations for which the kernel refused a train, now sent one datagram a call."""


def gso_wanted(configured: bool | None) -> bool:
    """The configuration's ``gso``, or when unset the environment (on unless ``0``)."""
    if configured is not None:
        return configured
    return os.environ.get(GSO_ENVIRONMENT, "1").strip().lower() not in ("0", "false", "no", "off")


def _enable(sock: socket.socket) -> tuple[bool, bool]:
    """Ask the kernel for GSO (probed: it has no switch) and GRO on ``sock``."""
    if not sys.platform.startswith("linux"):
        return False, False
    try:
        sock.getsockopt(_SOL_UDP, _UDP_SEGMENT)
        gso = True
    except OSError:
        gso = False
    try:
        sock.setsockopt(_SOL_UDP, _UDP_GRO, 1)
        gro = True
    except OSError:
        gro = False
    return gso, gro


def batching_available() -> tuple[bool, bool]:
    """(GSO, GRO) as this host's kernel offers them to a UDP socket (an unbound probe)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            return _enable(sock)
    except OSError:
        return False, False


def plan_trains(
    sizes: Sequence[int], *, max_segments: int = MAX_SEGMENTS, max_bytes: int = MAX_TRAIN_BYTES
) -> list[tuple[int, int, int]]:
    """Cut consecutive datagrams of these sizes into GSO trains: ``(start, end, segment)``.

    A train is datagrams of the segment size (its first's), ending at a shorter one or
    before a longer one, at most ``max_segments`` and ``max_bytes``; the kernel cuts its
    buffer at every segment size, so only the last may be shorter. A lone datagram is a
    train of one (sent without GSO).
    """
    trains: list[tuple[int, int, int]] = []
    count = len(sizes)
    start = 0
    while start < count:
        segment = sizes[start]
        total = segment
        end = start + 1
        while end < count and end - start < max_segments:
            size = sizes[end]
            if size > segment or total + size > max_bytes:
                break
            total += size
            end += 1
            if size < segment:
                break
        trains.append((start, end, segment))
        start = end
    return trains


def split_segments(data: bytes, segment: int) -> list[bytes]:
    """The datagrams of one GRO buffer: ``segment`` bytes each, the last may be shorter."""
    if segment <= 0 or len(data) <= segment:
        return [data]
    return [data[offset : offset + segment] for offset in range(0, len(data), segment)]


def _gro_segment(ancdata: list[tuple[int, int, bytes]]) -> int:
    for level, kind, value in ancdata:
        if level == _SOL_UDP and kind == _UDP_GRO and len(value) >= 4:
            return int(struct.unpack_from("=i", value)[0])
    return 0


class BatchedUdpTransport(asyncio.DatagramTransport):
    """A datagram transport over the node's own socket, with trains out and bursts in.

    It stands where asyncio's datagram transport stood (the endpoint is its protocol), under
    either event loop: everything it needs of the loop is ``add_reader``/``add_writer``.
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        protocol: _Receiver,
        stats: TransportStats,
        *,
        gso: bool,
    ) -> None:
        super().__init__({"socket": sock, "sockname": sock.getsockname()})
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = loop
        self._protocol = protocol
        self._stats = stats
        self._gso, self._gro = _enable(sock) if gso else (False, False)
        self._refused: set[Address] = set()
        self._pending: collections.deque[tuple[bytes, Address]] = collections.deque()
        self._pending_bytes = 0
        self._writing = False
        self._closing = False
        self._sendmsg = sock.sendmsg
        self._sendto = sock.sendto
        loop.add_reader(self._fd, self._read_ready)

    @classmethod
    def open(
        cls,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        protocol: _Receiver,
        stats: TransportStats,
        *,
        gso: bool,
    ) -> BatchedUdpTransport:
        """Start reading ``sock`` for ``protocol`` and tell it (``connection_made``)."""
        transport = cls(sock, loop, protocol, stats, gso=gso)
        protocol.connection_made(transport)
        return transport

    @property
    def batching(self) -> UdpBatching:
        return UdpBatching(gso=self._gso, gro=self._gro, refused_paths=len(self._refused))

    # -- receive -------------------------------------------------------------------------

    def _read_ready(self) -> None:
        """Read until the socket is empty (or the per-callback budget is spent), and hand
        the protocol every datagram of every buffer."""
        sock = self._sock
        received = self._protocol.datagram_received
        gro = self._gro
        for _ in range(_READS_PER_CALLBACK):
            if self._closing:
                return
            try:
                if gro:
                    data, ancdata, _, addr = sock.recvmsg(_RECEIVE_BUFFER, _GRO_CMSG_SPACE)
                else:
                    data, addr = sock.recvfrom(_RECEIVE_BUFFER)
                    ancdata = None
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error for an earlier send
                self._protocol.error_received(exc)
                continue
            segment = _gro_segment(ancdata) if ancdata else 0
            if segment and len(data) > segment:
                self._stats.gro_buffers += 1
                self._protocol.datagrams_received(split_segments(data, segment), addr)
            else:
                received(data, addr)

    # -- send ----------------------------------------------------------------------------

    def sendto(self, data: Any, addr: Address = None) -> None:
        """One datagram on its own (a path MTU probe, a reset): never part of a train."""
        if self._closing:
            return
        if self._pending:
            self._queue([(bytes(data), addr)])
            return
        try:
            self._sendto(data, addr)
        except (BlockingIOError, InterruptedError):
            self._queue([(bytes(data), addr)])
        except OSError as exc:
            self._protocol.error_received(exc)

    def send_datagrams(self, datagrams: Sequence[tuple[bytes, Address]]) -> None:
        """Send one transmit's datagrams in order: each run to one destination in trains."""
        if self._closing:
            return
        if self._pending:
            self._queue(datagrams)
            return
        sent = self._send(datagrams)
        if sent < len(datagrams):
            self._queue(datagrams[sent:])

    def _send(self, datagrams: Sequence[tuple[bytes, Address]]) -> int:
        """Send from the start; how many left (the rest wait: the kernel's buffer is full)."""
        count = len(datagrams)
        if not self._gso:
            return self._send_singly(datagrams, 0, count)
        start = 0
        while start < count:
            addr = datagrams[start][1]
            end = start + 1
            while end < count and datagrams[end][1] == addr:
                end += 1
            if addr in self._refused:
                done = self._send_singly(datagrams, start, end)
                if done < end:
                    return done
            else:
                sizes = [len(datagrams[i][0]) for i in range(start, end)]
                for first, last, segment in plan_trains(sizes):
                    done = self._send_train(datagrams, start + first, start + last, segment)
                    if done < start + last:
                        return done
            start = end
        return count

    def _send_train(
        self, datagrams: Sequence[tuple[bytes, Address]], start: int, end: int, segment: int
    ) -> int:
        if end - start == 1 or not self._gso:
            return self._send_singly(datagrams, start, end)
        addr = datagrams[start][1]
        try:
            self._sendmsg(
                [datagrams[i][0] for i in range(start, end)],
                [(_SOL_UDP, _UDP_SEGMENT, struct.pack("=H", segment))],
                0,
                addr,
            )
        except (BlockingIOError, InterruptedError):
            return start
        except OSError as exc:
            if exc.errno not in _GSO_REFUSALS:
                self._protocol.error_received(exc)
                return end
            self._refuse(addr, exc)
            return self._send_singly(datagrams, start, end)
        self._stats.gso_trains += 1
        return end

    def _refuse(self, addr: Address, exc: OSError) -> None:
        """The kernel refused a train to ``addr``: that path sends one datagram a call."""
        self._stats.gso_fallbacks += 1
        self._refused.add(addr)
        if len(self._refused) > MAX_REFUSED_PATHS:
            self._gso = False
            self._refused.clear()
            logger.warning(
                "UDP GSO refused for more than %d destinations (last: %s); sending one "
                "datagram per call from now on",
                MAX_REFUSED_PATHS,
                exc,
            )
        else:
            logger.info("UDP GSO refused for %s (%s); sending it one datagram per call", addr, exc)

    def _send_singly(self, datagrams: Sequence[tuple[bytes, Address]], start: int, end: int) -> int:
        sendto = self._sendto
        for i in range(start, end):
            data, addr = datagrams[i]
            try:
                sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return i
            except OSError as exc:
                self._protocol.error_received(exc)
        return end

    def _queue(self, datagrams: Sequence[tuple[bytes, Address]]) -> None:
        """Hold what the kernel's buffer could not take, within :data:`MAX_PENDING_BYTES`."""
        for data, addr in datagrams:
            if self._pending_bytes + len(data) > MAX_PENDING_BYTES:
                self._stats.udp_send_drops += 1
                continue
            self._pending.append((data, addr))
            self._pending_bytes += len(data)
        if self._pending and not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._write_ready)

    def _write_ready(self) -> None:
        pending = list(self._pending)
        sent = self._send(pending)
        for data, _ in pending[:sent]:
            self._pending_bytes -= len(data)
        for _ in range(sent):
            self._pending.popleft()
        if not self._pending:
            self._writing = False
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._finish_close()

    # -- asyncio.BaseTransport -----------------------------------------------------------

    def get_write_buffer_size(self) -> int:
        return self._pending_bytes

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; close once what is queued has gone (as asyncio's transport does)."""
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        if not self._pending:
            self._finish_close()

    def abort(self) -> None:
        """Close now, dropping what is queued."""
        if not self._closing:
            self._closing = True
            self._loop.remove_reader(self._fd)
        self._pending.clear()
        self._pending_bytes = 0
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        self._finish_close()

    def _finish_close(self) -> None:
        if self._sock.fileno() < 0:
            return
        self._sock.close()
        self._loop.call_soon(self._protocol.connection_lost, None)
