"""Replies held as bytes while the return dial is in its handshake: charged what they hold,
handed back whole and in order."""

from __future__ import annotations

import pytest

from velomux_quic.messenger.envelope import Kind, encode_envelope
from velomux_quic.messenger.held_replies import RECORD_OVERHEAD, HeldReplies

pytestmark = pytest.mark.timeout(10)


def test_held_replies_come_back_in_order_with_their_lanes() -> None:
    held = HeldReplies()
    replies = [
        (lane, encode_envelope(Kind.RESPONSE, message_id=n + 1, payload=bytes(n)))
        for n, lane in enumerate([0, 3, 0, 1])
    ]
    charged = sum(held.add(lane, body) for lane, body in replies)
    assert held.count == 4 and held.charged == charged
    assert list(held.drain()) == replies
    assert held.count == 0 and held.charged == 0


def test_fifty_thousand_empty_replies_fit_the_reply_bound() -> None:
    """What made an honest burst lose replies: 512 bytes charged each filled 4 MiB at 8,192."""
    held = HeldReplies()
    body = encode_envelope(Kind.RESPONSE, message_id=1 << 30, payload=b"")
    for _ in range(50_000):
        held.add(0, body)
    assert held.charged == 50_000 * (len(body) + RECORD_OVERHEAD)
    assert held.charged < 4 * 1024 * 1024
    # All of them handed back, in one buffer of their bytes.
    assert sum(1 for _ in held.drain()) == 50_000
