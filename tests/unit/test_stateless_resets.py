"""The stateless-reset core, without sockets: tokens, sizes, the rate bound, recognition."""

from __future__ import annotations

import pytest

from velomux_quic.transport.resets import (
    REMEMBERED_TOKENS,
    RESET_BURST,
    RESET_MAX_BYTES,
    RESET_MIN_BYTES,
    RESET_RATE,
    TOKEN_BYTES,
    StatelessResets,
    reset_key_from,
)

CID = bytes(range(8))


def test_tokens_are_a_function_of_the_key_and_the_connection_id() -> None:
    key = reset_key_from(b"a private key")
    assert key == reset_key_from(b"a private key")  # a restarted node issues the same tokens
    assert key != reset_key_from(b"another private key")
    one, same = StatelessResets(key), StatelessResets(key)
    assert one.token(CID) == same.token(CID)
    assert len(one.token(CID)) == TOKEN_BYTES
    assert one.token(CID) != one.token(bytes(8))
    assert StatelessResets().token(CID) != one.token(CID)  # no key: a random one


@pytest.mark.parametrize(
    ("trigger", "expected"),
    [(1200, RESET_MAX_BYTES), (RESET_MAX_BYTES + 1, RESET_MAX_BYTES), (30, 29), (22, 21)],
)
def test_a_reset_is_shorter_than_its_trigger_and_never_longer_than_the_cap(
    trigger: int, expected: int
) -> None:
    resets = StatelessResets(b"k" * 32)
    reset = resets.build(CID, trigger, now=0.0)
    assert reset is not None and len(reset) == expected
    assert reset[0] & 0xC0 == 0x40  # looks like a short-header packet
    assert reset.endswith(resets.token(CID))
    assert StatelessResets.matches(reset, [resets.token(CID)])


@pytest.mark.parametrize("trigger", [0, 1, RESET_MIN_BYTES])
def test_a_datagram_too_short_to_undercut_gets_no_reset(trigger: int) -> None:
    resets = StatelessResets(b"k" * 32)
    assert resets.build(CID, trigger, now=0.0) is None
    assert resets.sent == 0 and resets.suppressed == 0


def test_the_rate_bound_allows_a_burst_then_the_rate() -> None:
    resets = StatelessResets(b"k" * 32, now=0.0)
    built = [resets.build(CID, 100, now=0.0) for _ in range(RESET_BURST + 5)]
    assert sum(reset is not None for reset in built) == RESET_BURST
    assert resets.suppressed == 5
    one_second_later = [resets.build(CID, 100, now=1.0) for _ in range(RESET_BURST)]
    assert sum(reset is not None for reset in one_second_later) == int(RESET_RATE)
    assert resets.sent == RESET_BURST + int(RESET_RATE)


def test_only_a_datagram_ending_in_a_known_token_is_a_reset() -> None:
    resets = StatelessResets(b"k" * 32)
    token = resets.token(CID)
    assert StatelessResets.matches(b"\x40" + bytes(20) + token, [token])
    assert not StatelessResets.matches(b"\x40" + bytes(20) + token, [bytes(16)])
    assert not StatelessResets.matches(token, [token])  # shorter than any reset
    assert not StatelessResets.matches(b"\x40" + bytes(40), [])


def test_tokens_of_closed_connections_are_recognised_late_and_bounded() -> None:
    resets = StatelessResets(b"k" * 32)
    old = [bytes([n % 256, n // 256]) * 8 for n in range(REMEMBERED_TOKENS + 1)]
    resets.remember(old)
    assert not resets.is_late_reset(b"\x40" + bytes(20) + old[0])  # the oldest went
    assert resets.is_late_reset(b"\x40" + bytes(20) + old[-1])
    assert not resets.is_late_reset(old[-1])  # too short to be a reset
