"""The UDP impairment proxy (velomux_quic/programs/demo/proxy.py) over loopback UDP, without QUIC.

Loopback UDP between sockets with large buffers loses nothing at these volumes, so every
drop a test sees is the proxy's, and its counters must account for each datagram. Tests
synchronise on the proxy's counters (``wait_until``) and on what the endpoints received,
never on a sleep; timing is checked only as a lower bound on the loop clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from velomux_quic.programs.demo.proxy import (
    TIMER_SLACK,
    Counters,
    Impairment,
    ImpairmentProxy,
    Link,
)

REPOSITORY = Path(__file__).resolve().parents[2]

Address = tuple[Any, ...]


class Endpoint(asyncio.DatagramProtocol):
    """A UDP socket that records each datagram it receives with the loop time of arrival,
    and, as a server, can echo it back to its sender."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.received: list[tuple[bytes, Address, float]] = []
        self.transport: asyncio.DatagramTransport | None = None
        self._changed = asyncio.Event()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.received.append((data, addr, asyncio.get_running_loop().time()))
        if self.echo and self.transport is not None:
            self.transport.sendto(b"echo " + data, addr)
        self._changed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return host, port

    @property
    def payloads(self) -> list[bytes]:
        return [data for data, _, _ in self.received]

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.sendto(data)

    async def wait_for(self, count: int, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.received) < count:
                self._changed.clear()
                await self._changed.wait()

    async def close(self) -> None:
        """Close and wait until the socket is really closed (asyncio closes it a turn later)."""
        if self.transport is not None:
            self.transport.close()
            await self._lost


EndpointFactory = Callable[..., Any]


def _open_fds() -> set[str]:
    """This process's descriptors, except those on /dev/null: uvloop keeps one of those
    open for the life of the process from its first subprocess on (not a leak of ours)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != os.devnull:
                found.add(fd)
        except OSError:
            pass  # the descriptor listdir itself used, closed since
    return found


@pytest.fixture(autouse=True)
async def nothing_left_behind() -> AsyncIterator[None]:
    """Every test leaves no socket (or other descriptor) and no task behind. ``endpoints``
    depends on this fixture, so its teardown (closing them) comes first."""
    before = _open_fds()
    yield
    assert asyncio.all_tasks() - {asyncio.current_task()} == set()
    assert _open_fds() == before


@pytest.fixture
async def endpoints(nothing_left_behind: None) -> AsyncIterator[EndpointFactory]:
    """Open UDP endpoints (a server with ``echo=True``, a client with ``remote=``), all
    closed when the test ends."""
    opened: list[Endpoint] = []
    loop = asyncio.get_running_loop()

    async def open_endpoint(
        *, echo: bool = False, remote: tuple[str, int] | None = None, port: int = 0
    ) -> Endpoint:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # bursts must not overflow
                sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)
            sock.bind(("127.0.0.1", port))
            if remote is not None:
                sock.connect(remote)
            sock.setblocking(False)
            _, endpoint = await loop.create_datagram_endpoint(lambda: Endpoint(echo), sock=sock)
        except BaseException:
            sock.close()
            raise
        opened.append(endpoint)
        return endpoint

    yield open_endpoint
    for endpoint in opened:
        await endpoint.close()


def numbered(n: int, size: int = 8) -> bytes:
    return n.to_bytes(4, "big") + bytes(size - 4)


def numbers(payloads: list[bytes], prefix: bytes = b"") -> list[int]:
    return [int.from_bytes(data[len(prefix) : len(prefix) + 4], "big") for data in payloads]


def accounted(counters: Counters) -> bool:
    """Every datagram the proxy received is forwarded or dropped (none in flight)."""
    return all(
        c.received
        == c.forwarded
        + c.dropped_loss
        + c.dropped_overflow
        + c.dropped_blackhole
        + c.dropped_too_big
        + c.send_errors
        for c in (counters.client_to_server, counters.server_to_client)
    )


@pytest.mark.timeout(20)
async def test_no_loss_forwards_everything_in_order_both_ways(endpoints: EndpointFactory) -> None:
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address, Impairment()) as proxy:
        client = await endpoints(remote=proxy.address)
        count = 300
        for n in range(count):
            client.send(numbered(n, 1200))
        await client.wait_for(count)
        assert numbers(server.payloads) == list(range(count))
        assert numbers(client.payloads, b"echo ") == list(range(count))
        # The server sees one stable source, the proxy's upstream socket, not the client.
        sources = {address for _, address, _ in server.received}
        assert len(sources) == 1 and sources != {client.address}
        counters = proxy.counters
        for direction in (counters.client_to_server, counters.server_to_client):
            assert (direction.received, direction.forwarded) == (count, count)
            assert direction.dropped_loss == direction.dropped_overflow == 0
            assert direction.reordered == direction.send_errors == 0


@pytest.mark.timeout(20)
async def test_each_client_gets_its_own_upstream_and_only_its_own_replies(
    endpoints: EndpointFactory,
) -> None:
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address, Impairment(delay=0.002)) as proxy:
        clients = [await endpoints(remote=proxy.address) for _ in range(3)]
        for round_ in range(20):
            for index, client in enumerate(clients):
                client.send(numbered(100 * index + round_))
        for index, client in enumerate(clients):
            await client.wait_for(20)
            assert numbers(client.payloads, b"echo ") == [100 * index + r for r in range(20)]
        assert proxy.clients == 3
        assert len({address for _, address, _ in server.received}) == 3


@pytest.mark.timeout(20)
async def test_total_loss_forwards_nothing(endpoints: EndpointFactory) -> None:
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address, Impairment(loss=1.0)) as proxy:
        client = await endpoints(remote=proxy.address)
        for n in range(100):
            client.send(numbered(n))
        await proxy.wait_until(lambda c: c.client_to_server.received == 100)
        assert proxy.counters.client_to_server.dropped_loss == 100
        assert proxy.counters.client_to_server.forwarded == 0
        assert server.received == [] and client.received == []


@pytest.mark.timeout(20)
async def test_a_blackhole_drops_everything_until_it_is_lifted(endpoints: EndpointFactory) -> None:
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address) as proxy:
        client = await endpoints(remote=proxy.address)
        client.send(numbered(0))
        await client.wait_for(1)
        proxy.blackhole(True)
        for n in range(1, 51):
            client.send(numbered(n))
        await proxy.wait_until(lambda c: c.client_to_server.received == 51)
        assert proxy.counters.client_to_server.dropped_blackhole == 50
        proxy.blackhole(False)
        client.send(numbered(51))
        await client.wait_for(2)
        assert numbers(client.payloads, b"echo ") == [0, 51]
        assert accounted(proxy.counters)


@pytest.mark.timeout(20)
async def test_a_size_limit_drops_larger_datagrams_and_can_narrow_later(
    endpoints: EndpointFactory,
) -> None:
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address, Impairment(max_datagram=3000)) as proxy:
        client = await endpoints(remote=proxy.address)
        for n, size in enumerate((1000, 2995, 3001, 9000)):
            client.send(numbered(n, size))
        await proxy.wait_until(lambda c: c.client_to_server.received == 4)
        assert proxy.counters.client_to_server.dropped_too_big == 2
        await server.wait_for(2)
        assert numbers(server.payloads) == [0, 1]
        await client.wait_for(2)  # both echoes (5 bytes longer) fit 3000 bytes
        proxy.narrow(1000)
        client.send(numbered(4, 1000))  # fits on the way there; its echo does not, back
        await server.wait_for(3)
        await proxy.wait_until(lambda c: c.server_to_client.dropped_too_big == 1)
        assert numbers(client.payloads, b"echo ") == [0, 1]
        assert accounted(proxy.counters)
    with pytest.raises(ValueError, match="max_datagram must be 1 to 65535"):
        Impairment(max_datagram=0)


@pytest.mark.timeout(20)
async def test_a_target_that_restarts_on_its_port_is_heard_again(
    endpoints: EndpointFactory,
) -> None:
    """A killed target makes the kernel refuse the upstream socket's sends (ICMP); the
    proxy must still read what the target says once it listens on that port again."""
    server = await endpoints(echo=True)
    port = server.address[1]
    async with ImpairmentProxy(server.address) as proxy:
        client = await endpoints(remote=proxy.address)
        client.send(numbered(0))
        await client.wait_for(1)
        await server.close()
        for n in range(1, 6):  # into a closed port: refused, counted
            client.send(numbered(n))
        await proxy.wait_until(lambda c: c.client_to_server.received == 6)
        await proxy.wait_until(lambda c: c.client_to_server.send_errors >= 1, 5)
        await endpoints(echo=True, port=port)
        client.send(numbered(6))
        await client.wait_for(2, timeout=5)
        assert numbers(client.payloads, b"echo ")[-1] == 6


async def _delivered_subset(endpoints: EndpointFactory, seed: int, count: int) -> list[int]:
    """Which of ``count`` numbered datagrams a 30%-loss proxy with ``seed`` let through."""
    server = await endpoints()
    async with ImpairmentProxy(server.address, Impairment(loss=0.3, seed=seed)) as proxy:
        client = await endpoints(remote=proxy.address)
        for n in range(count):
            client.send(numbered(n))
        await proxy.wait_until(lambda c: c.client_to_server.received == count)
        forwarded = proxy.counters.client_to_server.forwarded
        await server.wait_for(forwarded)
        assert forwarded + proxy.counters.client_to_server.dropped_loss == count
    return numbers(server.payloads)


@pytest.mark.timeout(20)
async def test_a_seed_drops_a_reproducible_subset(endpoints: EndpointFactory) -> None:
    count = 400
    first = await _delivered_subset(endpoints, 7, count)
    again = await _delivered_subset(endpoints, 7, count)
    other = await _delivered_subset(endpoints, 8, count)
    assert first == again  # the same datagrams, in order
    assert first != other
    assert first == sorted(first)
    assert 0.2 * count < count - len(first) < 0.4 * count  # about 30% (binomial: 120 +- 28)


@pytest.mark.timeout(20)
async def test_delay_applies_each_way_on_the_loop_clock(endpoints: EndpointFactory) -> None:
    delay = 0.05
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address, Impairment(delay=delay, jitter=0.02)) as proxy:
        client = await endpoints(remote=proxy.address)
        loop = asyncio.get_running_loop()
        sent_at = []
        for n in range(30):
            sent_at.append(loop.time())
            client.send(numbered(n))
        await client.wait_for(30)
        one_way = [at - sent for (_, _, at), sent in zip(server.received, sent_at, strict=True)]
        round_trip = [at - sent for (_, _, at), sent in zip(client.received, sent_at, strict=True)]
        # Lower bounds only: a loaded machine may add any delay, never remove it.
        assert min(one_way) >= delay - TIMER_SLACK
        assert min(round_trip) >= 2 * (delay - TIMER_SLACK)
        # Jitter never reorders: order is kept both ways.
        assert numbers(server.payloads) == list(range(30))
        assert numbers(client.payloads, b"echo ") == list(range(30))
        assert proxy.counters.client_to_server.reordered == 0


@pytest.mark.timeout(20)
async def test_reordering_holds_datagrams_back_and_counts_them(
    endpoints: EndpointFactory,
) -> None:
    config = Impairment(client_to_server=Link(reorder=0.2, reorder_hold=0.02), seed=3)
    server = await endpoints()
    async with ImpairmentProxy(server.address, config) as proxy:
        client = await endpoints(remote=proxy.address)
        count = 200
        for n in range(count):  # one burst: the proxy reads it in one wake-up
            client.send(numbered(n))
        await server.wait_for(count)
        arrived = numbers(server.payloads)
        assert sorted(arrived) == list(range(count))  # exactly once each
        assert arrived != list(range(count))  # but not in order
        held = proxy.counters.client_to_server.reordered
        assert 0 < held < count
        assert proxy.counters.client_to_server.forwarded == count


@pytest.mark.timeout(20)
async def test_the_in_flight_cap_drops_and_counts_the_excess(endpoints: EndpointFactory) -> None:
    config = Impairment(delay=0.2, max_in_flight=10)
    server = await endpoints()
    async with ImpairmentProxy(server.address, config) as proxy:
        client = await endpoints(remote=proxy.address)
        for n in range(50):  # one burst, long before the first is due
            client.send(numbered(n))
        await proxy.wait_until(lambda c: c.client_to_server.received == 50)
        assert proxy.in_flight == 10
        assert proxy.counters.client_to_server.dropped_overflow == 40
        await server.wait_for(10)
        assert numbers(server.payloads) == list(range(10))  # the first ten, in order
        await proxy.wait_until(accounted)
        assert proxy.in_flight == 0


@pytest.mark.timeout(20)
async def test_the_in_flight_byte_cap_bounds_memory_whatever_the_count(
    endpoints: EndpointFactory,
) -> None:
    config = Impairment(delay=0.2, max_in_flight=1000, max_in_flight_bytes=65_535)
    server = await endpoints()
    async with ImpairmentProxy(server.address, config) as proxy:
        client = await endpoints(remote=proxy.address)
        for n in range(100):
            client.send(numbered(n, 1000))
        await proxy.wait_until(lambda c: c.client_to_server.received == 100)
        assert proxy.in_flight == 65  # 65 x 1,000 bytes fit 65,535
        assert proxy.counters.client_to_server.dropped_overflow == 35
        await server.wait_for(65)
        await proxy.wait_until(accounted)


@pytest.mark.timeout(20)
async def test_clients_beyond_the_cap_are_dropped_and_counted(endpoints: EndpointFactory) -> None:
    server = await endpoints(echo=True)
    async with ImpairmentProxy(server.address, Impairment(max_clients=1)) as proxy:
        first = await endpoints(remote=proxy.address)
        second = await endpoints(remote=proxy.address)
        first.send(numbered(1))
        await first.wait_for(1)
        second.send(numbered(2))
        await proxy.wait_until(lambda c: c.client_to_server.received == 2)
        assert proxy.clients == 1 and proxy.open_sockets == 2
        assert proxy.counters.client_to_server.dropped_overflow == 1
        assert second.received == []


@pytest.mark.timeout(20)
async def test_close_closes_every_socket_it_opened_and_cancels_what_is_in_flight(
    endpoints: EndpointFactory,
) -> None:
    server = await endpoints(echo=True)
    clients = [await endpoints() for _ in range(3)]
    before = _open_fds()
    proxy = await ImpairmentProxy(server.address, Impairment(delay=30.0)).start()
    for client in clients:
        assert client.transport is not None
        client.transport.sendto(numbered(0), proxy.address)
    await proxy.wait_until(lambda c: c.client_to_server.received == 3)
    assert proxy.clients == 3 and proxy.open_sockets == 4 and proxy.in_flight == 3
    assert len(_open_fds() - before) == 4  # the listening socket and one upstream per client
    sockets = list(proxy.sockets())
    proxy.close()  # with every datagram still waiting for its time
    proxy.close()  # idempotent
    assert proxy.in_flight == 0 and proxy.open_sockets == 0 and proxy.clients == 0
    assert all(sock.fileno() == -1 for sock in sockets)
    assert _open_fds() == before
    assert server.received == []


@pytest.mark.timeout(5)
def test_settings_are_validated() -> None:
    for bad in ({"loss": 1.5}, {"reorder": -0.1}, {"delay": -1.0}, {"max_in_flight": 0}):
        with pytest.raises(ValueError):
            Impairment(**bad)
    config = Impairment(loss=0.1, server_to_client=Link(delay=0.5))
    assert config.link("client_to_server") == Link(loss=0.1)
    assert config.link("server_to_client") == Link(delay=0.5)
    with pytest.raises(ValueError):
        config.link("sideways")


async def _spawn_proxy(target: tuple[str, int], *options: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "velomux_quic.programs.demo.proxy",
        "--target",
        f"{target[0]}:{target[1]}",
        *options,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPOSITORY,
    )


async def _line(process: asyncio.subprocess.Process) -> dict[str, Any]:
    assert process.stdout is not None
    async with asyncio.timeout(15):
        line = await process.stdout.readline()
    assert line, "the proxy process exited before saying anything"
    document: dict[str, Any] = json.loads(line)
    return document


async def _round_trip_through_process(
    endpoints: EndpointFactory, stop: Callable[[asyncio.subprocess.Process], None]
) -> dict[str, Any]:
    """Start the proxy process, echo one datagram through it, stop it with ``stop``, and
    return the counters it printed on the way out."""
    server = await endpoints(echo=True)
    process = await _spawn_proxy(server.address, "--delay-ms", "1", "--loss", "0")
    try:
        where = await _line(process)
        client = await endpoints(remote=(where["host"], where["port"]))
        client.send(b"ping")
        await client.wait_for(1)
        assert client.payloads == [b"echo ping"]
        stop(process)
        counters = await _line(process)
        async with asyncio.timeout(15):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stdout is not None and await process.stdout.read() == b""
    return counters


@pytest.mark.timeout(30)
async def test_as_a_process_it_says_where_it_listens_and_exits_at_end_of_stdin(
    endpoints: EndpointFactory,
) -> None:
    def close_stdin(process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None
        process.stdin.close()

    counters = await _round_trip_through_process(endpoints, close_stdin)
    for direction in ("client_to_server", "server_to_client"):
        assert counters["counters"][direction]["forwarded"] == 1


@pytest.mark.timeout(30)
async def test_as_a_process_it_exits_cleanly_on_sigterm(endpoints: EndpointFactory) -> None:
    counters = await _round_trip_through_process(
        endpoints, lambda process: process.send_signal(signal.SIGTERM)
    )
    assert counters["counters"]["client_to_server"]["received"] == 1
