"""Mutual TLS refusals over real QUIC: every bad peer is refused before any handler runs,
and the accepting node keeps serving its good peers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Callable

import pytest
from aioquic.asyncio.client import connect as aioquic_connect
from aioquic.quic.configuration import QuicConfiguration

from tests.conftest import NodeFactory, Recorder, wait_admitted
from velomux_quic.errors import ChannelClosed, DialError
from velomux_quic.ids import new_instance_id
from velomux_quic.security.alerts import ALPN_PROTOCOL
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)
from velomux_quic.security.testing import issue_expired, self_signed_copy, with_mismatched_key
from velomux_quic.transport.admission import SendAdmission
from velomux_quic.transport.endpoint import QuicEndpoint

BadCredentials = Callable[
    [CertificateAuthority, CertificateAuthority, NodeCredentials], NodeCredentials
]


async def assert_still_serves(b: QuicEndpoint, b_seen: Recorder, start_node: NodeFactory) -> None:
    good, _ = await start_node("good")
    good.register_peer(b.instance_id, b.address)
    await wait_admitted([good.send(b.instance_id, 0, b"good")])
    await b_seen.wait_until(lambda: b_seen.frames.get((good.instance_id, 0)) == [b"good"])


def _other_ca(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    stranger = issue_node_certificate(other, new_instance_id(), name="stranger")
    # The stranger trusts our CA (an attacker would), so only the server's check can stop it.
    return dataclasses.replace(stranger, trust_roots=[other.certificate, ca.certificate])


def _expired(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return issue_expired(ca, new_instance_id(), name="expired")


def _mismatched_key(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return with_mismatched_key(issue_node_certificate(ca, new_instance_id(), name="thief"))


def _self_signed_copy(
    ca: CertificateAuthority, other: CertificateAuthority, victim: NodeCredentials
) -> NodeCredentials:
    return self_signed_copy(victim, mimic_issuer=True)


@pytest.mark.parametrize(
    ("make_bad", "server_reason"),
    [
        (_other_ca, "untrusted_chain"),
        (_expired, "expired"),
        (_mismatched_key, "bad_signature"),  # aioquic's CertificateVerify check fails
        (_self_signed_copy, "untrusted_chain"),
    ],
    ids=["other_ca", "expired", "key_does_not_match", "self_signed_copy_of_a_real_node"],
)
async def test_bad_client_certificate_is_refused_before_any_frame(
    start_node: NodeFactory,
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    make_credentials: Callable[..., NodeCredentials],
    make_bad: BadCredentials,
    server_reason: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="velomux_quic.transport.connection")
    b, b_seen = await start_node("b")
    real_a = make_credentials("a")
    bad, _ = await start_node("bad", credentials=make_bad(ca, other_ca, real_a))
    bad.register_peer(b.instance_id, b.address)

    outcome = bad.send(b.instance_id, 0, b"must never arrive")
    assert isinstance(outcome, SendAdmission)  # nothing is admitted before confirmation
    with pytest.raises(DialError) as refused:
        await asyncio.wait_for(bad.connect(b.instance_id), 10)
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(_await(outcome), 10)

    if server_reason is not None:
        assert refused.value.reason == f"refused_by_peer:{server_reason}"
        assert b.stats.peer_refusals[server_reason] == 1
        # The CONNECTION_CLOSE reason is the code alone: no subject, serial, clock or
        # trust domain of the refusing node reaches a peer it does not trust.
        assert f"refused OUR certificate: {server_reason} (" in str(refused.value)
        detail = [r.getMessage() for r in caplog.records if "refused the client" in r.getMessage()]
        assert len(detail) == 1 and len(detail[0]) > len(server_reason) + 40, detail
    else:
        assert refused.value.reason == "handshake_failed"
    assert b_seen.count() == 0 and b_seen.connected == []
    await assert_still_serves(b, b_seen, start_node)


async def _await(admission: SendAdmission) -> None:
    await admission


async def test_client_without_a_certificate_is_refused(start_node: NodeFactory) -> None:
    """A plain aioquic client (no certificate at all) against a node."""
    b, b_seen = await start_node("b")
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=[ALPN_PROTOCOL], verify_mode=ssl.CERT_NONE
    )
    host, port = b.address
    with pytest.raises(ConnectionError):
        async with aioquic_connect(host, port, configuration=configuration) as client:
            # TLS 1.3 lets the client finish first; the refusal closes the connection.
            _, writer = await client.create_stream(is_unidirectional=True)
            writer.write(b"\x00\x00\x00\x05hello")  # aioquic's public stream API
            await asyncio.wait_for(client.wait_closed(), 10)
            raise ConnectionError("closed by the server")
    await b_seen.wait_until(lambda: b.stats.peer_refusals["no_certificate"] == 1)
    assert b_seen.count() == 0 and b_seen.connected == []
    await assert_still_serves(b, b_seen, start_node)


async def test_dialer_refuses_a_valid_node_that_is_not_the_peer_it_dialed(
    start_node: NodeFactory,
) -> None:
    b, b_seen = await start_node("b")
    a, _ = await start_node("a")
    someone_else = new_instance_id()
    a.register_peer(someone_else, b.address)  # wrong address for that identity
    with pytest.raises(DialError) as refused:
        await asyncio.wait_for(a.connect(someone_else), 10)
    assert refused.value.reason == "identity_mismatch"
    assert a.stats.peer_refusals["identity_mismatch"] == 1
    assert b_seen.count() == 0
    await assert_still_serves(b, b_seen, start_node)


async def test_dialer_refuses_an_impostor_server_with_a_self_signed_copy(
    start_node: NodeFactory,
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    real_b = make_credentials("b")
    impostor, impostor_seen = await start_node("impostor", credentials=self_signed_copy(real_b))
    a, _ = await start_node("a")
    a.register_peer(real_b.instance_id, impostor.address)
    outcome = a.send(real_b.instance_id, 0, b"secret")
    with pytest.raises(DialError) as refused:
        await asyncio.wait_for(a.connect(real_b.instance_id), 10)
    assert refused.value.reason == "untrusted_chain"
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(_await(outcome), 10)  # type: ignore[arg-type]
    assert impostor_seen.count() == 0


async def test_dialer_refuses_and_counts_a_server_signing_with_the_wrong_key(
    start_node: NodeFactory,
    ca: CertificateAuthority,
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    real_b = make_credentials("b")
    thief, thief_seen = await start_node("thief", credentials=with_mismatched_key(real_b))
    a, _ = await start_node("a")
    a.register_peer(real_b.instance_id, thief.address)
    with pytest.raises(DialError) as refused:
        await asyncio.wait_for(a.connect(real_b.instance_id), 10)
    assert refused.value.reason == "bad_signature"
    assert a.stats.peer_refusals["bad_signature"] == 1
    assert thief_seen.count() == 0 and thief_seen.connected == []
