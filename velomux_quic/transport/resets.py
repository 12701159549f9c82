"""Stateless resets (RFC 9000, section 10.3): telling a peer at once that a connection is gone.

A node that lost a connection's state (its idle timer fired while the peer was stopped,
say) drops the peer's later packets for it without a word, and aioquic sends nothing
either; the peer, whose own sends keep its idle timer fresh, then believes in a dead
connection until something above it (the mux's health check) gives up. A stateless reset
ends that at once: the node answers a short-header packet for a connection ID it does not
know with a packet that looks like any other, whose last 16 bytes are the reset token it
issued with that connection ID; the peer, recognising its token, closes the connection
and dials a new one.

aioquic draws reset tokens at random and forgets nothing it would need to reproduce them,
and never sends or recognises a reset. So the transport derives every token it issues
from a static key (HMAC-SHA256 of the connection ID, cut to 16 bytes, the construction
RFC 9000 section 10.3.2 suggests), which lets it compute the token for a connection ID
after the connection is gone, and checks the tail of an unroutable datagram against the
tokens its peers issued. The key is derived from the node's private key
(:func:`reset_key_from`), so it is secret to the node and survives a restart under the
same identity: a node restarted after a crash resets its peers' old connections at their
first packet, instead of leaving them to their idle timeout. (A node whose private key
was rotated since keeps the key it started with until it restarts.)

Resets are bounded: one is always shorter than the datagram that provoked it (two
endpoints without state cannot echo one another for ever; a datagram too short to answer
gets none), at most :data:`RESET_MAX_BYTES` long (never an amplifier), and a token bucket
caps how many leave per second (:data:`RESET_RATE`, :data:`RESET_BURST`), so a flood of
junk short-header datagrams costs the node a few small packets a second.

Sans-IO: the clock is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Iterable

__all__ = [
    "REMEMBERED_TOKENS",
    "RESET_BURST",
    "RESET_MAX_BYTES",
    "RESET_MIN_BYTES",
    "RESET_RATE",
    "TOKEN_BYTES",
    "StatelessResets",
    "reset_key_from",
]

TOKEN_BYTES = 16
"""A stateless reset token's length (RFC 9000)."""

RESET_MIN_BYTES = 21
"""The smallest stateless reset: a first byte, 4 unpredictable bytes and the token."""

RESET_MAX_BYTES = 43
"""The longest reset sent: a short header with an 8-byte connection ID, a little of
unpredictable payload and the token, the size RFC 9000 suggests so that a reset is not
told apart from an ordinary packet by its length."""

RESET_RATE = 20.0
"""Resets per second the node sends at most, on average."""

RESET_BURST = 20
"""Resets the node may send at once before :data:`RESET_RATE` applies."""

REMEMBERED_TOKENS = 1024
"""Peer tokens of connections already closed that the node still recognises, newest kept.

Both ends of a connection often give up on it at about the same time (each one's idle
timer fires); a reset that arrives after this node closed the connection must be taken
for what it is, not answered with a reset of its own: two nodes would otherwise trade
ever shorter resets down to the minimum size."""


def reset_key_from(private_key_der: bytes) -> bytes:
    """The reset key of the node whose private key (DER) this is: a pseudo-random function
    of the key (HMAC-SHA256 under a fixed label, HKDF's extract step), so that knowing the
    reset key tells nothing of the private key and the same key always gives the same one."""
    return hmac.new(b"velomux stateless reset key v1", private_key_der, hashlib.sha256).digest()


class StatelessResets:
    """The node's reset key, its tokens, and the bounds on the resets it sends.

    One per transport. :meth:`token` is the token issued with a host connection ID;
    :meth:`build` makes the reset for a datagram addressed to an unknown connection ID
    (None when it must not be answered); :meth:`matches` says whether a datagram is a reset
    carrying one of a connection's peer tokens.
    """

    def __init__(
        self,
        key: bytes | None = None,
        *,
        rate: float = RESET_RATE,
        burst: int = RESET_BURST,
        now: float = 0.0,
    ) -> None:
        self._key = key if key is not None else os.urandom(32)
        self._rate = rate
        self._burst = float(burst)
        self._allowance = float(burst)
        self._refilled_at = now
        self.sent = 0
        """Resets built (and so sent by the caller)."""
        self.suppressed = 0
        """Datagrams that would have been answered but the rate bound refused."""
        self._closed_tokens: OrderedDict[bytes, None] = OrderedDict()

    def remember(self, peer_tokens: Iterable[bytes]) -> None:
        """Keep recognising the tokens of a connection that just closed (bounded)."""
        for token in peer_tokens:
            self._closed_tokens[token] = None
            self._closed_tokens.move_to_end(token)
        while len(self._closed_tokens) > REMEMBERED_TOKENS:
            self._closed_tokens.popitem(last=False)

    def is_late_reset(self, datagram: bytes) -> bool:
        """Whether ``datagram`` is a reset of a connection this node already closed."""
        return len(datagram) >= RESET_MIN_BYTES and datagram[-TOKEN_BYTES:] in self._closed_tokens

    def token(self, cid: bytes) -> bytes:
        """The stateless reset token issued with host connection ID ``cid``."""
        return hmac.new(self._key, cid, hashlib.sha256).digest()[:TOKEN_BYTES]

    def build(self, cid: bytes, trigger_size: int, now: float) -> bytes | None:
        """A reset answering a short-header datagram of ``trigger_size`` bytes sent to
        ``cid``; None when the datagram is too short to answer or the rate bound is spent."""
        size = min(trigger_size - 1, RESET_MAX_BYTES)
        if size < RESET_MIN_BYTES:
            return None
        self._allowance = min(self._burst, self._allowance + (now - self._refilled_at) * self._rate)
        self._refilled_at = now
        if self._allowance < 1.0:
            self.suppressed += 1
            return None
        self._allowance -= 1.0
        self.sent += 1
        unpredictable = bytearray(os.urandom(size - TOKEN_BYTES))
        # A short header: the form bit clear, the fixed bit set, the rest unpredictable.
        unpredictable[0] = (unpredictable[0] & 0x3F) | 0x40
        return bytes(unpredictable) + self.token(cid)

    @staticmethod
    def matches(datagram: bytes, peer_tokens: Iterable[bytes]) -> bool:
        """Whether ``datagram`` ends with one of ``peer_tokens`` (compared in constant time)."""
        if len(datagram) < RESET_MIN_BYTES:
            return False
        tail = datagram[-TOKEN_BYTES:]
        return any(hmac.compare_digest(tail, token) for token in peer_tokens)
