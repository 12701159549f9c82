"""How a connection that never completed its handshake ended, read as the dial's error."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from velomux_quic.errors import ChannelClosed, DialError, PeerVerificationError
from velomux_quic.security.certs import NodeCredentials
from velomux_quic.transport.dial_failures import dial_failure, never_connected
from velomux_quic.transport.seam import ConnectionTerminated
from velomux_quic.transport.states import CloseCode

PEER = "the peer"


def ended(code: int, phrase: str = "") -> ConnectionTerminated:
    return ConnectionTerminated(error_code=code, frame_type=None, reason_phrase=phrase)


@pytest.fixture
def credentials(make_credentials: Callable[..., NodeCredentials]) -> NodeCredentials:
    return make_credentials("dialer")


def read(
    event: ConnectionTerminated,
    credentials: NodeCredentials,
    *,
    ours: PeerVerificationError | None = None,
    reset: bool = False,
) -> DialError:
    return dial_failure(event, PEER, ours=ours, reset_in_handshake=reset, credentials=credentials)


def test_our_refusal_of_the_peers_certificate_carries_our_reason(
    credentials: NodeCredentials,
) -> None:
    refusal = PeerVerificationError("expired", "the dialed peer's certificate expired")
    error = read(ended(0x100 + 45, "expired"), credentials, ours=refusal)
    assert error.reason == "expired"
    assert "this node refused the peer's certificate (the peer)" in str(error)


def test_the_peers_refusal_of_ours_names_its_reason(credentials: NodeCredentials) -> None:
    error = read(ended(0x100 + 48, "untrusted_chain"), credentials)
    assert error.reason == "refused_by_peer:untrusted_chain"
    assert str(error).startswith("the peer refused OUR certificate: ")
    assert read(ended(0x100 + 40, "handshake failure"), credentials).reason == "handshake_failed"


def test_a_stateless_reset_in_the_handshake_is_not_read_as_a_tls_failure(
    credentials: NodeCredentials,
) -> None:
    # The reset's SHUTDOWN code falls in the crypto error range.
    error = read(ended(int(CloseCode.SHUTDOWN), "stateless reset"), credentials, reset=True)
    assert error.reason == "reset_by_peer"


def test_a_connection_that_heard_no_answer_is_unreachable(credentials: NodeCredentials) -> None:
    silent = read(ended(0, "idle timeout"), credentials)
    assert silent.reason == "unreachable"
    assert str(silent) == "connection to the peer failed before the handshake: idle timeout"


def test_a_frame_refused_for_a_failed_dial_has_the_dial_as_its_cause() -> None:
    dial = DialError("no handshake", reason="handshake_timeout")
    error = never_connected(PEER, dial)
    assert isinstance(error, ChannelClosed)
    assert error.__cause__ is dial
    assert str(error) == "no connection to the peer: no handshake"
