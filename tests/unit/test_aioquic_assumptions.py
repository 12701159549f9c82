"""Every private part of aioquic the transport and security layers rely on, pinned.

aioquic offers no API for receive-side backpressure, send-side occupancy, more concurrent
streams, full-packet short cuts or client certificates, so ``velomux_quic.transport.aioquic_engine``
and ``velomux_quic.security.tls`` read and override a few of its private members (see their
module docstrings). Each test here pins one of them, by name, signature and meaning, so an
aioquic upgrade that moves one fails here, by name, before anything else breaks in a
puzzling way. ``pyproject.toml`` pins the aioquic range: widen it only after this file
passes on the new version. This is the only test module that reads aioquic's private names.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable

import aioquic
import pytest
from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic import connection as quic_connection
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream, QuicStreamSender

from tests.unit.engine_pair import CLIENT, SERVER, Clock, drain, exchange
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.security.tls import make_quic_configuration

STREAM = 2  # the first client-initiated unidirectional stream (lane 0)


def _parameters(function: Callable[..., object]) -> list[str]:
    return list(inspect.signature(function).parameters)


def _configuration(
    credentials: NodeCredentials, *, is_client: bool, window: int = 64 * 1024
) -> QuicConfiguration:
    return make_quic_configuration(
        credentials,
        is_client=is_client,
        max_datagram_size=1452,
        idle_timeout=15.0,
        max_stream_data=window,
        max_data=64 * 1024 * 1024,
    )


def _plain_pair(
    make_credentials: Callable[..., NodeCredentials],
) -> tuple[QuicConnection, QuicConnection]:
    """Two of aioquic's own connections, handshaken, with nothing of ours installed."""
    client_creds, server_creds = make_credentials("client"), make_credentials("server")
    client = QuicConnection(configuration=_configuration(client_creds, is_client=True))
    server = QuicConnection(
        configuration=_configuration(server_creds, is_client=False),
        original_destination_connection_id=client.original_destination_connection_id,
    )
    client.connect(SERVER, now=Clock.now)
    exchange(client, server)
    drain(client)
    drain(server)
    return client, server


def test_the_pinned_aioquic_minor_version_is_installed() -> None:
    major, minor = (int(x) for x in aioquic.__version__.split(".")[:2])
    assert (major, minor) == (1, 7), "re-run this file before widening the aioquic pin"


def test_buffer_is_aioquics_typed_private_buffer_class() -> None:
    """The layers import ``Buffer`` from ``aioquic._buffer``, where its type stubs are:
    ``aioquic.buffer`` re-exports it without ``__all__``, which a user's ``mypy --strict``
    that reads this package as source (``MYPYPATH``) refuses as an implicit re-export."""
    import aioquic._buffer
    import aioquic.buffer

    assert aioquic.buffer.Buffer is aioquic._buffer.Buffer


# -- security/tls.py: the TLS context -------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "_server_handle_certificate",
        "_server_handle_certificate_verify",
        "_client_handle_certificate_verify",
    ],
)
def test_the_certificate_handlers_verification_overrides_exist(name: str) -> None:
    """VerifyingContext runs the peer verifier right after each of these."""
    method = getattr(tls.Context, name)
    assert callable(method)
    assert _parameters(method) == ["self", "input_buf"]


def test_a_server_context_asks_for_no_client_certificate_until_told_to() -> None:
    """install_peer_verification sets ``_request_client_certificate`` on the accepting side."""
    context = tls.Context(is_client=False)
    assert context._request_client_certificate is False


def test_the_peer_certificate_and_chain_are_where_the_verifier_reads_them() -> None:
    context = tls.Context(is_client=True)
    assert context._peer_certificate is None
    assert context._peer_certificate_chain == []


def test_a_fresh_context_is_in_the_state_the_verification_hook_expects() -> None:
    assert tls.Context(is_client=True).state is tls.State.CLIENT_HANDSHAKE_START
    assert tls.Context(is_client=False).state is tls.State.SERVER_EXPECT_CLIENT_HELLO


def test_the_tls_context_is_built_in_initialize_and_kept_as_tls(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """EngineConnection overrides ``_initialize`` to install the hook on ``self.tls``."""
    assert _parameters(QuicConnection._initialize) == ["self", "peer_cid"]
    client, _ = _plain_pair(make_credentials)
    assert isinstance(client.tls, tls.Context)


# -- transport/aioquic_engine.py: handshake state --------------------------------------------------


def test_handshake_flags_and_the_one_rtt_space_ack_deadline(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``handshake_confirmed`` and ``ack_due`` read these."""
    client, server = _plain_pair(make_credentials)
    assert client._handshake_complete is True and server._handshake_complete is True
    assert client._handshake_confirmed is True
    space = server._spaces[tls.Epoch.ONE_RTT]
    assert isinstance(space, QuicPacketSpace)
    assert QuicPacketSpace().ack_at is None


def test_the_event_queue_is_the_deque_next_event_pops_in_order(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``poll_event`` gathers the run of pieces at the front of ``_events`` one event a
    stream and puts the others back at its front: the deque ``next_event`` takes from the
    left, each datagram's STREAM frames in order, and whatever is put back comes next."""
    client, server = _plain_pair(make_credentials)
    assert isinstance(server._events, collections.deque) and not server._events
    client.send_stream_data(STREAM, b"a" * 3000)
    exchange(client, server)
    pieces = list(server._events)
    assert len(pieces) >= 2 and all(isinstance(p, events.StreamDataReceived) for p in pieces)
    assert b"".join(p.data for p in pieces) == b"a" * 3000
    assert server.next_event() is pieces[0] and list(server._events) == pieces[1:]
    server._events.appendleft(pieces[0])
    assert server.next_event() is pieces[0]


# -- transport/aioquic_engine.py: streams ----------------------------------------------------------


def test_streams_are_kept_by_id_and_created_in_order(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``open_send_stream`` creates lower ids first with these two."""
    client, _ = _plain_pair(make_credentials)
    assert _parameters(QuicConnection._get_or_create_stream_for_send) == ["self", "stream_id"]
    assert _parameters(QuicConnection._stream_is_discarded) == ["self", "stream_id"]
    assert STREAM not in client._streams and not client._stream_is_discarded(STREAM)
    stream = client._get_or_create_stream_for_send(STREAM)
    assert client._streams[STREAM] is stream and isinstance(stream, QuicStream)


def test_the_peer_initial_window_for_unidirectional_streams(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``stream_room`` of a stream not created yet is this plus the send buffer."""
    client, _ = _plain_pair(make_credentials)
    assert client._remote_max_stream_data_uni == 64 * 1024


def test_the_sender_buffer_offsets_track_written_sent_and_acknowledged_bytes(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``stream_room``, ``stream_unsent``, ``stream_unacked`` and the send backlog."""
    client, server = _plain_pair(make_credentials)
    sender = QuicStreamSender(stream_id=STREAM, writable=True)
    assert sender._buffer_start == 0 and sender._buffer_stop == 0
    assert sender.highest_offset == 0 and sender._buffer_fin is None
    assert sender._reset_error_code is None

    client.send_stream_data(STREAM, bytes(1000))
    stream = client._streams[STREAM]
    assert stream.sender._buffer_stop == 1000 and stream.sender.highest_offset == 0
    assert stream.max_stream_data_remote == 64 * 1024
    exchange(client, server)
    assert stream.sender.highest_offset == 1000  # transmitted
    assert stream.sender._buffer_start == 1000  # acknowledged
    client.send_stream_data(STREAM, b"", end_stream=True)
    assert stream.sender._buffer_fin == 1000


def test_a_reset_records_its_error_code_on_the_sender(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    client, _ = _plain_pair(make_credentials)
    client.send_stream_data(STREAM, bytes(10))
    client.reset_stream(STREAM, 0x101)
    assert client._streams[STREAM].sender._reset_error_code == 0x101


def test_the_receive_window_fields_the_managed_window_sets(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``_write_stream_limits`` of a managed window writes these two."""
    client, server = _plain_pair(make_credentials)
    client.send_stream_data(STREAM, bytes(10))
    exchange(client, server)
    stream = server._streams[STREAM]
    assert stream.stream_id == STREAM
    assert stream.max_stream_data_local == 64 * 1024
    assert stream.max_stream_data_local_sent == 64 * 1024


# -- transport/aioquic_engine.py: the overridden frame writers and handlers ------------------------


def test_the_stream_limits_writer_and_its_delivery_handler() -> None:
    assert _parameters(QuicConnection._write_stream_limits) == [
        "self",
        "builder",
        "space",
        "stream",
    ]
    assert _parameters(QuicConnection._on_max_stream_data_delivery) == [
        "self",
        "delivery",
        "stream",
    ]
    assert isinstance(quic_connection.MAX_STREAM_DATA_FRAME_CAPACITY, int)
    assert _parameters(QuicPacketBuilder.start_frame) == [
        "self",
        "frame_type",
        "capacity",
        "handler",
        "handler_args",
    ]


def test_the_stream_frame_writer_and_the_room_left_in_a_packet() -> None:
    assert _parameters(QuicConnection._write_stream_frame) == [
        "self",
        "builder",
        "space",
        "stream",
        "max_offset",
    ]
    assert isinstance(QuicPacketBuilder.remaining_flight_space, property)


def test_aioquic_writes_a_stream_frames_length_in_two_bytes_and_corrupts_a_longer_one(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """The defect ``EngineConnection._write_stream_frame`` works around: aioquic writes a
    STREAM frame's length as ``len | 0x4000`` (two bytes, at most 16,383), so in datagrams
    above 16 KiB a longer frame reaches its peer cut short. Our writer reads the sender
    the way aioquic's does (``get_frame``, ``next_offset``, ``highest_offset``,
    ``on_data_delivery``) and the builder's ``start_frame`` and ``quic_logger_frames``."""
    source = inspect.getsource(QuicConnection._write_stream_frame)
    assert "buf.push_uint16(len(frame.data) | 0x4000)" in source
    assert _parameters(QuicStreamSender.get_frame) == ["self", "max_size", "max_offset"]
    assert _parameters(QuicStreamSender.on_data_delivery) == [
        "self",
        "delivery",
        "start",
        "stop",
        "fin",
    ]
    assert _parameters(QuicPacketBuilder.start_frame) == [
        "self",
        "frame_type",
        "capacity",
        "handler",
        "handler_args",
    ]
    client_creds, server_creds = make_credentials("client"), make_credentials("server")

    def configuration(credentials: NodeCredentials, *, is_client: bool) -> QuicConfiguration:
        return make_quic_configuration(
            credentials,
            is_client=is_client,
            max_datagram_size=32_768,
            idle_timeout=15.0,
            max_stream_data=1 << 20,
            max_data=1 << 24,
        )

    client = QuicConnection(configuration=configuration(client_creds, is_client=True))
    server = QuicConnection(
        configuration=configuration(server_creds, is_client=False),
        original_destination_connection_id=client.original_destination_connection_id,
    )
    client.connect(SERVER, now=Clock.now)
    exchange(client, server)
    drain(client)
    drain(server)
    client.send_stream_data(2, bytes(100_000))
    sent = client.datagrams_to_send(now=Clock.now)
    assert max(len(data) for data, _ in sent) > 16_384
    for data, _ in sent:
        server.receive_datagram(data, CLIENT, now=Clock.now)
    received = sum(len(e.data) for e in drain(server) if isinstance(e, events.StreamDataReceived))
    assert received < 16_384  # the rest of the packet no longer parses


@pytest.mark.parametrize("name", ["_handle_max_stream_data_frame", "_handle_stop_sending_frame"])
def test_the_frame_handlers_the_send_backlog_follows(name: str) -> None:
    method = getattr(QuicConnection, name)
    assert _parameters(method) == ["self", "context", "frame_type", "buf"]
    assert hasattr(quic_connection, "QuicReceiveContext")


def test_frame_handlers_are_looked_up_on_the_instance(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """aioquic dispatches frames through a table of bound methods built per connection,
    so an override in a subclass is what runs (not the base class's function)."""

    class Probe(QuicConnection):
        seen = 0

        def _handle_max_stream_data_frame(
            self, context: quic_connection.QuicReceiveContext, frame_type: int, buf: Buffer
        ) -> None:
            Probe.seen += 1
            super()._handle_max_stream_data_frame(context, frame_type, buf)

    client_creds, server_creds = make_credentials("client"), make_credentials("server")
    client = Probe(configuration=_configuration(client_creds, is_client=True, window=4096))
    server = QuicConnection(
        configuration=_configuration(server_creds, is_client=False, window=4096),
        original_destination_connection_id=client.original_destination_connection_id,
    )
    client.connect(SERVER, now=Clock.now)
    exchange(client, server)
    client.send_stream_data(STREAM, bytes(3 * 4096))  # past the window: aioquic raises it
    exchange(client, server)
    drain(server)
    exchange(client, server)
    assert Probe.seen >= 1


def test_the_stream_limits_are_limit_objects_the_constructor_may_replace(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """EngineConnection replaces ``_local_max_streams_bidi``/``_uni`` before they are sent."""
    client, _ = _plain_pair(make_credentials)
    for limit, frame_type in (
        (client._local_max_streams_bidi, QuicFrameType.MAX_STREAMS_BIDI),
        (client._local_max_streams_uni, QuicFrameType.MAX_STREAMS_UNI),
    ):
        assert isinstance(limit, quic_connection.Limit)
        assert limit.frame_type == frame_type and limit.value == 128
    assert _parameters(quic_connection.Limit) == ["frame_type", "name", "value"]


def test_host_and_peer_connection_ids_carry_the_reset_tokens_stateless_resets_use(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """transport.aioquic_engine derives the tokens of ``_host_cids`` (QuicConnectionId's ``cid``,
    ``stateless_reset_token`` and ``was_sent``), hooks ``_replenish_connection_ids``, and
    reads the peer's tokens from ``_peer_cid`` and ``_peer_cid_available``; a server's
    first token is what its transport parameters advertise."""
    client, server = _plain_pair(make_credentials)
    assert "_replenish_connection_ids" in vars(QuicConnection)
    assert _parameters(QuicConnection._replenish_connection_ids) == ["self"]
    for host_cid in server._host_cids:
        assert len(host_cid.stateless_reset_token) == 16 and host_cid.was_sent
    assert client._host_cids[0].stateless_reset_token in (b"", None)
    assert client._peer_cid.cid == server._host_cids[0].cid
    assert client._peer_cid.stateless_reset_token == server._host_cids[0].stateless_reset_token
    available = {cid.cid: cid.stateless_reset_token for cid in client._peer_cid_available}
    for host_cid in server._host_cids[1:]:
        assert available[host_cid.cid] == host_cid.stateless_reset_token
    assert server._is_client is False and client._is_client is True


def test_change_connection_id_moves_to_the_next_peer_connection_id(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """A server leaves the client's first connection ID (no token) with the public
    ``change_connection_id``, which takes the next of ``_peer_cid_available``."""
    client, server = _plain_pair(make_credentials)
    assert server._peer_cid.cid == client._host_cids[0].cid
    following = server._peer_cid_available[0]
    server.change_connection_id()
    assert server._peer_cid.cid == following.cid
    assert server._peer_cid.stateless_reset_token == following.stateless_reset_token


# -- transport/aioquic_engine.py: datagram size, transport parameters and path MTU probes ----------


def test_the_datagram_size_is_read_per_transmit_from_max_datagram_size(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``set_datagram_size`` changes ``_max_datagram_size`` on a live connection; aioquic
    builds every transmit's packets from it, so the next datagrams are that large."""
    client, _ = _plain_pair(make_credentials)
    assert client._max_datagram_size == 1452
    client._max_datagram_size = 4000
    client._loss._cc.congestion_window = 100_000
    client.send_stream_data(STREAM, bytes(50_000))
    sizes = [len(data) for data, _ in client.datagrams_to_send(now=Clock.now)]
    assert max(sizes) == 4000


def test_the_congestion_controller_and_pacer_count_in_datagrams_of_a_size() -> None:
    """``set_datagram_size`` rewrites these: Reno's and CUBIC's step, the pacer's burst."""
    from aioquic.quic.congestion.base import K_INITIAL_WINDOW, K_MINIMUM_WINDOW
    from aioquic.quic.congestion.cubic import CubicCongestionControl
    from aioquic.quic.congestion.reno import RenoCongestionControl
    from aioquic.quic.recovery import QuicPacketPacer

    assert (K_INITIAL_WINDOW, K_MINIMUM_WINDOW) == (10, 2)
    reno = RenoCongestionControl(max_datagram_size=1452)
    assert reno._max_datagram_size == 1452 and reno.ssthresh is None
    assert reno.congestion_window == 10 * 1452
    cubic = CubicCongestionControl(max_datagram_size=1452)
    assert cubic._max_datagram_size == 1452 and cubic.additive_increase_factor == 1452
    assert QuicPacketPacer(max_datagram_size=1452)._max_datagram_size == 1452
    assert QuicConfiguration().congestion_control_algorithm == "reno"


def test_the_loss_recovery_is_built_from_these_arguments_and_kept_as_loss(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """EngineConnection replaces ``_loss`` in its constructor with a subclass built from
    the same arguments, before anything used it; ``_on_packets_lost`` is what it wraps."""
    from aioquic.quic.recovery import QuicPacketPacer, QuicPacketRecovery

    assert _parameters(QuicPacketRecovery.__init__) == [
        "self",
        "congestion_control_algorithm",
        "initial_rtt",
        "max_datagram_size",
        "peer_completed_address_validation",
        "send_probe",
        "logger",
        "quic_logger",
    ]
    assert _parameters(QuicPacketRecovery._on_packets_lost) == [
        "self",
        "congestion_event",
        "now",
        "packets",
        "persistent_congestion",
        "space",
    ]
    client = QuicConnection(
        configuration=_configuration(make_credentials("client"), is_client=True)
    )
    assert isinstance(client._loss, QuicPacketRecovery) and client._loss.spaces == []
    for name in ("_configuration", "_is_client", "_quic_logger", "_logger", "_send_probe"):
        assert hasattr(client, name), name
    assert isinstance(client._loss._pacer, QuicPacketPacer)
    assert client._loss.get_probe_timeout() > 0


def test_transport_parameters_carry_max_udp_payload_size_and_aioquic_sends_none(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """EngineConnection adds max_udp_payload_size to what ``_serialize_transport_parameters``
    returns and reads the peer's again after ``_parse_transport_parameters``."""
    from aioquic._buffer import Buffer as TypedBuffer
    from aioquic.quic.packet import (
        QuicTransportParameters,
        pull_quic_transport_parameters,
        push_quic_transport_parameters,
    )

    assert _parameters(QuicConnection._serialize_transport_parameters) == ["self"]
    assert _parameters(QuicConnection._parse_transport_parameters) == [
        "self",
        "data",
        "from_session_ticket",
    ]
    client = QuicConnection(
        configuration=_configuration(make_credentials("client"), is_client=True)
    )
    client.connect(SERVER, now=Clock.now)  # builds the TLS context and its parameters
    ours = pull_quic_transport_parameters(
        TypedBuffer(data=client._serialize_transport_parameters())
    )
    assert ours.max_udp_payload_size is None
    buf = TypedBuffer(capacity=64)
    push_quic_transport_parameters(buf, QuicTransportParameters(max_udp_payload_size=16384))
    assert pull_quic_transport_parameters(TypedBuffer(data=buf.data)).max_udp_payload_size == 16384


def test_what_a_probe_is_built_and_registered_with(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``send_mtu_probe`` builds a 1-RTT packet with these, then registers it itself."""
    from aioquic.quic.packet_builder import QuicDeliveryState, QuicSentPacket

    assert _parameters(QuicPacketBuilder.__init__) == [
        "self",
        "host_cid",
        "peer_cid",
        "version",
        "is_client",
        "max_datagram_size",
        "packet_number",
        "peer_token",
        "quic_logger",
        "spin_bit",
    ]
    assert isinstance(QuicPacketBuilder.remaining_buffer_space, property)
    assert isinstance(QuicPacketBuilder.packet_number, property)
    assert {"in_flight", "sent_time", "sent_bytes", "delivery_handlers"} <= set(
        QuicSentPacket.__dataclass_fields__
    )
    assert {state.name for state in QuicDeliveryState} >= {"ACKED", "LOST"}
    assert quic_connection.QuicConnectionState.CONNECTED not in quic_connection.END_STATES
    client, _ = _plain_pair(make_credentials)
    assert client._cryptos[tls.Epoch.ONE_RTT].send.is_valid()
    path = client._network_paths[0]
    assert path.addr == SERVER and isinstance(path.bytes_sent, int)
    assert isinstance(client._packet_number, int) and isinstance(client._peer_cid.cid, bytes)
    assert isinstance(client._spin_bit, bool) and client._version is not None


def test_a_lost_packet_not_in_flight_leaves_the_congestion_window_alone(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """Why a probe is registered with ``in_flight = False``: its loss is reported to its
    delivery handler, and the congestion controller never hears of it."""
    from aioquic.quic.packet_builder import QuicSentPacket

    client, _ = _plain_pair(make_credentials)
    recovery, space = client._loss, client._spaces[tls.Epoch.ONE_RTT]
    window, in_flight = recovery.congestion_window, recovery.bytes_in_flight
    heard: list[object] = []
    packet = QuicSentPacket(
        epoch=tls.Epoch.ONE_RTT,
        in_flight=False,
        is_ack_eliciting=True,
        is_crypto_packet=False,
        packet_number=10_000,
        packet_type=quic_connection.QuicPacketType.ONE_RTT,
        sent_bytes=8000,
        sent_time=Clock.now,
    )
    packet.delivery_handlers.append((lambda state: heard.append(state), ()))
    recovery.on_packet_sent(packet=packet, space=space)
    assert recovery.bytes_in_flight == in_flight
    recovery._on_packets_lost(now=Clock.now + 1, packets=[packet], space=space)
    assert len(heard) == 1 and 10_000 not in space.sent_packets
    assert (recovery.congestion_window, recovery.bytes_in_flight) == (window, in_flight)


def test_an_unfinished_request_stream_costs_no_more_than_it_is_charged() -> None:
    """IncomingRequests charges each unfinished request its buffer plus REQUEST_STREAM_COST,
    which must cover aioquic's stream state (its QuicStream, sender and receiver) and our
    entry for it."""
    import sys
    import tracemalloc

    from aioquic.quic.packet import QuicStreamFrame
    from aioquic.quic.stream import QuicStream

    from velomux_quic.transport.requests import REQUEST_STREAM_COST

    streams = 2_000
    held: dict[int, tuple[QuicStream, bytearray]] = {}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number in range(streams):
            stream = QuicStream(
                stream_id=4 * number + 1,
                max_stream_data_local=64 * 1024,
                max_stream_data_remote=64 * 1024,
            )
            event = stream.receiver.handle_frame(QuicStreamFrame(offset=0, data=b"ab"))
            assert event is not None
            buffer = bytearray(event.data)
            held[stream.stream_id] = (stream, buffer)
        per_stream = (tracemalloc.get_traced_memory()[0] - before) / streams
    finally:
        tracemalloc.stop()
    buffer_size = sys.getsizeof(bytearray(b"ab"))
    print(f"an unfinished request stream holds {per_stream:.0f} bytes")
    assert per_stream <= REQUEST_STREAM_COST + buffer_size


def test_the_peer_close_drains_and_is_kept_as_the_close_event(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """``EngineConnection.peer_close`` reads ``_state`` and ``_close_event``: aioquic drains
    only on the peer's CONNECTION_CLOSE (its own close makes it CLOSING) and keeps that
    close, unreported until the draining period ends, as ``_close_event``."""
    client, server = _plain_pair(make_credentials)
    client.close(error_code=0x130, frame_type=6, reason_phrase="untrusted_chain")
    for data, _ in client.datagrams_to_send(now=Clock.now):
        server.receive_datagram(data, CLIENT, now=Clock.now)
    assert client._state is quic_connection.QuicConnectionState.CLOSING
    assert server._state is quic_connection.QuicConnectionState.DRAINING
    closing = server._close_event
    assert closing is not None
    assert (closing.error_code, closing.frame_type, closing.reason_phrase) == (
        0x130,
        6,
        "untrusted_chain",
    )
    assert not any(isinstance(event, events.ConnectionTerminated) for event in drain(server))
