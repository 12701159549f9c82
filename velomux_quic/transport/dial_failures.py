"""Why a connection never got past its handshake, as the :class:`DialError` a dial raises.

A dial's failure is told apart by its reason, which callers act on and the metrics count:
this node refused the peer's certificate (the verifier's reason), the peer refused ours
(``refused_by_peer:<reason>``, with the fix read from the certificate this node
presented), the peer answered with a stateless reset (``reset_by_peer``: it restarted,
and the next send dials again), no handshake in time (``handshake_timeout``), or nothing
usable came back at all (``unreachable``). How the connection ended decides which; the
decision is kept here, apart from the connection, because it reads nothing but that
ending and what the connection knew of it.
"""

from __future__ import annotations

from ..errors import ChannelClosed, DialError
from ..security.alerts import parse_refusal_reason
from ..security.certs import NodeCredentials
from ..security.startup import own_certificate_refusal
from ..security.verify import PeerVerificationError
from .seam import ConnectionTerminated
from .states import CloseCode

__all__ = ["dial_failure", "never_connected"]

_CRYPTO_ERROR_FIRST = 0x100
"""QUIC's CRYPTO_ERROR range (RFC 9000 section 20.1): 0x100 plus the TLS alert."""
_CRYPTO_ERROR_LAST = _CRYPTO_ERROR_FIRST + 0xFF


def dial_failure(
    event: ConnectionTerminated,
    peer: str,
    *,
    ours: PeerVerificationError | None,
    reset_in_handshake: bool,
    credentials: NodeCredentials,
) -> DialError:
    """The error of a dial to ``peer`` (as errors name it) whose connection ended with
    ``event`` before its handshake completed. ``ours``: this node's refusal of the peer's
    certificate, if it refused it; ``reset_in_handshake``: a stateless reset ended the
    handshake; ``credentials``: what this node presented."""
    if ours is not None:
        return DialError(
            f"this node refused the peer's certificate ({peer}): {ours}", reason=ours.reason
        )
    if reset_in_handshake:
        # Before the crypto range check: the reset's SHUTDOWN code falls in it.
        return DialError(
            f"{peer} answered the handshake with a stateless reset: it has"
            " no state for this connection (it restarted, or already let it go); the"
            " next send dials again",
            reason="reset_by_peer",
        )
    if _CRYPTO_ERROR_FIRST <= event.error_code <= _CRYPTO_ERROR_LAST:
        theirs = parse_refusal_reason(event.reason_phrase)
        why = own_certificate_refusal(credentials, theirs, event.reason_phrase)
        return DialError(
            f"{peer} refused OUR certificate: {why}",
            reason=f"refused_by_peer:{theirs}" if theirs else "handshake_failed",
        )
    if event.error_code == CloseCode.HANDSHAKE_TIMEOUT:
        return DialError(f"no handshake with {peer} in time", reason="handshake_timeout")
    return DialError(
        f"connection to {peer} failed before the handshake: "
        f"{event.reason_phrase or event.error_code}",
        reason="unreachable",
    )


def never_connected(peer: str, dial_error: DialError) -> ChannelClosed:
    """What a frame waiting on a connection whose handshake failed is refused with: the
    dial's own error as its cause, so a caller can tell "no connection could be made"
    (a wrong address, a refused certificate: resending will not help) from a
    connection that ended under it."""
    error = ChannelClosed(f"no connection to {peer}: {dial_error}")
    error.__cause__ = dial_error
    return error
