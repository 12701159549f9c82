"""Ingress slot tables, sans-IO, on an explicit clock: one test per rule of the chapter.

Batches go through the real codec (encode, then decode), by default with the decoder a
node's transport uses (``decode_batch_owned``: bodies as bytes); a harness built with
``decoder=decode_batch`` hands the table zero-copy memoryview bodies instead, and the
exactly-once property runs with both.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.credit import IngressSlot, PeerBudget
from velomux_quic.mux.ingress import (
    DROP_REASONS,
    IngressTable,
    InMemoryBindRegistry,
    MuxIngressStats,
    RejectLane,
)
from velomux_quic.mux.protocol import (
    BatchHeader,
    CloseReason,
    EncodableRecord,
    LifecycleAction,
    OwnedRecord,
    Record,
    RecordType,
    close_slot_body,
    credit_body,
    decode_batch,
    decode_batch_owned,
    encode_batch,
    lifecycle_body,
    open_slot_body,
    slot_id,
)
from velomux_quic.streaming.frames import (
    DROPPED,
    FINALIZED,
    FrameKind,
    decode_frame,
    encode_item,
)

# -- harness ------------------------------------------------------------------------------


class Sink:
    """A ReplySink that records what the egress batcher would coalesce."""

    def __init__(self, cap: int = 8_192) -> None:
        self.credits: dict[int, int] = {}
        self.closes: list[tuple[int, CloseReason]] = []
        self.lifecycles: list[tuple[int, LifecycleAction]] = []
        self.rejects = RejectLane(cap)

    def credit(self, slot_id: int, delta: int) -> None:
        assert delta > 0
        self.credits[slot_id] = self.credits.get(slot_id, 0) + delta

    def close(self, slot_id: int, reason: CloseReason) -> None:
        self.closes.append((slot_id, reason))

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        return self.rejects.offer(slot_id, reason)

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        self.lifecycles.append((session, action))

    def take_credit(self, sid: int) -> int:
        return self.credits.pop(sid, 0)


class Control:
    """An EgressControl that records the peer's control about this side's slots."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.credit_calls = 0

    def credits(self, grants: list[tuple[int, int]]) -> None:
        self.credit_calls += 1
        self.events.extend(("credit", slot_id, delta) for slot_id, delta in grants)

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None:
        self.events.append(("closed", slot_id, reason))

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        self.events.append(("lifecycle", session, action))


class Harness:
    def __init__(
        self,
        lane: int = 0,
        reject_cap: int = 8_192,
        *,
        decoder: Callable[[bytes], tuple[BatchHeader, Sequence[Record | OwnedRecord]]] = (
            decode_batch_owned
        ),
        **config: Any,
    ) -> None:
        self.decoder = decoder
        config.setdefault("initial_credit", 4)
        self.config = MuxConfig(**config)
        self.registry = InMemoryBindRegistry()
        self.sink = Sink(reject_cap)
        self.control = Control()
        self.budget = PeerBudget(self.config.peer_byte_budget)
        self.stats = MuxIngressStats()
        self.doorbells = 0
        self.now = 0.0
        """The table's clock: the time of the batch applied last (``send``'s ``now``)."""
        self.table = IngressTable(
            "peer-a",
            lane,
            self.config,
            registry=self.registry,
            replies=self.sink,
            control=self.control,
            peer_budget=self.budget,
            stats=self.stats,
            doorbell=self._ring,
            clock=self._clock,
        )
        self.lane = lane
        self.epoch = 1
        self.batch_seq = 0

    def _ring(self) -> None:
        self.doorbells += 1

    def _clock(self) -> float:
        return self.now

    def bind(self, anchor_id: int, session_id: int) -> IngressSlot:
        slot = IngressSlot(self.config.initial_credit, self.config.slot_byte_budget)
        self.registry.bind(anchor_id, session_id, slot)
        return slot

    def send(
        self,
        records: list[EncodableRecord],
        *,
        now: float = 0.0,
        lane: int | None = None,
        epoch: int | None = None,
        batch_seq: int | None = None,
    ) -> None:
        if batch_seq is None:
            batch_seq = self.batch_seq
            self.batch_seq = (self.batch_seq + 1) & 0xFFFF_FFFF
        header = BatchHeader(
            self.lane if lane is None else lane,
            len(records),
            self.epoch if epoch is None else epoch,
            batch_seq,
        )
        decoded_header, decoded = self.decoder(encode_batch(header, records))
        self.now = now
        self.table.handle_batch(decoded_header, decoded, now)

    def open(self, index: int, generation: int = 0, *, now: float = 0.0) -> tuple[int, IngressSlot]:
        """Bind and open one slot; returns its id and buffer."""
        sid = slot_id(index, generation)
        slot = self.bind(1000 + index, 2000 + index * 256 + generation)
        self.send([opening(sid, 1000 + index, 2000 + index * 256 + generation)], now=now)
        assert self.table.slot(sid) is slot
        return sid, slot


def opening(sid: int, anchor_id: int, session_id: int, seq: int = 0) -> EncodableRecord:
    return (RecordType.OPEN_SLOT, sid, seq, open_slot_body(anchor_id, session_id))


def data(sid: int, seq: int, value: object = None) -> EncodableRecord:
    return (RecordType.DATA, sid, seq, encode_item(seq if value is None else value))


def terminal(sid: int, seq: int, body: bytes = FINALIZED) -> EncodableRecord:
    return (RecordType.DATA, sid, seq, body)


def close(sid: int, seq: int, reason: CloseReason = CloseReason.TERMINAL_SENT) -> EncodableRecord:
    return (RecordType.CLOSE_SLOT, sid, seq, close_slot_body(reason))


def heartbeat(sid: int, seq: int) -> EncodableRecord:
    return (RecordType.SLOT_HEARTBEAT, sid, seq, b"")


def read(slot: IngressSlot) -> list[object]:
    """Everything readable now: item values, and the names of the other frames."""
    out: list[object] = []
    while (body := slot.take()) is not None:
        kind, value = decode_frame(body)
        out.append(value if kind is FrameKind.ITEM else kind.name)
    return out


def drops(stats: MuxIngressStats) -> dict[str, int]:
    return {reason: n for reason, n in stats.drops.items() if n}


# -- opening and delivery ------------------------------------------------------------------


def test_open_claims_the_bind_and_data_is_delivered_in_order() -> None:
    h = Harness()
    sid, slot = h.open(3, now=1.0)
    assert slot.opened and slot.last_arrival == 1.0 and h.stats.live_slots == 1
    h.send([data(sid, 1, "a"), data(sid, 2, "b")], now=2.0)
    assert read(slot) == ["a", "b"] and slot.last_arrival == 2.0
    assert len(h.registry) == 0 and not drops(h.stats)


def test_open_slot_sends_no_credit_on_the_claim() -> None:
    h = Harness()
    _, slot = h.open(0)
    assert h.sink.credits == {} and slot.outstanding_credit == h.config.initial_credit


def test_open_slot_for_an_unknown_bind_replies_unknown_slot_and_drops_its_records() -> None:
    h = Harness()
    sid = slot_id(5, 1)
    h.send([opening(sid, 77, 88), data(sid, 1)])
    assert h.sink.rejects.drain() == [(sid, CloseReason.UNKNOWN_SLOT)]
    assert h.table.slot(sid) is None and h.stats.live_slots == 0
    assert drops(h.stats) == {"unknown_slot": 1}


def test_open_slot_past_the_table_size_is_rejected() -> None:
    h = Harness(max_slots_per_table=8)
    h.bind(1, 2)
    h.send([opening(slot_id(8, 0), 1, 2)])
    assert h.sink.rejects.drain() == [(slot_id(8, 0), CloseReason.PROTOCOL_ERROR)]
    assert h.stats.slot_limit == 1 and len(h.registry) == 1


def test_a_bind_that_names_its_peer_is_not_claimed_by_another() -> None:
    registry = InMemoryBindRegistry()
    slot = IngressSlot(4, 1 << 20)
    registry.bind(1, 2, slot, peer="peer-b")
    assert registry.claim("peer-a", 0, 1, 2) is None
    assert registry.claim("peer-b", 3, 1, 2) is slot  # any lane: lanes are a placement hint
    assert registry.claim("peer-b", 0, 1, 2) is None


def test_data_overtaking_its_open_slot_is_dropped_as_closed_slot() -> None:
    h = Harness()
    h.send([data(slot_id(1, 0), 1)])
    assert drops(h.stats) == {"closed_slot": 1}


# -- credit --------------------------------------------------------------------------------


def test_c_records_then_credit_exhaustion_closes_only_that_slot() -> None:
    h = Harness(initial_credit=4)
    a, slot_a = h.open(0)
    b, slot_b = h.open(1)
    h.send([data(a, seq) for seq in range(1, 5)] + [data(b, 1)])
    assert slot_a.outstanding_credit == 0 and not slot_a.sender_has_credit
    # The fifth data record without a grant is a protocol violation.
    h.send([data(a, 5), data(b, 2)])
    assert h.sink.closes == [(a, CloseReason.PROTOCOL_ERROR)]
    assert h.stats.protocol_errors == 1 and h.table.slot(a) is None
    got = read(slot_a)
    assert got[:4] == [1, 2, 3, 4] and got[4] == "TRANSPORT_ERROR" and slot_a.exhausted
    # Every other slot continues.
    h.send([data(b, 3), data(a, 6)])
    assert read(slot_b) == [1, 2, 3] and h.table.slot(b) is slot_b
    assert drops(h.stats) == {"closed_slot": 1}


def test_a_grant_lets_the_sender_go_past_c() -> None:
    h = Harness(initial_credit=2)
    sid, slot = h.open(0)
    h.send([data(sid, 1), data(sid, 2)])
    assert read(slot) == [1, 2]
    h.send([])  # the arrival path reconciles what the consumer drained
    assert h.sink.take_credit(sid) == 2
    h.send([data(sid, 3), data(sid, 4)])
    assert read(slot) == [3, 4] and not h.sink.closes


def test_the_terminal_spends_the_reserved_credit() -> None:
    h = Harness(initial_credit=2)
    sid, slot = h.open(0)
    h.send([data(sid, 1), data(sid, 2), terminal(sid, 3), close(sid, 4)])
    assert read(slot) == [1, 2, "FINALIZED"] and slot.exhausted
    assert not h.sink.closes and h.stats.live_slots == 0 and not drops(h.stats)


def test_a_reader_stall_is_counted_and_closes_the_slot() -> None:
    h = Harness(initial_credit=2)
    sid, slot = h.open(0)
    slot.granted += 5  # a broken account: more credit than the buffer can hold
    h.send([data(sid, seq) for seq in range(1, 4)])
    assert h.stats.reader_stall == 1
    assert h.sink.closes == [(sid, CloseReason.PROTOCOL_ERROR)]
    assert read(slot) == [1, 2, "TRANSPORT_ERROR"]


# -- sequence: duplicates, the hold, deferred closes ---------------------------------------


def test_a_record_below_the_expected_sequence_is_a_duplicate() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1), data(sid, 2)])
    h.send([data(sid, 2), data(sid, 1), opening(sid, 1, 2)])
    assert read(slot) == [1, 2]
    assert drops(h.stats) == {"duplicate": 2, "slot_collision": 1}


def test_records_out_of_order_are_held_and_delivered_in_order() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 3), data(sid, 2)], now=5.0)
    assert read(slot) == [] and slot.gap_waiting and slot.held_records == 2
    assert h.stats.held_records == 2 and slot.last_arrival == 0.0  # held: not an arrival
    assert slot.held_data == 2 and slot.outstanding_credit == 2
    h.send([data(sid, 3), data(sid, 1)], now=6.0)  # a duplicate in the hold, then the gap
    assert read(slot) == [1, 2, 3] and not slot.gap_waiting and slot.last_arrival == 6.0
    assert h.stats.held_records == 0 and h.budget.used == 0
    assert drops(h.stats) == {"duplicate": 1}


def test_a_close_ahead_of_its_turn_waits_for_the_hold_to_drain() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([close(sid, 4), terminal(sid, 3), data(sid, 2)])
    assert read(slot) == [] and h.table.slot(sid) is slot and slot.gap_waiting
    h.send([data(sid, 1)])
    assert read(slot) == [1, 2, "FINALIZED"] and slot.exhausted and h.table.slot(sid) is None
    assert not drops(h.stats) and h.stats.live_slots == 0


def test_hold_overflow_closes_that_slot_with_dropped_and_others_continue() -> None:
    h = Harness(slot_byte_budget=100)
    a, slot_a = h.open(0)
    b, slot_b = h.open(1)
    big = "x" * 60
    h.send([data(a, 2, big), data(b, 1)])
    h.send([data(a, 3, big), data(b, 2)])  # 2 x ~66 bytes held: past 100
    assert h.stats.hold_overflow == 1 and h.sink.closes == [(a, CloseReason.PROTOCOL_ERROR)]
    assert read(slot_a) == ["DROPPED"] and slot_a.exhausted
    assert h.stats.held_records == 0 and h.budget.used == len(encode_item(1)) * 2
    assert read(slot_b) == [1, 2]
    h.send([data(a, 1)])
    assert drops(h.stats) == {"closed_slot": 1}


def test_the_peer_budget_bounds_the_hold_across_lanes() -> None:
    h = Harness(peer_byte_budget=200)
    sid, slot = h.open(0)
    h.budget.used = 150  # another lane of this peer holds most of the budget
    h.send([data(sid, 2, "y" * 60)])
    assert h.stats.hold_overflow == 1 and read(slot) == ["DROPPED"]
    assert h.budget.used == 150


def test_a_held_record_beyond_credit_is_a_protocol_violation() -> None:
    h = Harness(initial_credit=2)
    sid, slot = h.open(0)
    h.send([data(sid, 2), data(sid, 3), data(sid, 4)])
    assert h.sink.closes == [(sid, CloseReason.PROTOCOL_ERROR)]
    assert read(slot) == ["TRANSPORT_ERROR"] and h.stats.held_records == 0


def test_a_heartbeat_counts_as_an_arrival_only_in_its_turn() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([heartbeat(sid, 2)], now=3.0)
    assert slot.last_arrival == 0.0 and slot.held_records == 1
    h.send([heartbeat(sid, 1)], now=4.0)
    assert slot.last_arrival == 4.0 and slot.held_records == 0 and read(slot) == []
    h.send([data(sid, 3)])
    assert read(slot) == [3]


# -- slot ids: generation, collision, the aside -------------------------------------------


def test_a_record_for_another_generation_is_dropped_and_counted() -> None:
    h = Harness()
    sid, slot = h.open(4, generation=7)
    h.send([data(slot_id(4, 6), 1), data(sid, 1)])
    assert read(slot) == [1]
    assert drops(h.stats) == {"generation": 1} and h.stats.generation_mismatch == 1


def test_open_slot_over_a_live_slot_is_a_collision_and_the_old_slot_is_left_alone() -> None:
    h = Harness()
    old, slot = h.open(2, generation=1)
    new = slot_id(2, 2)
    h.bind(50, 60)
    h.send([opening(new, 50, 60), data(new, 1), data(old, 1)])
    assert h.sink.rejects.drain() == [(new, CloseReason.PROTOCOL_ERROR)]
    assert drops(h.stats) == {"slot_collision": 1, "unknown_slot": 1}
    assert read(slot) == [1] and h.table.slot(old) is slot and len(h.registry) == 1


def test_an_open_slot_over_a_slot_its_consumer_let_go_takes_the_index_before_the_visit() -> None:
    """A consumer's cancel frees the sender's index at once (it sends no close of its own),
    and this table retires the slot only at its next visit, which a floor may hold back:
    the sender's next stream on that index is admitted, not refused for the other's cancel."""
    h = Harness(drain_visit_floor=10.0)
    old, old_slot = h.open(2, generation=1)
    h.send([data(old, 1)])
    assert read(old_slot) == [1]
    h.table.visit_dirty(0.0)  # the visit the floor now holds back for 10 s
    old_slot.withdraw()  # the anchor was cancelled: LifecycleSlot cancel to the sender
    new, new_slot = h.open(2, generation=2)
    h.send([data(new, 1, "next stream"), data(old, 2, "late")])
    assert read(new_slot) == ["next stream"] and h.table.slot(new) is new_slot
    assert h.table.slot(old) is None and h.stats.live_slots == 1
    assert not h.sink.closes and not h.sink.rejects.drain()
    assert drops(h.stats) == {"generation": 1}  # the old stream's late record, not a collision


def test_a_closed_slot_waiting_on_a_gap_moves_aside_for_the_next_stream() -> None:
    h = Harness()
    old, old_slot = h.open(2, generation=1)
    # The old stream's record 1 is a rendezvous singleton still in flight; its terminal
    # and close are here, so the sender freed the index and reuses it at once.
    h.send([terminal(old, 2), close(old, 3)])
    new, new_slot = h.open(2, generation=2)
    assert h.table.slot(old) is old_slot and h.stats.live_slots == 2
    h.send([data(new, 1, "new")])
    h.send([data(old, 1, "old")])  # the singleton resolves
    assert read(old_slot) == ["old", "FINALIZED"] and old_slot.exhausted
    assert read(new_slot) == ["new"] and h.table.slot(old) is None
    assert h.stats.live_slots == 1 and not drops(h.stats)


@pytest.mark.parametrize("middle_closed", [True, False])
def test_a_wrapped_generation_over_an_aside_slot_fails_both(middle_closed: bool) -> None:
    h = Harness()
    old, old_slot = h.open(2, generation=1)
    h.send([terminal(old, 2), close(old, 3)])
    middle, _ = h.open(2, generation=2)
    if middle_closed:
        h.send([terminal(middle, 1), close(middle, 2)])
    h.bind(70, 80)
    h.send([opening(old, 70, 80), data(old, 1, "new stream")])  # 256 streams on: the same id
    assert h.sink.rejects.drain() == [(old, CloseReason.PROTOCOL_ERROR)]
    assert read(old_slot) == ["DROPPED"] and h.table.slot(old) is None
    assert drops(h.stats) == {"slot_collision": 1, "unknown_slot": 1}
    assert len(h.registry) == 1  # the new stream's bind was not claimed


# -- closes by reason ---------------------------------------------------------------------


def test_terminal_sent_closes_the_buffer_after_the_terminal_is_read() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1), terminal(sid, 2), close(sid, 3)])
    assert not slot.exhausted
    assert read(slot) == [1, "FINALIZED"] and slot.exhausted
    h.send([data(sid, 4)])
    assert drops(h.stats) == {"closed_slot": 1}


def test_peer_gone_injects_dropped_after_the_records_that_arrived() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1), close(sid, 2, CloseReason.PEER_GONE)])
    assert read(slot) == [1, "DROPPED"] and slot.exhausted and h.stats.live_slots == 0


def test_terminal_sent_without_a_terminal_still_ends_with_dropped() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1), close(sid, 2)])
    assert read(slot) == [1, "DROPPED"]


def test_data_after_the_terminal_is_dropped() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([terminal(sid, 1), data(sid, 2), close(sid, 3)])
    assert read(slot) == ["FINALIZED"] and drops(h.stats) == {"closed_slot": 1}


def test_closes_about_this_sides_slots_go_to_egress_control() -> None:
    h = Harness()
    ours = slot_id(9, 3)
    h.send(
        [
            close(ours, 0, CloseReason.UNKNOWN_SLOT),
            close(ours, 0, CloseReason.PROTOCOL_ERROR),
            (RecordType.CREDIT_UPDATE, ours, 0, credit_body(12)),
            (RecordType.LIFECYCLE_SLOT, 0, 0, lifecycle_body(555, LifecycleAction.CANCEL)),
        ]
    )
    assert h.control.events == [
        ("closed", ours, CloseReason.UNKNOWN_SLOT),
        ("closed", ours, CloseReason.PROTOCOL_ERROR),
        ("credit", ours, 12),
        ("lifecycle", 555, LifecycleAction.CANCEL),
    ]
    assert not drops(h.stats)


def test_a_batchs_credit_updates_reach_egress_control_together_and_in_order() -> None:
    h = Harness()
    first, second = slot_id(9, 3), slot_id(10, 1)
    h.send(
        [
            (RecordType.CREDIT_UPDATE, first, 0, credit_body(1)),
            (RecordType.CREDIT_UPDATE, second, 0, credit_body(2)),
            close(first, 0, CloseReason.UNKNOWN_SLOT),
            (RecordType.CREDIT_UPDATE, second, 0, credit_body(3)),
        ]
    )
    assert h.control.events == [
        ("credit", first, 1),
        ("credit", second, 2),
        ("closed", first, CloseReason.UNKNOWN_SLOT),
        ("credit", second, 3),
    ]
    assert h.control.credit_calls == 2  # the grants before the close together, then the last


# -- epochs, lanes, batch_seq --------------------------------------------------------------


def test_a_stale_epoch_is_discarded_by_its_header() -> None:
    h = Harness()
    h.epoch = 5
    sid, slot = h.open(0)
    h.send([data(sid, 1), (RecordType.CREDIT_UPDATE, 1, 0, credit_body(1))], epoch=4)
    assert read(slot) == [] and h.control.events == []
    assert drops(h.stats) == {"stale_epoch": 2}


def test_a_new_epoch_retires_every_old_slot_with_dropped() -> None:
    h = Harness()
    a, slot_a = h.open(0)
    b, slot_b = h.open(1)
    c, slot_c = h.open(2)
    h.send([data(a, 1), data(b, 2), terminal(c, 1)])
    h.epoch = 2
    h.bind(9, 9)
    h.send([opening(slot_id(0, 0), 9, 9)])
    assert read(slot_a) == [1, "DROPPED"]
    assert read(slot_b) == ["DROPPED"]  # its held record is discarded with it
    assert read(slot_c) == ["FINALIZED"]  # it saw its terminal: no Dropped
    assert h.stats.live_slots == 1 and h.stats.held_records == 0 and h.budget.used == 0
    assert not h.sink.closes


def test_a_batch_on_the_wrong_lane_is_dropped_whole_without_touching_the_epoch() -> None:
    h = Harness(lane=0)
    sid, slot = h.open(0)
    h.send([data(sid, 1), data(sid, 2)], lane=1, epoch=9)
    assert drops(h.stats) == {"lane_mismatch": 2}
    assert h.table.epoch == 1 and h.table.slot(sid) is slot and read(slot) == []


@pytest.mark.parametrize(
    ("sequence", "gaps"),
    [
        ([0, 1, 2], 0),
        ([0, 1, 3], 1),
        ([0, 4, 2, 3, 5], 3),  # an inverted pair counts once
        ([0xFFFF_FFFE, 0xFFFF_FFFF, 0, 1], 0),  # the wrap is no gap
        ([0xFFFF_FFFE, 1], 2),
        ([7, 8], 0),  # a table that meets an epoch mid-way counts from there
    ],
)
def test_batch_seq_gaps_are_metered_against_a_high_water_mark(
    sequence: list[int], gaps: int
) -> None:
    h = Harness()
    for seq in sequence:
        h.send([], batch_seq=seq)
    assert h.stats.batch_seq_gaps == gaps and h.stats.batches_received == len(sequence)


def test_a_new_epoch_restarts_the_high_water_mark() -> None:
    h = Harness()
    h.send([], batch_seq=100)
    h.send([], batch_seq=0, epoch=2)
    h.send([], batch_seq=1, epoch=2)
    assert h.stats.batch_seq_gaps == 0


# -- the reject lane ----------------------------------------------------------------------


def test_the_reject_lane_is_capped_and_overflow_counts_as_control_refused() -> None:
    h = Harness()
    cap = h.config.reject_lane_cap
    assert cap == 8_192
    h.send([opening(slot_id(i, 0), 1, i) for i in range(cap + 5)])
    assert len(h.sink.rejects) == cap and h.stats.control_refused == 5
    assert h.sink.rejects.offer(slot_id(0, 0), CloseReason.UNKNOWN_SLOT)  # same key: in place


# -- credit return paths ------------------------------------------------------------------


def test_the_arrival_path_returns_drained_credit_on_the_next_batch() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1), data(sid, 2)])
    assert h.sink.credits == {}
    assert read(slot) == [1, 2] and h.doorbells == 1  # only the first drain rang
    h.send([heartbeat(sid, 3)])
    assert h.sink.take_credit(sid) == 2 and h.stats.drain_visits == 0


def test_the_doorbell_visit_is_limited_to_one_per_floor() -> None:
    h = Harness(drain_visit_floor=0.002)
    sid, slot = h.open(0)
    h.send([data(sid, 1), data(sid, 2)])
    slot.take()
    assert h.table.visit_dirty(10.0) and h.sink.take_credit(sid) == 1
    slot.take()
    assert not h.table.visit_dirty(10.001) and h.table.next_visit_at == pytest.approx(10.002)
    assert h.sink.credits == {}
    assert h.table.visit_dirty(10.002) and h.sink.take_credit(sid) == 1
    assert not h.table.visit_dirty(20.0)  # nothing listed: no visit counted
    assert h.stats.drain_visits == 2


def test_the_sweep_is_skipped_while_no_slot_is_live_and_walks_every_slot_otherwise() -> None:
    h = Harness()
    assert h.table.sweep(0.0) == 0
    a, slot_a = h.open(0)
    h.open(1)
    h.send([data(a, 1)])
    slot_a.take()
    h.table.dirty.drain()  # a lost listing: only the walk can find this credit now
    assert h.table.sweep(1.0) == 2 and h.sink.take_credit(a) == 1


def test_credit_is_withheld_while_the_slot_is_over_its_byte_budget() -> None:
    h = Harness(initial_credit=4, slot_byte_budget=100)
    sid, slot = h.open(0)
    big = "z" * 60
    h.send([data(sid, seq, big) for seq in range(1, 4)])  # about 198 bytes buffered
    slot.take()
    h.send([])
    assert h.sink.credits == {} and slot.withheld_credit == 1
    slot.take()
    slot.take()
    h.table.sweep(1.0)
    assert h.sink.take_credit(sid) == 3 and slot.withheld_credit == 0


def test_a_withdrawn_feed_tells_the_sender_unknown_slot() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1)])
    slot.withdraw()
    assert slot.exhausted and h.budget.used == 0
    assert h.table.visit_dirty(1.0)
    assert h.sink.closes == [(sid, CloseReason.UNKNOWN_SLOT)] and h.table.slot(sid) is None
    assert h.stats.live_slots == 0


def test_a_withdrawn_slots_sender_that_goes_on_sending_is_told_again() -> None:
    """The close that followed the withdrawal may be lost with its connection (the sender
    was stopped past the idle timeout): a record that comes once the close's backoff has
    passed gets the answer again, on the reject lane; records inside it do not."""
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1)])
    slot.withdraw()
    assert h.table.visit_dirty(1.0)
    assert h.sink.closes == [(sid, CloseReason.UNKNOWN_SLOT)]
    h.send([data(sid, 2)], now=0.5)  # the close may still be on its way
    assert h.sink.rejects.drain() == []
    h.send([data(sid, 3), data(sid, 4)], now=1.0)
    assert h.sink.rejects.drain() == [(sid, CloseReason.UNKNOWN_SLOT)]
    assert drops(h.stats) == {"unknown_slot": 3}
    assert h.stats.drop_notices == {"answered": 1, "limited": 2}


def test_a_record_after_its_owners_close_is_dropped_and_answered_harmlessly() -> None:
    """The table does not remember every close, so it cannot tell this record from one
    whose OpenSlot was lost; its answer names a generation the sender has retired, which
    the sender's batcher drops."""
    h = Harness()
    sid, slot = h.open(0)
    h.send([terminal(sid, 1), close(sid, 2)])
    assert read(slot) == ["FINALIZED"]
    h.send([data(sid, 3)])
    assert h.sink.rejects.drain() == [(sid, CloseReason.UNKNOWN_SLOT)] and h.sink.closes == []
    assert drops(h.stats) == {"closed_slot": 1}


def test_a_new_stream_on_a_withdrawn_index_is_not_answered_for_the_old_one() -> None:
    h = Harness()
    sid, slot = h.open(0)
    slot.withdraw()
    assert h.table.visit_dirty(1.0)
    newer, _ = h.open(0, generation=1)
    h.send([data(sid, 2)])
    assert h.sink.rejects.drain() == []
    assert newer != sid


def test_a_feed_withdrawn_after_its_terminal_sends_no_close() -> None:
    h = Harness()
    sid, slot = h.open(0)
    h.send([terminal(sid, 1), close(sid, 2)])
    assert read(slot) == ["FINALIZED"]
    slot.withdraw()
    h.table.sweep(1.0)
    h.table.visit_dirty(1.0)
    assert h.sink.closes == []


def test_retire_all_returns_live_slots_to_zero() -> None:
    h = Harness()
    _, slot = h.open(0)
    h.open(1)
    assert h.table.retire_all() == 2 and h.stats.live_slots == 0
    assert read(slot) == ["DROPPED"]


def test_every_drop_reason_is_exported() -> None:
    assert set(MuxIngressStats().drops) == set(DROP_REASONS)
    assert "lane_mismatch" in DROP_REASONS and "withheld_overflow" in DROP_REASONS


# -- the property: every record exactly once, in order -------------------------------------


class _Stream:
    """A producer slot that obeys credit and the egress rules (terminal + close atomic)."""

    def __init__(self, sid: int, count: int, credit: int) -> None:
        self.sid = sid
        self.count = count
        self.credit = credit
        self.next_value = 0
        self.seq = 1
        self.done = False

    def pull(self, limit: int) -> list[EncodableRecord]:
        out: list[EncodableRecord] = []
        while not self.done and len(out) < limit:
            if self.next_value < self.count:
                if self.credit <= 0:
                    break
                self.credit -= 1
                out.append(data(self.sid, self.seq, [self.sid >> 8, self.next_value]))
                self.next_value += 1
                self.seq += 1
            else:
                out.append(terminal(self.sid, self.seq))
                out.append(close(self.sid, self.seq + 1))
                self.done = True
        return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    credit=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    owned=st.booleans(),
)
def test_every_record_is_delivered_exactly_once_and_in_order(
    counts: list[int], credit: int, seed: int, owned: bool
) -> None:
    """Legal reorderings: batches on one (peer, lane) arrive in order, and each slot's
    records keep their order inside a batch, but records of different slots interleave
    freely. On top of that a record may be a rendezvous singleton, which resolves outside
    the ordered lane and so arrives up to a few batches late (at most one per slot at a
    time: the egress fence). The consumer reads at random points; credit comes back by
    every path."""
    rnd = random.Random(seed)
    h = Harness(initial_credit=credit, decoder=decode_batch_owned if owned else decode_batch)
    streams: list[_Stream] = []
    slots: list[IngressSlot] = []
    opens: list[EncodableRecord] = []
    for index, count in enumerate(counts):
        sid = slot_id(index, index % 256)
        slots.append(h.bind(10 + index, 20 + index))
        opens.append(opening(sid, 10 + index, 20 + index))
        streams.append(_Stream(sid, count, credit))
    h.send(opens)
    got: list[list[object]] = [[] for _ in counts]
    in_flight: list[tuple[int, EncodableRecord]] = []  # (batches to wait, singleton)
    fenced: set[int] = set()
    now = 0.0
    for _ in range(2_000):
        if all(s.done for s in streams) and not in_flight:
            break
        now += 0.001
        # One batch: each slot's records in order, interleaved at random across slots.
        queues = [s.pull(rnd.randint(0, 3)) for s in streams]
        batch: list[EncodableRecord] = []
        while any(queues):
            queue = rnd.choice([q for q in queues if q])
            record = queue.pop(0)
            sid = record[1]
            if record[0] == RecordType.DATA and sid not in fenced and rnd.random() < 0.2:
                fenced.add(sid)
                in_flight.append((rnd.randint(0, 3), record))
                continue
            batch.append(record)
        still: list[tuple[int, EncodableRecord]] = []
        for wait, record in in_flight:
            if wait <= 0:
                batch.append(record)
                fenced.discard(record[1])
            else:
                still.append((wait - 1, record))
        in_flight = still
        h.send(batch, now=now)
        # The consumer reads some slots, and credit returns by one of the paths.
        for index, slot in enumerate(slots):
            if rnd.random() < 0.6:
                got[index].extend(read(slot))
        path = rnd.random()
        if path < 0.3:
            h.table.visit_dirty(now)
        elif path < 0.4:
            h.table.sweep(now)
        for stream in streams:
            stream.credit += h.sink.take_credit(stream.sid)
        assert not h.sink.closes
    assert all(s.done for s in streams) and not in_flight
    for index, slot in enumerate(slots):
        got[index].extend(read(slot))
        assert got[index] == [[index, n] for n in range(counts[index])] + ["FINALIZED"]
        assert slot.exhausted
    assert not drops(h.stats) and h.stats.live_slots == 0
    assert h.stats.held_records == 0 and h.budget.used == 0 and h.stats.reader_stall == 0


def test_the_dropped_sentinel_is_the_streaming_one() -> None:
    # Ingress injects exactly the bytes the per-stream path uses, so one decoder reads both.
    assert decode_frame(DROPPED) == (FrameKind.DROPPED, None)


def test_a_withdrawn_slot_that_the_sender_already_closed_gets_no_close() -> None:
    h = Harness()
    old, old_slot = h.open(2, generation=1)
    h.send([terminal(old, 2), close(old, 3)])
    h.open(2, generation=2)  # the old slot waits aside for its record 1
    old_slot.withdraw()
    h.send([data(old, 1)])
    assert h.sink.closes == [] and h.table.slot(old) is None and h.stats.live_slots == 1
