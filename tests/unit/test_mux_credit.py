"""Receive-side credit: the dirty set, the slot buffer, byte budgets, and the rule that the
three credit-return paths together grant exactly what the consumer took."""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.credit import DirtySet, IngressSlot, PeerBudget
from velomux_quic.mux.ingress import IngressTable, InMemoryBindRegistry, RejectLane
from velomux_quic.mux.protocol import (
    BatchHeader,
    CloseReason,
    LifecycleAction,
    RecordType,
    decode_batch,
    encode_batch,
    open_slot_body,
    slot_id,
)
from velomux_quic.streaming.frames import DROPPED, FINALIZED, encode_item

from .twins import each_twin

credit_twin = each_twin("velomux_quic.mux.credit", "IngressSlot", "DirtySet", "PeerBudget")
"""The slot, dirty-set and budget tests run against both twins of the record path."""

ITEM = encode_item("token")


def opened(credit: int = 4, budget: int = 1 << 20, peer: PeerBudget | None = None) -> IngressSlot:
    slot = IngressSlot(credit, budget)
    slot.open(slot_id(3, 1), DirtySet(64), peer, now=0.0)
    return slot


# -- DirtySet -----------------------------------------------------------------------------


@pytest.mark.usefixtures("credit_twin")
def test_only_the_mark_that_sets_the_bit_rings_the_doorbell() -> None:
    rings: list[int] = []
    dirty = DirtySet(65_536, lambda: rings.append(1))
    assert dirty.mark(65_535) and not dirty.mark(65_535) and dirty.mark(0)
    assert len(rings) == 2 and 65_535 in dirty and 1 not in dirty and len(dirty) == 2
    assert sorted(dirty.drain()) == [0, 65_535]
    assert dirty.drain() == [] and 65_535 not in dirty
    assert dirty.mark(65_535) and len(rings) == 3  # cleared: the next drain rings again


@pytest.mark.usefixtures("credit_twin")
def test_neighbouring_indices_share_a_byte_without_losing_a_mark() -> None:
    dirty = DirtySet(16)
    for index in (8, 9, 15):
        assert dirty.mark(index)
    assert sorted(dirty.drain()) == [8, 9, 15]
    assert all(index not in dirty for index in range(16))


@pytest.mark.usefixtures("credit_twin")
def test_a_repeated_mark_allocates_nothing() -> None:
    dirty = DirtySet(65_536)
    dirty.mark(60_000)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(1_000):
            dirty.mark(60_000)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 1_024  # snapshot bookkeeping only, nothing per mark


# -- the slot buffer ----------------------------------------------------------------------


@pytest.mark.usefixtures("credit_twin")
def test_the_buffer_holds_c_data_records_and_one_terminal() -> None:
    slot = opened(credit=2)
    assert slot.capacity == 3
    assert slot.deliver(ITEM) and slot.deliver(ITEM)
    assert not slot.deliver(ITEM)  # no room: a reader stall
    assert slot.deliver_terminal(FINALIZED) and not slot.deliver_terminal(FINALIZED)
    assert len(slot) == 3 and slot.terminal


@pytest.mark.usefixtures("credit_twin")
def test_take_counts_each_data_record_once_and_reconcile_swaps_it_to_zero() -> None:
    rings: list[int] = []
    slot = IngressSlot(4, 1 << 20)
    slot.open(slot_id(5, 0), DirtySet(64, lambda: rings.append(1)), None, now=0.0)
    for _ in range(3):
        slot.deliver(ITEM)
    assert slot.take() == ITEM and slot.take() == ITEM
    assert slot.drained == 2 and len(rings) == 1
    assert slot.reconcile() == 2 and slot.reconcile() == 0  # a redundant visit grants 0
    assert slot.granted == 6 and slot.outstanding_credit == 3


@pytest.mark.usefixtures("credit_twin")
def test_a_low_return_mark_batches_grants_until_the_sender_runs_low() -> None:
    rings: list[int] = []
    dirty = DirtySet(64, lambda: rings.append(1))
    slot = IngressSlot(8, 1 << 20, return_below=4)
    slot.open(slot_id(3, 0), dirty, None, now=0.0)
    for _ in range(4):  # the sender still holds 4 credits: nothing to return yet
        slot.deliver(ITEM)
        assert slot.take() == ITEM
        assert slot.reconcile() == 0
    assert rings == [] and len(dirty) == 0  # no visit was needed either
    assert slot.outstanding_credit == 4 and slot.withheld_credit == 4
    slot.deliver(ITEM)  # now it holds 3 < 4: the drain names the slot and the grant goes
    assert slot.take() == ITEM
    assert rings == [1] and dirty.drain() == [3]
    assert slot.reconcile() == 5 and slot.outstanding_credit == 8
    assert slot.reconcile() == 0


@pytest.mark.usefixtures("credit_twin")
def test_the_terminal_returns_no_credit() -> None:
    slot = opened()
    slot.deliver(ITEM)
    slot.deliver_terminal(FINALIZED)
    assert slot.take() == ITEM and slot.take() == FINALIZED and slot.take() is None
    assert slot.drained == 1 and slot.reconcile() == 0  # the stream ended: nothing to grant


@pytest.mark.usefixtures("credit_twin")
def test_end_injects_dropped_after_the_data_unless_a_terminal_came() -> None:
    slot = opened()
    slot.deliver(ITEM)
    slot.end(DROPPED)
    assert not slot.exhausted
    assert [slot.take(), slot.take(), slot.take()] == [ITEM, DROPPED, None]
    assert slot.exhausted

    ended = opened()
    ended.deliver_terminal(FINALIZED)
    ended.end(DROPPED)
    assert [ended.take(), ended.take()] == [FINALIZED, None] and ended.exhausted


@pytest.mark.usefixtures("credit_twin")
def test_the_injected_sentinel_fits_even_a_full_buffer() -> None:
    slot = opened(credit=2)
    slot.deliver(ITEM)
    slot.deliver(ITEM)
    slot.end(DROPPED)
    assert len(slot) == 3 and not slot.deliver(ITEM)


@pytest.mark.usefixtures("credit_twin")
def test_bytes_are_charged_to_the_slot_and_the_peer_and_freed_on_take_and_withdraw() -> None:
    peer = PeerBudget(1_000)
    a = opened(peer=peer)
    b = opened(peer=peer)
    a.deliver(b"x" * 100)
    b.deliver(b"y" * 50)
    b.deliver(b"z" * 50)
    assert peer.used == 200 and a.bytes_buffered == 100 and b.bytes_buffered == 100
    a.take()
    assert peer.used == 100 and a.bytes_buffered == 0
    b.withdraw()
    assert peer.used == 0 and b.take() is None and b.exhausted


@pytest.mark.usefixtures("credit_twin")
def test_a_grant_is_withheld_while_the_slot_is_over_its_byte_budget() -> None:
    slot = opened(credit=4, budget=100)
    for _ in range(3):
        slot.deliver(b"b" * 60)
    slot.take()
    assert slot.reconcile() == 0 and slot.withheld_credit == 1  # 120 bytes still buffered
    slot.take()
    assert slot.reconcile() == 2 and slot.withheld_credit == 0  # 60: under, all of it goes
    assert slot.reconcile() == 0


@pytest.mark.usefixtures("credit_twin")
def test_held_bytes_count_against_the_watermark() -> None:
    slot = opened(credit=4, budget=100)
    slot.deliver(b"b" * 10)
    slot.take()
    slot.held_bytes = 101
    assert slot.reconcile() == 0
    slot.held_bytes = 0
    assert slot.reconcile() == 1


@pytest.mark.usefixtures("credit_twin")
def test_a_closed_slot_counts_no_drains() -> None:
    slot = opened()
    slot.deliver(ITEM)
    slot.deliver(ITEM)
    slot.end(None)
    slot.take()
    assert slot.drained == 0 and slot.reconcile() == 0


@pytest.mark.usefixtures("credit_twin")
def test_the_watchdog_view_of_the_senders_credit() -> None:
    slot = opened(credit=2)
    assert slot.sender_has_credit and slot.outstanding_credit == 2
    slot.deliver(ITEM)
    slot.held_data = 1
    assert not slot.sender_has_credit
    slot.held_data = 0
    slot.take()
    assert slot.outstanding_credit == 1  # taken, but the grant is not out yet
    slot.reconcile()
    assert slot.outstanding_credit == 2
    slot.deliver_terminal(FINALIZED)
    assert not slot.sender_has_credit


@pytest.mark.usefixtures("credit_twin")
def test_a_slot_opens_once_and_rejects_a_bad_window() -> None:
    slot = opened()
    with pytest.raises(RuntimeError):
        slot.open(slot_id(1, 0), DirtySet(8), None, now=0.0)
    with pytest.raises(ValueError):
        IngressSlot(0, 100)
    with pytest.raises(ValueError):
        PeerBudget(0)


@pytest.mark.usefixtures("credit_twin")
def test_a_delivery_wakes_the_reader_only_when_the_buffer_becomes_readable() -> None:
    wakes: list[int] = []
    slot = IngressSlot(4, 1 << 20, wake=lambda: wakes.append(1))
    slot.open(slot_id(0, 0), DirtySet(8), None, now=0.0)
    slot.deliver(ITEM)
    slot.deliver(ITEM)
    assert len(wakes) == 1
    slot.take()
    slot.take()
    slot.deliver(ITEM)
    slot.end(DROPPED)
    assert len(wakes) == 4  # empty -> readable, the injected terminal, the end


# -- the three paths never double count ----------------------------------------------------


class _Replies:
    def __init__(self) -> None:
        self.granted: dict[int, int] = {}
        self.closes: list[int] = []
        self.lane = RejectLane()

    def credit(self, slot_id: int, delta: int) -> None:
        self.granted[slot_id] = self.granted.get(slot_id, 0) + delta

    def close(self, slot_id: int, reason: CloseReason) -> None:
        self.closes.append(slot_id)

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        return self.lane.offer(slot_id, reason)


class _NoControl:
    def credits(self, grants: list[tuple[int, int]]) -> None: ...

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None: ...

    def lifecycle(self, session: int, action: LifecycleAction) -> None: ...


def _feed(table: IngressTable, records: list[Any], seq: int, now: float) -> None:
    header, decoded = decode_batch(encode_batch(BatchHeader(0, len(records), 1, seq), records))
    table.handle_batch(header, decoded, now)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slots=st.integers(1, 4),
    credit=st.integers(1, 6),
    floor=st.sampled_from([0.0, 0.002]),
    byte_budget=st.sampled_from([40, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_interleavings_of_the_paths_grant_exactly_what_was_taken(
    slots: int, credit: int, floor: float, byte_budget: int, seed: int
) -> None:
    """Arrivals, takes, doorbell visits and sweeps in any order: at every point the credit
    granted is at most what was taken, and once the consumer stops and one walk runs, it
    is exactly what was taken (nothing double counted, nothing lost)."""
    rnd = random.Random(seed)
    config = MuxConfig(initial_credit=credit, drain_visit_floor=floor, slot_byte_budget=byte_budget)
    registry = InMemoryBindRegistry()
    replies = _Replies()
    table = IngressTable(
        "peer",
        0,
        config,
        registry=registry,
        replies=replies,
        control=_NoControl(),
        peer_budget=PeerBudget(config.peer_byte_budget),
    )
    buffers: list[IngressSlot] = []
    ids: list[int] = []
    for index in range(slots):
        buffer = IngressSlot(credit, byte_budget)
        registry.bind(index, index, buffer)
        buffers.append(buffer)
        ids.append(slot_id(index, 0))
    _feed(
        table,
        [(RecordType.OPEN_SLOT, ids[i], 0, open_slot_body(i, i)) for i in range(slots)],
        0,
        0.0,
    )
    sender_credit = [credit] * slots
    next_seq = [1] * slots
    taken = [0] * slots
    batch_seq = 1
    now = 0.0
    for _ in range(rnd.randint(1, 120)):
        now += rnd.choice([0.0, 0.001, 0.003])
        action = rnd.random()
        if action < 0.35:
            records: list[Any] = []
            for i in range(slots):
                for _ in range(rnd.randint(0, sender_credit[i])):
                    records.append((RecordType.DATA, ids[i], next_seq[i], ITEM))
                    next_seq[i] += 1
                    sender_credit[i] -= 1
            _feed(table, records, batch_seq, now)
            batch_seq += 1
        elif action < 0.7:
            i = rnd.randrange(slots)
            for _ in range(rnd.randint(1, credit)):
                if buffers[i].take() is not None:
                    taken[i] += 1
        elif action < 0.85:
            table.visit_dirty(now)
        else:
            table.sweep(now)
        for i in range(slots):
            grant = replies.granted.get(ids[i], 0)
            assert grant <= taken[i]
            sender_credit[i] = credit + grant - (next_seq[i] - 1)
    # The consumer reads everything; one walk settles the account.
    for i in range(slots):
        while buffers[i].take() is not None:
            taken[i] += 1
    table.sweep(now + 1.0)
    table.visit_dirty(now + 2.0)
    table.sweep(now + 3.0)
    for i in range(slots):
        assert replies.granted.get(ids[i], 0) == taken[i] == next_seq[i] - 1
        assert buffers[i].outstanding_credit == credit
    assert replies.closes == [] and table.stats.reader_stall == 0
