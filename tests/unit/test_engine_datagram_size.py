"""EngineConnection's datagram-size controls, on an in-memory pair (no sockets).

Its advertised ``max_udp_payload_size`` reaches the peer, a size set on a live connection
shapes the next datagrams, and a path MTU probe is a datagram of exactly the size asked
whose acknowledgement or loss its observer hears.
"""

from __future__ import annotations

from collections.abc import Callable

from aioquic.quic import events

from tests.unit.engine_pair import CLIENT, SERVER, Clock, drain, engine_pair, exchange
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport.aioquic_engine import UNLIMITED_UDP_PAYLOAD, EngineConnection

STREAM = 2


def handshaken(
    make_credentials: Callable[..., NodeCredentials],
) -> tuple[EngineConnection, EngineConnection]:
    """A pair after its handshake; the server accepts datagrams up to 16 KiB."""
    client, server, _, _ = engine_pair(make_credentials)
    server.accepted_datagram_size = 16384
    exchange(client, server)
    drain(client)
    drain(server)
    return client, server


def test_each_side_learns_the_size_the_other_accepts(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials)
    server.accepted_datagram_size = 9000  # the server serializes when the Initial arrives
    exchange(client, server)
    assert client.peer_max_udp_payload_size == 9000
    # The client serialized its parameters in connect(), with the default it had then.
    assert server.peer_max_udp_payload_size == UNLIMITED_UDP_PAYLOAD


def test_a_size_set_on_a_live_connection_shapes_the_next_datagrams(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server = handshaken(make_credentials)
    assert client.datagram_size == 1452
    client.set_datagram_size(9000)
    assert client.datagram_size == 9000
    client.send_stream_data(STREAM, bytes(200_000))
    sizes = [len(data) for data, _ in client.datagrams_to_send(now=Clock.now)]
    assert max(sizes) == 9000  # the window was raised to fit full datagrams at once
    client.set_datagram_size(1452)  # back down (a black hole)
    exchange(client, server)
    client.send_stream_data(STREAM, bytes(50_000))
    assert max(len(data) for data, _ in client.datagrams_to_send(now=Clock.now)) <= 1452


def test_an_answered_probe_is_reported_acknowledged(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server = handshaken(make_credentials)
    heard: list[tuple[int, bool]] = []
    client.mtu_probe_observer = lambda size, acked: heard.append((size, acked))
    (probe,) = client.send_mtu_probe(8000, Clock.now)
    data, address = probe
    assert (len(data), address) == (8000, SERVER)
    server.receive_datagram(data, CLIENT, now=Clock.now)
    exchange(client, server)
    assert heard == [(8000, True)]
    assert client.datagram_size == 1452  # a probe alone changes nothing


def test_a_dropped_probe_is_reported_lost_and_data_still_flows(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server = handshaken(make_credentials)
    heard: list[tuple[int, bool]] = []
    client.mtu_probe_observer = lambda size, acked: heard.append((size, acked))
    assert len(client.send_mtu_probe(9000, Clock.now)) == 1  # and the path drops it
    client.send_stream_data(STREAM, bytes(30_000), end_stream=True)
    exchange(client, server)  # later packets are acknowledged: the probe is declared lost
    assert heard == [(9000, False)]
    received = sum(
        len(event.data)
        for event in drain(server)
        if getattr(event, "stream_id", None) == STREAM and hasattr(event, "data")
    )
    assert received == 30_000


def test_no_probe_before_the_handshake(make_credentials: Callable[..., NodeCredentials]) -> None:
    client, _, _, _ = engine_pair(make_credentials)
    assert client.send_mtu_probe(4096, Clock.now) == []


def test_a_stream_crosses_datagrams_above_16_kib_whole(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """A STREAM frame longer than 16,383 bytes carries a four-byte length (aioquic's own
    writer puts two, which corrupts it: see test_aioquic_assumptions.py), and the peer
    reads every byte, in order, at the largest sizes a path may use."""
    client, server = handshaken(make_credentials)
    server.accepted_datagram_size = 65_000
    payload = bytes(range(256)) * 2_000
    for size in (32_768, 65_000):
        client.set_datagram_size(size)
        client.send_stream_data(STREAM, payload)
        received = bytearray()
        largest = 0
        for _ in range(100):
            for data, _ in client.datagrams_to_send(now=Clock.now):
                largest = max(largest, len(data))
                server.receive_datagram(data, CLIENT, now=Clock.now)
            for event in drain(server):
                assert not isinstance(event, events.ConnectionTerminated), event
                if isinstance(event, events.StreamDataReceived):
                    received += event.data
            for data, _ in server.datagrams_to_send(now=Clock.now):
                client.receive_datagram(data, SERVER, now=Clock.now)
            Clock.now += 0.001
            if len(received) == len(payload):
                break
        assert received == payload
        assert 16_384 < largest <= size
