"""EngineConnection without sockets: two connections exchange datagrams in memory.

These tests check what EngineConnection does with aioquic (verified peers, the stream
limits, the receive-window override, the ACK deadline); the private names of aioquic it
relies on are pinned one by one in ``test_aioquic_assumptions.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from aioquic import tls
from aioquic.quic import events

from tests.unit.engine_pair import CLIENT, WINDOW, Clock, drain, engine_pair, exchange
from velomux_quic.security.certs import NodeCredentials


def test_both_sides_learn_the_verified_peer_and_the_client_waits_for_confirmation(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, client_creds, server_creds = engine_pair(make_credentials)
    exchange(client, server)
    assert server.verified_peer == client_creds.instance_id
    assert client.verified_peer == server_creds.instance_id
    assert client.handshake_confirmed


def test_more_than_128_concurrent_peer_streams_are_accepted(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials, max_streams=2048)
    exchange(client, server)
    drain(server)
    streams = 1500
    for _ in range(streams):
        stream_id = client.get_next_available_stream_id(is_unidirectional=True)
        client.send_stream_data(stream_id, b"open")  # open, never finished
    exchange(client, server)
    seen = {e.stream_id for e in drain(server) if isinstance(e, events.StreamDataReceived)}
    assert len(seen) == streams


def test_a_managed_window_holds_the_sender_until_the_receiver_consumes(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials)
    exchange(client, server)
    consumed = 0
    received = 0
    stream_id = 2
    server.manage_receive_window(stream_id, lambda: consumed, WINDOW)
    client.open_send_stream(stream_id)
    client.send_stream_data(stream_id, bytes(4 * WINDOW))
    exchange(client, server)
    for event in drain(server):
        if isinstance(event, events.StreamDataReceived):
            received += len(event.data)
    assert received == WINDOW, "the sender went past the window nobody consumed"
    assert client.stream_room(stream_id, 0) < 0

    consumed = received  # the application took everything
    exchange(client, server)
    for event in drain(server):
        if isinstance(event, events.StreamDataReceived):
            received += len(event.data)
    assert received == 2 * WINDOW


def test_opening_a_higher_lane_first_keeps_lower_lanes_usable(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, server, _, _ = engine_pair(make_credentials)
    exchange(client, server)
    client.open_send_stream(4 * 5 + 2)
    for lane in range(6):
        client.send_stream_data(4 * lane + 2, b"lane %d" % lane)
    exchange(client, server)
    got = {e.stream_id: e.data for e in drain(server) if isinstance(e, events.StreamDataReceived)}
    assert got == {4 * lane + 2: b"lane %d" % lane for lane in range(6)}


def test_an_ack_is_due_once_the_delayed_ack_deadline_passes(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """The receive path transmits at once only when aioquic owes an ACK now; the deadline
    is aioquic's delayed-ACK timer, so data just received owes none until it passes."""
    client, server, _, _ = engine_pair(make_credentials)
    assert server.ack_due(Clock.now)  # before the handshake: answer every datagram
    exchange(client, server)
    drain(server)
    assert not server.ack_due(Clock.now)  # everything acknowledged
    stream_id = client.get_next_available_stream_id(is_unidirectional=True)
    client.send_stream_data(stream_id, b"token")
    for data, _ in client.datagrams_to_send(now=Clock.now):
        server.receive_datagram(data, CLIENT, now=Clock.now)
    assert not server.ack_due(Clock.now)  # owed, but not yet due
    assert server.ack_due(Clock.now + 0.5)  # past the delayed-ACK deadline


def test_install_refuses_a_context_past_its_first_message() -> None:
    from velomux_quic.security.tls import install_peer_verification

    context = tls.Context(is_client=False)
    context.state = tls.State.SERVER_EXPECT_FINISHED
    with pytest.raises(RuntimeError):
        install_peer_verification(context, object(), role="client")  # type: ignore[arg-type]
