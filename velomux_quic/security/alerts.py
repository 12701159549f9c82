"""What both engines' TLS hooks say on the wire: the ALPN id and the refusals' alerts.

A refused peer learns the refusal's reason code, as the TLS alert it is sent as and as the
CONNECTION_CLOSE reason phrase, on aioquic (:mod:`.tls`) and qh3 (:mod:`.qh3_tls`) alike.
Both hooks and the transport read them here, where no engine is imported, so a node on
one engine never loads the other.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["ALPN_PROTOCOL", "Role", "alert_code_of", "parse_refusal_reason"]

ALPN_PROTOCOL = "velomux/1"
"""Our ALPN id: a QUIC client for another protocol (HTTP/3, ...) is refused in the handshake."""

Role = Literal["client", "server"]

_BAD_CERTIFICATE = 42
"""The TLS alert of a refusal without a closer one (RFC 8446 section 6)."""

_ALERTS: dict[str, int] = {
    "no_certificate": 116,  # certificate_required
    "expired": 45,  # certificate_expired
    "not_yet_valid": 45,  # certificate_expired
    "untrusted_chain": 48,  # unknown_ca
    "bad_key_usage": 43,  # unsupported_certificate
    "bad_identity": _BAD_CERTIFICATE,
    "identity_mismatch": _BAD_CERTIFICATE,
    "bad_signature": 51,  # decrypt_error
}


def alert_code_of(reason: str) -> int:
    """The TLS alert (its code) a refusal for ``reason`` is sent as, on either engine."""
    return _ALERTS.get(reason, _BAD_CERTIFICATE)


def parse_refusal_reason(reason_phrase: str) -> str | None:
    """The verification reason code a CONNECTION_CLOSE reason phrase carries.

    The phrase is the bare code; an older node sent ``code: details``, read the same way.
    """
    head = reason_phrase.partition(":")[0].strip()
    return head if head in _ALERTS else None
