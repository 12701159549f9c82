"""A stateless reset that reaches a dialer whose handshake is ending, on real engines over
an in-memory path on a fake clock (``connection_pair.py``), each engine on each side.

A server that refuses a client's certificate closes in the handshake, with the reason in
its CONNECTION_CLOSE, and forgets the connection once its closing period is over: three
probe timeouts, a few milliseconds on loopback. A packet the client sent before the close
reached it can arrive after that, and is answered with a stateless reset, which reaches a
client already draining with the server's close. The reset must not replace the reason:
the dial fails with ``refused_by_peer:<reason>`` whichever comes last. A reset that no
close preceded fails the dial as ``reset_by_peer``, not as a TLS failure.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import pytest

from velomux_quic.errors import DialError
from velomux_quic.ids import new_instance_id
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)
from velomux_quic.transport.config import TransportConfig

from .connection_pair import Wire, connection_pair

HAS_QH3 = importlib.util.find_spec("qh3") is not None
ENGINES = ("aioquic", "qh3")
PAIRS = [
    pytest.param(
        client,
        server,
        id=f"{client}-dials-{server}",
        marks=pytest.mark.skipif(
            "qh3" in (client, server) and not HAS_QH3, reason="the qh3 extra is not installed"
        ),
    )
    for client in ENGINES
    for server in ENGINES
]

MakeCredentials = Callable[..., NodeCredentials]


def stranger(ca: CertificateAuthority, other_ca: CertificateAuthority) -> NodeCredentials:
    """A client whose certificate another CA signed: the server refuses it as untrusted."""
    own = issue_node_certificate(other_ca, new_instance_id(), name="stranger")
    return dataclasses.replace(own, trust_roots=[other_ca.certificate, ca.certificate])


def one_round(wire: Wire) -> None:
    """Run what is queued, then deliver what is in flight, once (no time passes)."""
    calls, wire.soon = wire.soon, []
    for call in calls:
        call()
    datagrams, wire.in_flight = wire.in_flight, []
    for endpoint, data, source in datagrams:
        endpoint.receive(data, source)


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS)
def test_a_reset_after_the_refusing_close_keeps_the_refusal_reason(
    make_credentials: MakeCredentials,
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    client_engine: str,
    server_engine: str,
) -> None:
    pair = connection_pair(
        make_credentials,
        TransportConfig(engine=client_engine),  # type: ignore[arg-type]
        client_credentials=stranger(ca, other_ca),
        server_config=TransportConfig(engine=server_engine),  # type: ignore[arg-type]
    )
    pair.wire.run_until(pair.wire.now)  # the handshake's flights and the refusal
    dialer = pair.dialer
    assert pair.server.stats.peer_refusals["untrusted_chain"] == 1
    close = dialer.quic.peer_close
    assert close is not None and close.reason_phrase == "untrusted_chain"
    assert dialer.snapshot().state == "handshaking" and not dialer.closed.is_set()  # draining
    assert dialer.quic.peer_reset_tokens()  # a datagram ending in one is taken for a reset

    dialer.reset_by_peer()  # what the endpoint does with the server's reset

    assert dialer.closed.is_set()
    with pytest.raises(DialError) as refused:
        dialer.wait_established().send(None)  # set already: no loop needed to await it
    assert refused.value.reason == "refused_by_peer:untrusted_chain"
    assert "refused OUR certificate: untrusted_chain" in str(refused.value)


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS)
def test_the_draining_dialer_without_a_reset_fails_with_the_same_reason(
    make_credentials: MakeCredentials,
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    client_engine: str,
    server_engine: str,
) -> None:
    pair = connection_pair(
        make_credentials,
        TransportConfig(engine=client_engine),  # type: ignore[arg-type]
        client_credentials=stranger(ca, other_ca),
        server_config=TransportConfig(engine=server_engine),  # type: ignore[arg-type]
    )
    pair.wire.settle(1.0)  # the draining period ends on the dialer's own timer
    assert pair.dialer.closed.is_set()
    with pytest.raises(DialError) as refused:
        pair.dialer.wait_established().send(None)
    assert refused.value.reason == "refused_by_peer:untrusted_chain"


@pytest.mark.parametrize(("client_engine", "server_engine"), PAIRS)
def test_a_reset_in_a_handshake_no_close_preceded_fails_the_dial_as_reset_by_peer(
    make_credentials: MakeCredentials, client_engine: str, server_engine: str
) -> None:
    pair = connection_pair(
        make_credentials,
        TransportConfig(engine=client_engine),  # type: ignore[arg-type]
        server_config=TransportConfig(engine=server_engine),  # type: ignore[arg-type]
    )
    one_round(pair.wire)  # the dialer's Initial reaches the server
    one_round(pair.wire)  # the server's flight reaches the dialer, with its reset token
    pair.wire.up = False  # the server is gone (restarted) before it saw the dialer's reply
    dialer = pair.dialer
    assert dialer.quic.peer_reset_tokens() and dialer.quic.peer_close is None
    assert dialer.snapshot().state == "handshaking"

    dialer.reset_by_peer()

    with pytest.raises(DialError) as reset:
        dialer.wait_established().send(None)
    assert reset.value.reason == "reset_by_peer"
    assert "stateless reset" in str(reset.value)
