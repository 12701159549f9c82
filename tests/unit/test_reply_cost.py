"""What a reply waiting in an admission gate really holds, against what the reply bound
charges for it (REPLY_OVERHEAD beyond its payload)."""

from __future__ import annotations

import tracemalloc

from velomux_quic.ids import new_instance_id
from velomux_quic.messenger.envelope import Kind, encode_envelope
from velomux_quic.messenger.messenger import REPLY_OVERHEAD
from velomux_quic.transport.admission import LaneGate, SendAdmission


def test_an_empty_waiting_reply_holds_no_more_than_it_is_charged() -> None:
    peer = new_instance_id()
    gate = LaneGate(lambda: 0, lambda: False, lambda frame: None)  # a lane with no room
    charged: dict[object, int] = {}

    def uncharge(peer: object, cost: int, admission: SendAdmission) -> None:
        charged[peer] = charged.get(peer, 0) - cost

    replies = 10_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for message_id in range(1 << 20, (1 << 20) + replies):
            # What Messenger._reply does for an empty answer whose lane is full.
            body = encode_envelope(Kind.RESPONSE, handler="", message_id=message_id, payload=b"")
            outcome = gate.send(body)
            assert isinstance(outcome, SendAdmission)
            cost = REPLY_OVERHEAD
            outcome.on_resolved(lambda admission, cost=cost: uncharge(peer, cost, admission))
        held = (tracemalloc.get_traced_memory()[0] - before) / replies
    finally:
        tracemalloc.stop()
    print(f"an empty waiting reply holds {held:.0f} bytes; charged {REPLY_OVERHEAD}")
    assert gate.pending_count == replies
    assert held <= REPLY_OVERHEAD
