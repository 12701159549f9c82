"""Two EngineConnections that exchange datagrams in memory, on an explicit clock: the
sans-IO harness the engine, shared-room and aioquic-assumption tests drive."""

from __future__ import annotations

from collections.abc import Callable

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from velomux_quic.security.certs import NodeCredentials
from velomux_quic.security.tls import make_quic_configuration
from velomux_quic.security.verify import PeerVerifier
from velomux_quic.transport.aioquic_engine import EngineConnection

CLIENT = ("127.0.0.1", 1111)
SERVER = ("127.0.0.1", 2222)
WINDOW = 64 * 1024


def engine_pair(
    make_credentials: Callable[..., NodeCredentials], *, max_streams: int = 4096
) -> tuple[EngineConnection, EngineConnection, NodeCredentials, NodeCredentials]:
    client_creds, server_creds = make_credentials("client"), make_credentials("server")
    settings = {
        "max_datagram_size": 1452,
        "idle_timeout": 15.0,
        "max_stream_data": WINDOW,
        "max_data": 64 * 1024 * 1024,
    }
    client = EngineConnection(
        configuration=make_quic_configuration(client_creds, is_client=True, **settings),
        verifier=PeerVerifier(client_creds.trust_roots, client_creds.trust_domain),
        peer_role="server",
        expected_peer=server_creds.instance_id,
        max_concurrent_streams=max_streams,
    )
    server = EngineConnection(
        configuration=make_quic_configuration(server_creds, is_client=False, **settings),
        original_destination_connection_id=client.original_destination_connection_id,
        verifier=PeerVerifier(server_creds.trust_roots, server_creds.trust_domain),
        peer_role="client",
        expected_peer=None,
        max_concurrent_streams=max_streams,
    )
    client.connect(SERVER, now=Clock.now)
    return client, server, client_creds, server_creds


class Clock:
    """Explicit time for the sans-IO exchange (aioquic paces packets by it)."""

    now = 0.0


def exchange(client: QuicConnection, server: QuicConnection) -> None:
    quiet = 0
    for _ in range(100_000):
        moved = False
        for data, _ in client.datagrams_to_send(now=Clock.now):
            server.receive_datagram(data, CLIENT, now=Clock.now)
            moved = True
        for data, _ in server.datagrams_to_send(now=Clock.now):
            client.receive_datagram(data, SERVER, now=Clock.now)
            moved = True
        quiet = 0 if moved else quiet + 1
        if quiet > 20:  # nothing moved for 20 ms of pacing time
            return
        Clock.now += 0.001
    raise AssertionError("the connections never went quiet")


def drain(connection: QuicConnection) -> list[events.QuicEvent]:
    out = []
    while (event := connection.next_event()) is not None:
        out.append(event)
    return out
