"""A user-space UDP impairment proxy: loss, delay, jitter and reordering on loopback.

Kernels without ``netem`` (containers, micro-VMs) cannot impair loopback traffic, yet a
QUIC stack has to be seen under loss: retransmission, congestion control and
head-of-line blocking across lanes only show up then. This proxy sits between a QUIC
client and its server::

    client  --->  [listen socket]  --(client_to_server)-->  [upstream socket]  --->  server
    client  <---  [listen socket]  <--(server_to_client)--  [upstream socket]  <---  server

It listens on one UDP port. For every distinct client address it opens one upstream
socket, *connected* to the target, so the server sees one stable source address per
client and its replies find their way back to the right client (the kernel also filters
out anything not from the target). A server that learns its peer's address from the
connection's source, as velomux_quic's transport does, then dials that peer *through*
the proxy too: both connections of a node pair are impaired.

Each direction applies, in this order, from its own seeded ``random.Random``:

* **loss**: drop with probability ``loss``;
* **delay**: forward ``delay + U(0, jitter)`` seconds after arrival. Jitter never
  reorders on its own (a datagram never leaves before one that arrived earlier, as on a
  FIFO link); reordering is a separate, counted knob so that tests can reason about it;
* **reordering**: with probability ``reorder``, hold the datagram back a further
  ``reorder_hold`` seconds outside the FIFO, so later datagrams overtake it.

A ``max_datagram`` drops every datagram larger than it, both ways, as a path with a
narrow link and DF set does (``dropped_too_big``): for path MTU discovery.

Exactly three random numbers are drawn per datagram whatever the outcome, so with a
given seed the n-th datagram of a direction meets the same fate in every run.

Delay never serialises: in-order datagrams wait in a FIFO per direction whose head is
armed with one ``loop.call_at`` timer (due times never decrease, so one timer is
enough, and FIFO order does not rely on the event loop ordering timers that share a
deadline, which asyncio does not promise); held-back datagrams get a ``call_at`` each.
Memory is bounded: beyond ``max_in_flight`` datagrams or ``max_in_flight_bytes`` bytes
waiting in a direction, a datagram is dropped and counted (a router's tail drop), and
at most ``max_clients`` clients get an upstream socket.

The sockets are plain non-blocking sockets watched with ``loop.add_reader``: a wake-up
drains up to :data:`READ_BUDGET` datagrams, every socket is opened and closed
synchronously (so ``close()`` provably leaves none behind), and a send that the kernel
refuses is a counted drop rather than an unbounded buffer in a transport.

In-process::

    async with ImpairmentProxy(target=server.address, config=Impairment(loss=0.03,
                                                                        delay=0.002)) as proxy:
        client.connect(proxy.address)
        ...
        print(proxy.counters.client_to_server.dropped_loss)

As its own process (so it does not compete for the CPU of the process it measures)::

    python -m velomux_quic.programs.demo.proxy --target 127.0.0.1:4433 --loss 0.01 --delay-ms 5

prints ``{"host": ..., "port": ...}`` on one line once it listens, runs until SIGTERM,
SIGINT or end of its standard input, then prints ``{"counters": {...}}`` and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ..runtime import run

__all__ = [
    "DIRECTIONS",
    "Counters",
    "Impairment",
    "ImpairmentProxy",
    "Link",
    "LinkCounters",
]

Address = tuple[Any, ...]
"""A socket address as the socket module gives it: (host, port) for IPv4, 4 fields for IPv6."""

Send = Callable[[bytes], None]

DIRECTIONS = ("client_to_server", "server_to_client")

MAX_DATAGRAM = 65_535
"""Receive buffer per datagram: the largest UDP payload, so nothing is ever truncated."""

READ_BUDGET = 256
"""Datagrams read per wake-up of one socket, so one busy socket cannot starve the timers."""

TIMER_SLACK = 0.001
"""How early a due datagram may leave. uvloop's timers have millisecond granularity and
may fire up to about a millisecond before the requested instant; without the slack the
FIFO would re-arm a zero-length timer until the deadline passed."""

MiB = 1024 * 1024

DEFAULT_MAX_IN_FLIGHT = 4096
"""Per direction: at 5 ms of delay, room for about 800,000 datagrams a second."""

_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


@dataclass(frozen=True, slots=True)
class Link:
    """What one direction does to the datagrams crossing it. Times are in seconds."""

    loss: float = 0.0
    """Probability of dropping a datagram, 0 to 1."""
    delay: float = 0.0
    """Fixed one-way delay."""
    jitter: float = 0.0
    """Extra delay drawn uniformly from [0, jitter]; never reorders on its own."""
    reorder: float = 0.0
    """Probability of holding a datagram back, letting later ones overtake it."""
    reorder_hold: float = 0.003
    """How much longer a held-back datagram waits than it otherwise would."""

    def __post_init__(self) -> None:
        for name in ("loss", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability (0 to 1), got {value}")
        for name in ("delay", "jitter", "reorder_hold"):
            value = getattr(self, name)
            if not 0.0 <= value < 3600.0:
                raise ValueError(f"{name} must be 0 to 3600 s, got {value}")

    @property
    def immediate(self) -> bool:
        """True when a datagram that is not held back leaves on arrival."""
        return self.delay == 0.0 and self.jitter == 0.0


@dataclass(frozen=True, slots=True)
class Impairment:
    """The proxy's settings: one :class:`Link` for both directions unless overridden.

    ``loss``, ``delay``, ``jitter``, ``reorder`` and ``reorder_hold`` describe both
    directions; ``client_to_server`` or ``server_to_client`` replaces them for one.
    """

    loss: float = 0.0
    delay: float = 0.0
    jitter: float = 0.0
    reorder: float = 0.0
    reorder_hold: float = 0.003
    client_to_server: Link | None = None
    server_to_client: Link | None = None
    seed: int = 0
    """Seeds each direction's generator (with the direction's name), for reproducible runs."""
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    """Datagrams one direction may hold waiting for their time; beyond it they are dropped."""
    max_in_flight_bytes: int = 16 * MiB
    """Bytes one direction may hold waiting; bounds memory whatever the datagram size."""
    max_clients: int = 64
    """Distinct client addresses served; datagrams from any further client are dropped."""
    socket_buffer: int = 4 * MiB
    """Requested SO_RCVBUF / SO_SNDBUF of every socket: the kernel default (~208 KiB) would
    add loss of its own at speed, which the counters could not see."""
    max_datagram: int | None = None
    """Datagrams larger than this many bytes are dropped, both ways (a narrow path); None
    forwards every size."""

    def __post_init__(self) -> None:
        Link(self.loss, self.delay, self.jitter, self.reorder, self.reorder_hold)  # validates
        if self.max_datagram is not None and not 1 <= self.max_datagram <= MAX_DATAGRAM:
            raise ValueError(f"max_datagram must be 1 to {MAX_DATAGRAM}, got {self.max_datagram}")
        if self.max_in_flight < 1 or self.max_in_flight_bytes < MAX_DATAGRAM:
            raise ValueError(
                f"max_in_flight must be >= 1 and max_in_flight_bytes >= {MAX_DATAGRAM}"
            )
        if self.max_clients < 1 or self.socket_buffer < 0:
            raise ValueError("max_clients must be >= 1 and socket_buffer >= 0")

    def link(self, direction: str) -> Link:
        """The settings of ``direction`` (one of :data:`DIRECTIONS`)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        override: Link | None = getattr(self, direction)
        if override is not None:
            return override
        return Link(self.loss, self.delay, self.jitter, self.reorder, self.reorder_hold)


@dataclass(slots=True)
class LinkCounters:
    """What happened to the datagrams of one direction. Every received datagram ends up in
    exactly one of dropped_loss, dropped_overflow, dropped_blackhole, dropped_too_big,
    send_errors, forwarded, or is still in flight; ``reordered`` counts the held-back ones
    among them."""

    received: int = 0
    forwarded: int = 0
    dropped_loss: int = 0
    dropped_overflow: int = 0
    dropped_blackhole: int = 0
    """Dropped while the direction was cut (:meth:`ImpairmentProxy.blackhole`)."""
    dropped_too_big: int = 0
    """Dropped for being larger than ``Impairment.max_datagram``."""
    reordered: int = 0
    send_errors: int = 0


@dataclass(slots=True)
class Counters:
    """Both directions' counters."""

    client_to_server: LinkCounters = field(default_factory=LinkCounters)
    server_to_client: LinkCounters = field(default_factory=LinkCounters)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {direction: asdict(getattr(self, direction)) for direction in DIRECTIONS}


class _Direction:
    """One direction's impairment: the loss draw, the delay FIFO and the held-back set."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        link: Link,
        rng: random.Random,
        counters: LinkCounters,
        max_count: int,
        max_bytes: int,
        notify: Callable[[], None],
        max_datagram: int | None = None,
    ) -> None:
        self._loop = loop
        self.max_datagram = max_datagram
        """Larger datagrams are dropped (``dropped_too_big``); None forwards every size."""
        self._notify = notify
        self._link = link
        self._rng = rng
        self.counters = counters
        self._max_count = max_count
        self._max_bytes = max_bytes
        self._fifo: deque[tuple[float, bytes, Send]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._last_due = 0.0
        self._held: dict[int, asyncio.TimerHandle] = {}
        self._next_hold = 0
        self._count = 0
        self._bytes = 0
        self.blackholed = False
        """While True every arriving datagram is dropped (a cut link, not loss)."""

    @property
    def in_flight(self) -> int:
        """Datagrams waiting for their time (FIFO and held back)."""
        return self._count

    def submit(self, data: bytes, send: Send) -> None:
        """Decide the fate of one arriving datagram; ``send`` delivers it onwards."""
        counters = self.counters
        counters.received += 1
        link = self._link
        draw = self._rng.random
        lost, spread, held = draw() < link.loss, draw(), draw() < link.reorder
        if self.blackholed:  # after the draws, so a blackhole does not shift later fates
            counters.dropped_blackhole += 1
            return
        if self.max_datagram is not None and len(data) > self.max_datagram:
            counters.dropped_too_big += 1
            return
        if lost:
            counters.dropped_loss += 1
            return
        if not held and link.immediate and not self._fifo:
            self._send(data, send)
            return
        size = len(data)
        if self._count >= self._max_count or self._bytes + size > self._max_bytes:
            counters.dropped_overflow += 1
            return
        self._count += 1
        self._bytes += size
        due = self._loop.time() + link.delay + link.jitter * spread
        if held:
            counters.reordered += 1
            self._hold(due + link.reorder_hold, data, send)
            return
        due = max(due, self._last_due)  # FIFO: jitter never lets a datagram overtake
        self._last_due = due
        self._fifo.append((due, data, send))
        if self._timer is None:
            self._timer = self._loop.call_at(due, self._release)

    def _release(self) -> None:
        """Send every datagram at the head of the FIFO whose time has come; re-arm."""
        self._timer = None
        fifo = self._fifo
        limit = self._loop.time() + TIMER_SLACK
        while fifo and fifo[0][0] <= limit:
            _, data, send = fifo.popleft()
            self._count -= 1
            self._bytes -= len(data)
            self._send(data, send)
        if fifo:
            self._timer = self._loop.call_at(fifo[0][0], self._release)
        self._notify()

    def _hold(self, when: float, data: bytes, send: Send) -> None:
        key = self._next_hold
        self._next_hold += 1
        self._held[key] = self._loop.call_at(when, self._release_held, key, data, send)

    def _release_held(self, key: int, data: bytes, send: Send) -> None:
        del self._held[key]
        self._count -= 1
        self._bytes -= len(data)
        self._send(data, send)
        self._notify()

    def _send(self, data: bytes, send: Send) -> None:
        try:
            send(data)
        except OSError:
            # A full kernel queue (BlockingIOError), an ICMP error reported on a connected
            # socket, a socket closed under us: the network lost it.
            self.counters.send_errors += 1
        else:
            self.counters.forwarded += 1

    def close(self) -> None:
        """Forget everything in flight and cancel every timer (nothing fires after close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for handle in self._held.values():
            handle.cancel()
        self._held.clear()
        self._fifo.clear()
        self._count = self._bytes = 0


def _open_socket(family: int, buffer: int) -> socket.socket:
    """A non-blocking UDP socket with (best effort) large buffers."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        for force, option in (
            (_SO_RCVBUFFORCE, socket.SO_RCVBUF),
            (_SO_SNDBUFFORCE, socket.SO_SNDBUF),
        ):
            if buffer <= 0:
                break
            try:
                sock.setsockopt(socket.SOL_SOCKET, force, buffer)  # root: past rmem_max
            except OSError:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, buffer)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Client:
    """One client address and the upstream socket that speaks for it to the target."""

    __slots__ = ("address", "listen", "rearm", "upstream")

    def __init__(
        self,
        address: Address,
        listen: socket.socket,
        upstream: socket.socket,
        rearm: Callable[[_Client], None],
    ) -> None:
        self.address = address
        self.listen = listen
        self.upstream = upstream
        self.rearm = rearm

    def to_server(self, data: bytes) -> None:
        try:
            self.upstream.send(data)
        except ConnectionRefusedError:
            # The target is not listening (a killed node, before its restart): the ICMP
            # error left the connected socket in error, after which uvloop stops calling
            # its reader, and the restarted target's replies would never be read.
            self.rearm(self)
            raise

    def to_client(self, data: bytes) -> None:
        self.listen.sendto(data, self.address)


class ImpairmentProxy:
    """A UDP proxy to ``target`` that impairs both directions; see the module docstring.

    ``host`` defaults to the target's host (so a loopback target gets a loopback proxy);
    ``port`` 0 lets the kernel choose. Use ``async with``, or :meth:`start` and
    :meth:`close`; it runs on the event loop that started it.
    """

    def __init__(
        self,
        target: tuple[str, int],
        config: Impairment | None = None,
        *,
        host: str | None = None,
        port: int = 0,
    ) -> None:
        self.target = target
        self.config = config or Impairment()
        self._listen_at = (host if host is not None else target[0], port)
        self.counters = Counters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listen: socket.socket | None = None
        self._family = socket.AF_INET
        self._target_address: Address = target
        self._clients: dict[Address, _Client] = {}
        self._directions: dict[str, _Direction] = {}
        self._address: tuple[str, int] | None = None
        self._closed = False
        self._changed = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> ImpairmentProxy:
        """Bind the listening socket and start serving on the running loop."""
        if self._loop is not None:
            raise RuntimeError("the proxy was already started")
        self._loop = asyncio.get_running_loop()
        host, port = self._listen_at
        loop = self._loop
        family, _, _, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM))[0]
        target = await loop.getaddrinfo(*self.target, family=family, type=socket.SOCK_DGRAM)
        self._family, self._target_address = family, target[0][4]
        config = self.config
        for name in DIRECTIONS:
            self._directions[name] = _Direction(
                self._loop,
                config.link(name),
                random.Random(f"{config.seed}/{name}"),
                getattr(self.counters, name),
                config.max_in_flight,
                config.max_in_flight_bytes,
                self._changed.set,
                config.max_datagram,
            )
        listen = _open_socket(family, config.socket_buffer)
        try:
            listen.bind(address)
            self._loop.add_reader(listen.fileno(), self._listen_readable)
        except BaseException:
            listen.close()
            raise
        self._listen = listen
        bound = listen.getsockname()
        self._address = (bound[0], bound[1])
        return self

    def close(self) -> None:
        """Stop serving: cancel every pending forward, close every socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for direction in self._directions.values():
            direction.close()
        sockets = [client.upstream for client in self._clients.values()]
        self._clients.clear()
        if self._listen is not None:
            sockets.append(self._listen)
        for sock in sockets:
            self._forget(sock)

    async def __aenter__(self) -> ImpairmentProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- what a user looks at --------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """Where clients send: (host, port) of the listening socket."""
        if self._address is None:
            raise RuntimeError("the proxy is not started")
        return self._address

    @property
    def clients(self) -> int:
        """Client addresses currently served (each with its own upstream socket)."""
        return len(self._clients)

    @property
    def open_sockets(self) -> int:
        """Sockets this proxy holds open: the listening one and one per client."""
        listening = self._listen is not None and self._listen.fileno() != -1
        return int(listening) + sum(c.upstream.fileno() != -1 for c in self._clients.values())

    @property
    def in_flight(self) -> int:
        """Datagrams waiting for their time, both directions."""
        return sum(direction.in_flight for direction in self._directions.values())

    async def wait_until(
        self, predicate: Callable[[Counters], bool], timeout: float = 10.0
    ) -> None:
        """Wait until ``predicate(counters)`` holds, re-checked after every batch of datagrams
        read and every release: tests synchronise on what the proxy saw, never on a sleep."""
        async with asyncio.timeout(timeout):
            while not predicate(self.counters):
                self._changed.clear()
                await self._changed.wait()

    def narrow(self, max_datagram: int | None) -> None:
        """Drop datagrams larger than ``max_datagram`` from now on, both ways (None: none):
        a path whose MTU shrank under a live connection (a route change, a tunnel)."""
        if not self._directions:
            raise RuntimeError("the proxy is not started")
        for direction in self._directions.values():
            direction.max_datagram = max_datagram

    def blackhole(self, on: bool, direction: str | None = None) -> None:
        """Cut the link (``on``) or restore it: while cut, every datagram arriving in
        ``direction`` (both when None) is dropped and counted in ``dropped_blackhole``;
        datagrams already in flight still leave. What a pulled cable or a partition does,
        switched by the test at the instant it chooses."""
        if not self._directions:
            raise RuntimeError("the proxy is not started")
        for name in DIRECTIONS if direction is None else (direction,):
            if name not in DIRECTIONS:
                raise ValueError(f"direction must be one of {DIRECTIONS}, got {name!r}")
            self._directions[name].blackholed = on

    def sockets(self) -> Iterator[socket.socket]:
        """Every socket the proxy holds open (tests check that none outlives ``close``)."""
        if self._listen is not None:
            yield self._listen
        for client in self._clients.values():
            yield client.upstream

    # -- the data path ---------------------------------------------------------------------

    def _listen_readable(self) -> None:
        """Datagrams from clients: route each to its client's upstream direction."""
        assert self._listen is not None
        recvfrom = self._listen.recvfrom
        to_server = self._directions["client_to_server"]
        for _ in range(READ_BUDGET):
            try:
                data, address = recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                continue  # an ICMP error for an earlier send to a client that went away
            client = self._clients.get(address) or self._open_client(address)
            if client is None:
                to_server.counters.received += 1
                to_server.counters.dropped_overflow += 1
                continue
            to_server.submit(data, client.to_server)
        self._changed.set()

    def _upstream_readable(self, client: _Client) -> None:
        """Datagrams from the target for one client."""
        recv = client.upstream.recv
        to_client = self._directions["server_to_client"]
        for _ in range(READ_BUDGET):
            try:
                data = recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                # ECONNREFUSED: the target was not listening for an earlier send. uvloop
                # stops calling a reader whose socket reported an error: register it
                # afresh (after this callback), or a restarted target is never heard.
                assert self._loop is not None
                self._loop.call_soon(self._rearm, client)
                continue
            to_client.submit(data, client.to_client)
        self._changed.set()

    def _open_client(self, address: Address) -> _Client | None:
        """An upstream socket for a new client, or None past ``max_clients`` (or no fds)."""
        if self._closed or len(self._clients) >= self.config.max_clients:
            return None
        assert self._loop is not None and self._listen is not None
        try:
            upstream = _open_socket(self._family, self.config.socket_buffer)
        except OSError:
            return None
        try:
            upstream.bind((self._listen_at[0], 0))
            upstream.connect(self._target_address)  # UDP: immediate; filters other sources
            client = _Client(address, self._listen, upstream, self._rearm)
            self._loop.add_reader(upstream.fileno(), self._upstream_readable, client)
        except OSError:
            upstream.close()
            return None
        self._clients[address] = client
        return client

    def _rearm(self, client: _Client) -> None:
        """Register the upstream socket's reader afresh (see :meth:`_Client.to_server`)."""
        assert self._loop is not None
        if self._closed or client.upstream.fileno() == -1:
            return
        self._loop.remove_reader(client.upstream.fileno())
        self._loop.add_reader(client.upstream.fileno(), self._upstream_readable, client)

    def _forget(self, sock: socket.socket) -> None:
        assert self._loop is not None
        if sock.fileno() != -1:
            self._loop.remove_reader(sock.fileno())
        sock.close()


# -- as a process ----------------------------------------------------------------------


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m velomux_quic.programs.demo.proxy",
        description="A UDP proxy that adds loss, delay, jitter and reordering, each way.",
    )
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument(
        "--listen", type=_address, help="HOST:PORT to listen on (default: target host, port 0)"
    )
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability, each way")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="extra delay U(0, jitter)")
    parser.add_argument("--reorder", type=float, default=0.0, help="hold-back probability")
    parser.add_argument("--reorder-ms", type=float, default=3.0, help="how long a hold lasts")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT)
    parser.add_argument(
        "--max-datagram", type=int, default=None, help="drop datagrams larger than this"
    )
    parser.add_argument(
        "--no-stdin", action="store_true", help="do not exit at end of standard input"
    )
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> Impairment:
    return Impairment(
        loss=args.loss,
        delay=args.delay_ms / 1000.0,
        jitter=args.jitter_ms / 1000.0,
        reorder=args.reorder,
        reorder_hold=args.reorder_ms / 1000.0,
        seed=args.seed,
        max_in_flight=args.max_in_flight,
        max_datagram=args.max_datagram,
    )


class _EndOfInput(asyncio.Protocol):
    """Sets ``stop`` when standard input ends: the parent died or closed our stdin."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self._stop.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop.set()


async def _watch_stdin(stop: asyncio.Event) -> asyncio.BaseTransport | None:
    """Watch stdin for EOF; None when it is not a pipe, socket or terminal (a plain file)."""
    loop = asyncio.get_running_loop()
    try:
        transport, _ = await loop.connect_read_pipe(lambda: _EndOfInput(stop), sys.stdin)
    except (ValueError, OSError) as exc:
        print(f"impair proxy: not watching stdin ({exc})", file=sys.stderr)
        return None
    return transport


async def serve(args: argparse.Namespace) -> int:
    """Run the proxy until SIGTERM, SIGINT or end of stdin; say where, then what happened."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    host, port = args.listen if args.listen is not None else (args.target[0], 0)
    proxy = ImpairmentProxy(args.target, config_from(args), host=host, port=port)
    await proxy.start()
    stdin: asyncio.BaseTransport | None = None
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if not args.no_stdin:
            stdin = await _watch_stdin(stop)
        listen_host, listen_port = proxy.address
        print(json.dumps({"host": listen_host, "port": listen_port}), flush=True)
        await stop.wait()
    finally:
        proxy.close()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if stdin is not None:
            stdin.close()
    print(json.dumps({"counters": proxy.counters.as_dict()}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        config_from(args)
    except ValueError as exc:
        print(f"impair proxy: {exc}", file=sys.stderr)
        return 2
    # uvloop where installed (the proxy should cost as little CPU as it can), as every
    # program here runs, unless VELOMUX_NO_UVLOOP asks for plain asyncio.
    return run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
