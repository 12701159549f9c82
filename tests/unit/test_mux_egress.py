"""The egress batcher, sans-IO, on an explicit clock: one test per rule of the chapter."""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

from collections import Counter

import pytest

from velomux_quic.mux.config import AutoFlush, Manual, MuxConfig
from velomux_quic.mux.egress import EgressBatcher, OutgoingBatch
from velomux_quic.mux.protocol import (
    CloseReason,
    RecordType,
    decode_batch,
    slot_generation,
    slot_id,
    slot_index,
)

TOKEN = b"t" * 48


def batcher(**config: object) -> EgressBatcher:
    return EgressBatcher(lane=0, config=MuxConfig(**config))  # type: ignore[arg-type]


def records(batch: OutgoingBatch) -> list[tuple[int, int, int, bytes]]:
    _, recs = decode_batch(batch.payload)
    return [(t, s, q, bytes(b)) for t, s, q, b in recs]


def types(batch: OutgoingBatch) -> list[int]:
    return [r[0] for r in records(batch)]


def opened(b: EgressBatcher, count: int = 1, now: float = 0.0) -> list:  # type: ignore[type-arg]
    slots = [b.open_slot(anchor_id=100 + i, session_id=200 + i) for i in range(count)]
    first = b.poll(now)
    assert [t for batch in first for t in types(batch)] == [RecordType.OPEN_SLOT] * count
    return slots


def test_open_slot_goes_in_a_flush_of_its_own_before_any_data() -> None:
    b = batcher()
    slot = b.open_slot(anchor_id=7, session_id=9)
    b.offer(slot, TOKEN, now=0.0)
    out = b.poll(0.0)
    assert [types(x) for x in out] == [[RecordType.OPEN_SLOT], [RecordType.DATA]]
    ((_, sid, seq, body),) = records(out[0])
    assert (sid, seq) == (slot.slot_id, 0) and body == (7).to_bytes(8, "big") + (9).to_bytes(
        8, "big"
    )
    assert records(out[1])[0][2] == 1  # the first data record is open_seq + 1


def test_on_admission_writes_everything_queued_at_the_end_of_the_wake() -> None:
    b = batcher()
    slots = opened(b, 3)
    for slot in slots:
        b.offer(slot, TOKEN, 0.0)
    (batch,) = b.poll(0.0)
    assert [r[1] for r in records(batch)] == [s.slot_id for s in slots]
    assert b.poll(0.0) == []


def test_credit_withholds_and_a_grant_releases_in_order() -> None:
    b = batcher(initial_credit=2)
    (slot,) = opened(b)
    for i in range(5):
        assert b.offer(slot, bytes([i]), 0.0)
    (first,) = b.poll(0.0)
    assert [r[3] for r in records(first)] == [b"\x00", b"\x01"]
    assert b.poll(0.0) == []  # withheld: no credit
    assert b.stats.credit_exhausted == 1
    assert b.on_credit(slot.slot_id, 3, now=0.0)
    (second,) = b.poll(0.0)
    assert [r[3] for r in records(second)] == [b"\x02", b"\x03", b"\x04"]
    assert [r[2] for r in records(second)] == [3, 4, 5]


def test_terminal_spends_the_reserve_and_its_close_rides_in_the_same_batch() -> None:
    b = batcher(initial_credit=1)
    (slot,) = opened(b)
    b.offer(slot, b"data", 0.0)
    b.offer_terminal(slot, b"FIN", 0.0, guard="guard")
    (batch,) = b.poll(0.0)  # no credit left after the data: the terminal uses the reserve
    recs = records(batch)
    assert [r[0] for r in recs] == [RecordType.DATA, RecordType.DATA, RecordType.CLOSE_SLOT]
    assert [r[2] for r in recs] == [1, 2, 3]
    assert recs[2][3] == bytes([CloseReason.TERMINAL_SENT])
    assert batch.guards == ["guard"]
    assert b.live_slots == 0


def test_freed_index_is_reused_first_with_a_new_generation() -> None:
    b = batcher()
    first, second = opened(b, 2)
    b.offer_terminal(first, b"FIN", 0.0)
    b.poll(0.0)
    third = b.open_slot(anchor_id=1, session_id=2)
    assert slot_index(third.slot_id) == slot_index(first.slot_id)
    assert slot_generation(third.slot_id) == slot_generation(first.slot_id) + 1
    assert b.slot(first.slot_id) is None  # the old id no longer names anything
    assert not b.on_credit(first.slot_id, 5, 0.0)  # retired generation: dropped silently
    assert b.stats.control_refused == 0
    assert not b.on_credit(slot_id(999, 0), 5, 0.0)  # never allocated: refused and counted
    assert b.stats.control_refused == 1
    assert second.live


def test_a_batchs_grants_apply_in_order_and_a_bad_id_is_refused_alone() -> None:
    b = batcher()
    first, second = opened(b, 2)
    before = (first.credit, second.credit)
    b.on_credits([(first.slot_id, 2), (slot_id(999, 0), 5), (second.slot_id, 3)], 0.0)
    assert (first.credit, second.credit) == (before[0] + 2, before[1] + 3)
    assert b.stats.control_refused == 1
    with pytest.raises(ValueError, match="u32"):
        b.slot(-1)


def test_byte_budget_makes_the_producer_wait() -> None:
    b = batcher(slot_byte_budget=100, initial_credit=1)
    (slot,) = opened(b)
    accepted = 0
    while b.offer(slot, b"x" * 40, 0.0):
        accepted += 1
        assert accepted < 10
    assert accepted == 3  # 0, 40, 80 bytes queued before each; 120 >= 100 refuses
    b.poll(0.0)  # one record leaves on the single credit
    assert b.offer(slot, b"x" * 40, 0.0)


def test_manual_writes_only_when_kicked_but_terminals_move_on_their_own() -> None:
    b = batcher(flush_policy=Manual())
    a, c = opened(b, 2)
    b.offer(a, TOKEN, 0.0)
    assert b.poll(10.0) == []  # no timer moves records under Manual
    b.kick()
    (batch,) = b.poll(10.0)
    assert types(batch) == [RecordType.DATA]
    b.offer_terminal(c, b"FIN", 11.0)
    (urgent,) = b.poll(11.0)
    assert types(urgent) == [RecordType.DATA, RecordType.CLOSE_SLOT]


def test_kick_survives_a_clamp() -> None:
    b = batcher(flush_policy=Manual(), max_batch_bytes=1024)
    slots = opened(b, 100)
    for slot in slots:
        b.offer(slot, TOKEN, 0.0)
    b.kick()
    out = b.poll(0.0)
    # One poll packs at most poll_budget bytes; the kick carries over to the next polls
    # (the driver re-polls at once) until everything staged when it was made is written.
    while b.has_ready:
        out += b.poll(0.0)
    assert len(out) >= 6 and sum(x.records for x in out) == 100
    assert all(len(x.payload) <= 1024 for x in out)
    assert b.poll(0.0) == []


def test_a_poll_is_bounded_and_serves_slots_in_rounds() -> None:
    b = batcher(flush_policy=Manual())
    slots = opened(b, 8)
    item = b"\xa4" + b"x" * 16_000  # big items: one per visit (the quantum)
    for slot in slots:
        for _ in range(6):
            b.offer(slot, item, 0.0)
    b.kick()
    first = b.poll(0.0)
    written = sum(len(x.payload) for x in first)
    assert written <= b.poll_budget + b.byte_cap  # bounded (at most one batch over)
    assert b.has_ready
    # Fair: the first poll gave every slot its first item before any slot its second.
    seen: list[int] = []
    for batch in first:
        _, records = decode_batch(batch.payload)
        seen += [slot_index(sid) for kind, sid, _, _ in records if kind == RecordType.DATA]
    assert seen[:8] == list(range(8)), seen
    out = list(first)
    while b.has_ready:
        out += b.poll(0.0)
    per_slot = Counter(
        slot_index(sid)
        for batch in out
        for kind, sid, _, _ in decode_batch(batch.payload)[1]
        if kind == RecordType.DATA
    )
    assert per_slot == dict.fromkeys(range(8), 6)


def test_linger_window_holds_until_the_oldest_record_is_w_old() -> None:
    b = batcher(flush_policy=AutoFlush(on_admission=False, max_linger=0.002))
    (slot,) = opened(b)
    b.offer(slot, TOKEN, now=1.0)
    assert b.next_deadline() == pytest.approx(1.002)
    assert b.poll(1.001) == []
    (batch,) = b.poll(1.002)
    assert types(batch) == [RecordType.DATA]


def test_a_clock_given_for_now_is_read_only_when_a_record_starts_the_linger_window() -> None:
    b = batcher(flush_policy=AutoFlush(on_admission=False, max_linger=0.002))
    a, c = opened(b, 2)
    reads: list[float] = []

    def clock() -> float:
        reads.append(5.0)
        return 5.0

    assert b.offer(a, TOKEN, clock)
    assert b.offer(c, TOKEN, clock)  # the window is open already: no read
    assert b.offer(a, TOKEN, clock)
    assert reads == [5.0]
    assert b.next_deadline() == pytest.approx(5.002)
    (batch,) = b.poll(5.002)
    assert batch.records == 3
    assert b.offer(c, TOKEN, clock)  # a new window after the write
    assert reads == [5.0, 5.0]


def test_on_complete_writes_a_complete_batch_but_not_within_a_window_of_the_last_data() -> None:
    policy = AutoFlush(on_admission=False, max_linger=0.010, on_complete=True)
    b = batcher(flush_policy=policy)
    a, c = opened(b, 2)
    b.offer(a, TOKEN, 0.0)
    assert b.poll(0.001) == []  # incomplete: c has nothing
    b.offer(c, TOKEN, 0.001)
    (batch,) = b.poll(0.001)  # complete, and no data was ever written: goes now
    assert batch.records == 2
    b.offer(a, TOKEN, 0.002)
    b.offer(c, TOKEN, 0.002)
    assert b.poll(0.003) == []  # complete, but within a window of the last data write
    assert len(b.poll(0.0111)) == 1


def test_at_bytes_ends_the_linger_early() -> None:
    b = batcher(flush_policy=AutoFlush(on_admission=False, max_linger=1.0, at_bytes=200))
    slots = opened(b, 5)
    for slot in slots[:3]:
        b.offer(slot, TOKEN, 0.0)
    assert b.poll(0.0) == []
    b.offer(slots[3], TOKEN, 0.0)
    b.offer(slots[4], TOKEN, 0.0)  # 5 x 48 = 240 >= 200
    assert len(b.poll(0.0)) == 1


def test_a_stream_cancelled_while_ready_leaves_the_ready_list() -> None:
    b = batcher(flush_policy=Manual())
    a, c, d = opened(b, 3)
    for slot in (a, c, d):
        b.offer(slot, TOKEN, 0.0)
    b.cancel_slot(c)
    assert b.has_ready
    b.kick()
    (batch,) = b.poll(0.0)
    assert [r[1] for r in records(batch)] == [a.slot_id, d.slot_id]
    assert not b.has_ready
    # Every ready stream gone: nothing is ready, and a new stream on a reused index is
    # packed once.
    b.offer(a, TOKEN, 0.0)
    b.cancel_slot(a)
    assert not b.has_ready
    (e,) = opened(b)
    assert slot_index(e.slot_id) in (slot_index(a.slot_id), slot_index(c.slot_id))
    b.offer(e, TOKEN, 0.0)
    b.offer(e, TOKEN, 0.0)
    b.kick()
    (batch,) = b.poll(0.0)
    assert [r[1] for r in records(batch)] == [e.slot_id, e.slot_id]
    assert b.poll(0.0) == []


def test_on_complete_counts_only_the_ready_streams_still_open() -> None:
    policy = AutoFlush(on_admission=False, max_linger=0.010, on_complete=True)
    b = batcher(flush_policy=policy)
    a, c, d = opened(b, 3)
    b.offer(a, TOKEN, 0.0)
    b.offer(c, TOKEN, 0.0)
    b.cancel_slot(c)  # ready, then gone: two of the two open streams are not ready
    assert b.poll(0.001) == []
    b.offer(d, TOKEN, 0.001)
    (batch,) = b.poll(0.001)
    assert [r[1] for r in records(batch)] == [a.slot_id, d.slot_id]


def test_at_bytes_counts_only_the_ready_streams_still_open() -> None:
    b = batcher(flush_policy=AutoFlush(on_admission=False, max_linger=1.0, at_bytes=200))
    slots = opened(b, 5)
    for slot in slots:
        b.offer(slot, TOKEN, 0.0)  # 5 x 48 = 240 >= 200, but one is cancelled
    b.cancel_slot(slots[0])
    assert b.poll(0.0) == []


def test_a_batch_of_only_credit_replies_waits_out_reply_linger() -> None:
    b = batcher(reply_linger=0.001)
    b.reply_credit(slot_id(3, 1), 5, now=0.0)
    b.reply_credit(slot_id(3, 1), 2, now=0.0)  # coalesced into one u32
    assert b.poll(0.0005) == []
    (batch,) = b.poll(0.001)
    assert records(batch) == [(RecordType.CREDIT_UPDATE, slot_id(3, 1), 0, (7).to_bytes(4, "big"))]


def test_data_ends_the_reply_wait_under_on_admission_and_a_close_supersedes_credit() -> None:
    b = batcher(reply_linger=1.0)
    (slot,) = opened(b)
    b.reply_credit(slot_id(4, 0), 1, 0.0)
    b.reply_credit(slot_id(5, 0), 1, 0.0)
    b.reply_close(slot_id(5, 0), CloseReason.UNKNOWN_SLOT)
    b.offer(slot, TOKEN, 0.0)
    (batch,) = b.poll(0.0)
    assert sorted(types(batch)) == sorted(
        [RecordType.DATA, RecordType.CLOSE_SLOT, RecordType.CREDIT_UPDATE]
    )


class Closes:
    """A slot owner that records how its slot closed."""

    def __init__(self, closed: list[object]) -> None:
        self.closed = closed

    def slot_stopped(self) -> None:
        raise AssertionError("no stop in this test")

    def slot_closed(self, reason: object) -> None:
        self.closed.append(reason)


def test_parked_batcher_writes_nothing_and_epoch_death_closes_every_slot() -> None:
    b = batcher()
    slots = opened(b, 3)
    closed: list[object] = []
    for slot in slots:
        slot.owner = Closes(closed)
        b.offer(slot, TOKEN, 0.0)
    b.parked = True
    assert b.poll(0.0) == []
    epoch, seq = b.epoch, b.batch_seq
    assert b.epoch_death() == 3
    assert closed == [CloseReason.PEER_GONE] * 3
    assert b.live_slots == 0 and b.epoch != epoch and b.batch_seq == 0 and seq > 0
    assert b.poll(0.0) == []


def test_batch_header_carries_lane_epoch_and_sequence() -> None:
    b = EgressBatcher(lane=5, config=MuxConfig())
    b.open_slot(anchor_id=1, session_id=1)
    (batch,) = b.poll(0.0)
    header, _ = decode_batch(batch.payload)
    assert (header.lane, header.peer_epoch, header.batch_seq) == (5, b.epoch, 0)


def test_under_manual_a_terminal_behind_starved_records_leaves_once_credit_returns() -> None:
    b = batcher(flush_policy=Manual(), initial_credit=2)
    (slot,) = opened(b)
    for i in range(4):
        b.offer(slot, bytes([i]), 0.0)
    b.offer_terminal(slot, b"FIN", 0.0)
    (first,) = b.poll(0.0)  # urgent (terminal queued): the two credited records go
    assert first.records == 2
    assert b.poll(1.0) == []  # the rest waits for credit; no flush_batch comes
    b.on_credit(slot.slot_id, 2, 1.0)
    (last,) = b.poll(1.0)  # the terminal's stream ends without another flush_batch
    assert types(last) == [RecordType.DATA, RecordType.DATA, RecordType.DATA, RecordType.CLOSE_SLOT]
