"""Which inbound Initials get handshake state: address validation first, then the budgets.

A new connection's first datagram costs the node the TLS state of a handshake; a Retry
costs it one small packet and no state. :class:`HandshakeBudget` decides between the
two (or a silent drop) from what the endpoint parsed of the Initial (its source IP and
whether it carried one of our valid Retry tokens), and keeps the count of the
handshakes it let in until the endpoint says each ended. It is sans-IO and knows nothing
of the QUIC engine, so it is tested without sockets.

The rules, and why:

- **Unvalidated and validated handshakes are counted apart.** An Initial without a token
  may come from a spoofed source address, so it must never spend a budget that a sender
  which proved its address (it answered our Retry) needs: one host flooding Initials
  with a peer's address as their source would otherwise lock that peer out.
- **An unvalidated Initial gets a slot only while it is cheap to give**: fewer than
  ``retry_threshold`` handshakes in progress in all, and fewer than
  ``max_half_open_per_source`` unvalidated ones from its source. Otherwise it is answered
  with a Retry, never dropped, so a real peer behind a flood of its own address still
  gets through, one round trip later. A Retry is smaller than the Initial that asked for
  it (which is at least 1,200 bytes), so it amplifies nothing.
- **A validated Initial** counts against ``max_half_open_per_source`` validated slots of
  its source and ``max_half_open_handshakes`` validated slots in all; past either it is
  dropped (its sender retransmits, and by then a slot is usually free).

So at most ``retry_threshold`` unvalidated plus ``max_half_open_handshakes`` validated
handshakes are ever held.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["HandshakeBudget", "InitialVerdict", "Verdict"]


class Verdict(enum.Enum):
    ACCEPT = "accept"
    """Make the connection: its handshake gets a slot."""
    RETRY = "retry"
    """Answer with a stateless Retry: the sender must prove it receives at its address."""
    DROP = "drop"
    """Say nothing and keep nothing."""


@dataclass(frozen=True, slots=True)
class InitialVerdict:
    """What to do with one Initial, and the rejection reason to count (None for ACCEPT)."""

    verdict: Verdict
    reason: str | None = None


_ACCEPT = InitialVerdict(Verdict.ACCEPT)
_RETRY_LOAD = InitialVerdict(Verdict.RETRY, "handshake_retry")
_RETRY_SOURCE = InitialVerdict(Verdict.RETRY, "handshake_per_source")
_DROP_SOURCE = InitialVerdict(Verdict.DROP, "handshake_per_source")
_DROP_OVERLOAD = InitialVerdict(Verdict.DROP, "handshake_overload")


class HandshakeBudget:
    """The inbound handshakes in progress, per source and validation, and the verdict for
    the next Initial (see the module docstring)."""

    def __init__(self, *, retry_threshold: int, max_half_open: int, max_per_source: int) -> None:
        self._retry_threshold = retry_threshold
        self._max_half_open = max_half_open
        self._max_per_source = max_per_source
        self._held: dict[Hashable, tuple[str, bool]] = {}
        """Each handshake in progress: its source and whether its address was validated."""
        self._per_source: dict[tuple[str, bool], int] = {}
        self._validated = 0

    @property
    def in_progress(self) -> int:
        """Handshakes holding a slot now, validated or not."""
        return len(self._held)

    @property
    def validated_in_progress(self) -> int:
        return self._validated

    def verdict(self, source: str, *, validated: bool) -> InitialVerdict:
        """What to do with an Initial from ``source``; ``validated`` when it carried one of
        our valid Retry tokens. Nothing is counted until :meth:`opened`."""
        from_source = self._per_source.get((source, validated), 0)
        if validated:
            if from_source >= self._max_per_source:
                return _DROP_SOURCE
            if self._validated >= self._max_half_open:
                return _DROP_OVERLOAD
            return _ACCEPT
        if len(self._held) >= self._retry_threshold:
            return _RETRY_LOAD
        if from_source >= self._max_per_source:
            return _RETRY_SOURCE
        return _ACCEPT

    def opened(self, handshake: Hashable, source: str, *, validated: bool) -> None:
        """A handshake the verdict accepted now holds its slot until :meth:`ended`."""
        key = (source, validated)
        self._held[handshake] = key
        self._per_source[key] = self._per_source.get(key, 0) + 1
        if validated:
            self._validated += 1

    def ended(self, handshake: Hashable) -> bool:
        """The handshake finished, either way; False when it held no slot here."""
        key = self._held.pop(handshake, None)
        if key is None:
            return False
        left = self._per_source[key] - 1
        if left:
            self._per_source[key] = left
        else:
            del self._per_source[key]
        if key[1]:
            self._validated -= 1
        return True
