"""Retry tokens: the proof that an Initial's sender receives at its source address.

When :class:`~.handshakes.HandshakeBudget` asks for address validation, the endpoint
answers an Initial with a Retry (:func:`~.packets.encode_retry`) carrying one of these
tokens, and accepts the connection only when the client's next Initial brings it back
(RFC 9000 section 8.1.2). A token is sealed with a key only this endpoint holds
(AES-128-GCM, a fresh nonce each), so nobody else can make one; it names the original
destination connection ID the connection will be made with, and is bound, as associated
data, to the client's address and to the connection ID the Retry asked the client to use,
so a token copied to another source or another dial does not open. Clients answer a Retry
at once, so a token lives :data:`TOKEN_LIFETIME` seconds.
"""

from __future__ import annotations

import ipaddress
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["TOKEN_LIFETIME", "RetryTokens"]

TOKEN_LIFETIME = 30.0
"""Seconds a Retry token is accepted after it was issued."""

_NONCE = 12
_STAMP = 8

Address = tuple[str, int]


def _bound_to(address: Address, retry_source_cid: bytes) -> bytes:
    host = ipaddress.ip_address(address[0]).packed
    return host + address[1].to_bytes(2, "big") + retry_source_cid


class RetryTokens:
    """Issues and checks this endpoint's Retry tokens (its key lives as long as it does)."""

    def __init__(self) -> None:
        self._aead = AESGCM(AESGCM.generate_key(bit_length=128))

    def issue(
        self, address: Address, original_destination_cid: bytes, retry_source_cid: bytes, now: float
    ) -> bytes:
        """A token for a Retry sent to ``address`` from ``retry_source_cid``."""
        plaintext = (
            bytes((len(original_destination_cid),))
            + original_destination_cid
            + int(now * 1000).to_bytes(_STAMP, "big")
        )
        nonce = os.urandom(_NONCE)
        sealed = self._aead.encrypt(nonce, plaintext, _bound_to(address, retry_source_cid))
        return nonce + sealed

    def check(self, address: Address, destination_cid: bytes, token: bytes, now: float) -> bytes:
        """The original destination connection ID of a valid token; ValueError otherwise.

        ``destination_cid`` is where the client sent this Initial: the Retry's source
        connection ID, which the token was bound to.
        """
        if len(token) < _NONCE:
            raise ValueError("retry token too short")
        try:
            plaintext = self._aead.decrypt(
                token[:_NONCE], token[_NONCE:], _bound_to(address, destination_cid)
            )
        except InvalidTag as exc:
            raise ValueError("retry token not ours, or for another address or dial") from exc
        length = plaintext[0]
        if len(plaintext) != 1 + length + _STAMP:
            raise ValueError("retry token malformed")
        issued = int.from_bytes(plaintext[1 + length :], "big") / 1000
        if now - issued > TOKEN_LIFETIME:
            raise ValueError("retry token expired")
        return plaintext[1 : 1 + length]
