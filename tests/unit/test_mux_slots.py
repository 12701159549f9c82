"""The egress slot lifecycle (one transition table), injected epochs, and the snapshots."""

from __future__ import annotations

import itertools
import time

import pytest

from velomux_quic.errors import UsageError
from velomux_quic.mux import SLOT_TRANSITIONS, SlotEvent, SlotState
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.contracts import InMemoryBindRegistry, MuxIngressStats
from velomux_quic.mux.credit import IngressSlot, PeerBudget
from velomux_quic.mux.egress import EgressBatcher, wall_clock_epochs
from velomux_quic.mux.ingress import IngressTable
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
from velomux_quic.mux.slots import EgressSlot, next_slot_state
from velomux_quic.streaming.frames import FINALIZED, encode_item

TOKEN = b"t" * 48

LEGAL = {
    (SlotState.OPENING, SlotEvent.OPEN_WRITTEN): SlotState.OPEN,
    (SlotState.OPENING, SlotEvent.TERMINAL_QUEUED): SlotState.ENDING_UNOPENED,
    (SlotState.OPENING, SlotEvent.CLOSED): SlotState.CLOSED,
    (SlotState.OPEN, SlotEvent.TERMINAL_QUEUED): SlotState.ENDING,
    (SlotState.OPEN, SlotEvent.CLOSED): SlotState.CLOSED,
    (SlotState.ENDING_UNOPENED, SlotEvent.OPEN_WRITTEN): SlotState.ENDING,
    (SlotState.ENDING_UNOPENED, SlotEvent.CLOSED): SlotState.CLOSED,
    (SlotState.ENDING, SlotEvent.TERMINAL_WRITTEN): SlotState.CLOSED,
    (SlotState.ENDING, SlotEvent.CLOSED): SlotState.CLOSED,
}
"""The lifecycle written out by hand, pair by pair, against which the table is checked."""


def pinned(*epochs: int, lane: int = 0, **config: object) -> EgressBatcher:
    return EgressBatcher(lane, MuxConfig(**config), epochs=iter(epochs).__next__)  # type: ignore[arg-type]


# -- the transition table -----------------------------------------------------------------


@pytest.mark.parametrize("state", list(SlotState))
@pytest.mark.parametrize("event", list(SlotEvent))
def test_every_state_and_event_pair_is_either_in_the_table_or_refused(
    state: SlotState, event: SlotEvent
) -> None:
    expected = LEGAL.get((state, event))
    if expected is None:
        with pytest.raises(UsageError, match=f"{state.name} cannot take {event.name}"):
            next_slot_state(state, event)
    else:
        assert next_slot_state(state, event) is expected
        assert SLOT_TRANSITIONS[state][event] is expected


def test_the_table_lists_exactly_the_legal_moves_and_closed_is_final() -> None:
    listed = {
        (state, event): target
        for state, moves in SLOT_TRANSITIONS.items()
        for event, target in moves.items()
    }
    assert listed == LEGAL
    assert SLOT_TRANSITIONS[SlotState.CLOSED] == {}
    # Every state can close early, and every state is reachable from OPENING.
    assert all(
        LEGAL[(s, SlotEvent.CLOSED)] is SlotState.CLOSED for s in SlotState if s.name != "CLOSED"
    )
    reached, frontier = {SlotState.OPENING}, [SlotState.OPENING]
    while frontier:
        for target in SLOT_TRANSITIONS[frontier.pop()].values():
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(SlotState)


def test_an_illegal_move_leaves_the_slot_as_it_was() -> None:
    slot = EgressSlot(0, 0, 1, 2, credit=4, budget=1024)
    assert slot.advance(SlotEvent.OPEN_WRITTEN) is SlotState.OPEN
    with pytest.raises(UsageError):
        slot.advance(SlotEvent.TERMINAL_WRITTEN)  # no terminal was queued
    assert slot.state is SlotState.OPEN and slot.live and not slot.terminal_queued


# -- the lifecycle through the batcher ------------------------------------------------------


def test_a_stream_walks_opening_open_ending_closed() -> None:
    b = pinned(1)
    slot = b.open_slot(anchor_id=1, session_id=2)
    assert slot.state is SlotState.OPENING and slot.open_pending
    b.poll(0.0)
    assert slot.state is SlotState.OPEN and not slot.open_pending
    b.offer(slot, TOKEN, 0.0)
    b.offer_terminal(slot, FINALIZED, 0.0)
    assert slot.state is SlotState.ENDING and slot.terminal_queued
    with pytest.raises(UsageError, match="takes no more records"):
        b.offer(slot, TOKEN, 0.0)
    with pytest.raises(UsageError):
        b.offer_terminal(slot, FINALIZED, 0.0)  # a second terminal
    (batch,) = b.poll(0.0)
    _, recs = decode_batch(batch.payload)
    assert [r[0] for r in recs] == [RecordType.DATA, RecordType.DATA, RecordType.CLOSE_SLOT]
    assert slot.state is SlotState.CLOSED and not slot.live and b.live_slots == 0


def test_a_terminal_queued_before_the_open_is_written_goes_after_it() -> None:
    b = pinned(1)
    slot = b.open_slot(anchor_id=1, session_id=2)
    b.offer_terminal(slot, FINALIZED, 0.0)
    assert slot.state is SlotState.ENDING_UNOPENED and slot.open_pending
    out = b.poll(0.0)
    kinds = [r[0] for batch in out for r in decode_batch(batch.payload)[1]]
    assert kinds == [RecordType.OPEN_SLOT, RecordType.DATA, RecordType.CLOSE_SLOT]
    assert slot.state is SlotState.CLOSED


def test_a_cancel_closes_a_slot_in_any_live_state() -> None:
    b = pinned(1)
    opening = b.open_slot(anchor_id=1, session_id=10)
    b.cancel_slot(opening)
    assert opening.state is SlotState.CLOSED
    ending = b.open_slot(anchor_id=1, session_id=11, credit=0)
    b.poll(0.0)
    b.offer(ending, TOKEN, 0.0)
    b.offer_terminal(ending, FINALIZED, 0.0)  # waits behind a record without credit
    b.poll(0.0)
    assert ending.state is SlotState.ENDING
    assert b.on_lifecycle(11, LifecycleAction.CANCEL) is ending
    assert ending.state is SlotState.CLOSED and b.live_slots == 0
    b.cancel_slot(ending)  # the producer's late abort of a closed slot changes nothing
    assert ending.state is SlotState.CLOSED and b.live_slots == 0


# -- injected epochs ---------------------------------------------------------------------------


def test_the_epoch_comes_from_the_injected_source_at_start_and_at_every_death() -> None:
    b = pinned(41, 42, 50, lane=3)
    assert b.epoch == 41
    b.open_slot(anchor_id=1, session_id=1)
    (batch,) = b.poll(0.0)
    header, _ = decode_batch(batch.payload)
    assert (header.lane, header.peer_epoch, header.batch_seq) == (3, 41, 0)
    b.epoch_death()
    assert b.epoch == 42 and b.batch_seq == 0
    b.epoch_death()
    assert b.epoch == 50


def test_one_shared_source_never_gives_two_batchers_the_same_epoch() -> None:
    source = itertools.count(7).__next__
    first = EgressBatcher(0, MuxConfig(), epochs=source)
    first.epoch_death()
    second = EgressBatcher(0, MuxConfig(), epochs=source)  # re-created after eviction
    assert (first.epoch, second.epoch) == (8, 9)


def test_the_wall_clock_source_starts_at_the_clock_in_microseconds_and_climbs() -> None:
    before = time.time_ns() // 1000
    source = wall_clock_epochs()
    epochs = [source() for _ in range(3)]
    assert epochs[0] >= before and epochs == sorted(set(epochs))


# -- snapshots -----------------------------------------------------------------------------------


def test_the_egress_snapshot_counts_slots_by_state_and_what_waits() -> None:
    b = pinned(5, initial_credit=1)
    slots = [b.open_slot(anchor_id=1, session_id=s) for s in (1, 2, 3)]
    before = b.snapshot()
    assert before.slot_states[SlotState.OPENING] == 3 and before.live_slots == 3
    assert SlotState.CLOSED not in before.slot_states
    b.poll(0.0)
    b.offer(slots[0], TOKEN, 0.0)
    b.offer(slots[0], TOKEN, 0.0)  # beyond its one credit: withheld after the poll
    b.offer_terminal(slots[1], FINALIZED, 0.0)
    b.cancel_slot(slots[2])
    snap = b.snapshot()
    assert snap.epoch == 5 and snap.live_slots == 2
    assert dict(snap.slot_states) == {
        SlotState.OPENING: 0,
        SlotState.OPEN: 1,
        SlotState.ENDING_UNOPENED: 0,
        SlotState.ENDING: 1,
    }
    assert (snap.queued_records, snap.withheld_records) == (2, 1)
    assert snap.queued_bytes == 2 * len(TOKEN) + len(FINALIZED)
    b.poll(0.0)
    after = b.snapshot()
    assert (after.queued_records, after.withheld_records, after.live_slots) == (0, 1, 1)
    assert after.queued_bytes == len(TOKEN) and after.batch_seq > snap.batch_seq
    assert before.slot_states[SlotState.OPENING] == 3  # a snapshot is a value: it never moves


class _Replies:
    def credit(self, slot_id: int, delta: int) -> None: ...
    def close(self, slot_id: int, reason: CloseReason) -> None: ...
    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        return True

    def lifecycle(self, session: int, action: LifecycleAction) -> None: ...
    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None: ...


def test_the_ingress_snapshot_counts_held_and_buffered_records() -> None:
    config = MuxConfig(initial_credit=8)
    registry = InMemoryBindRegistry()
    table = IngressTable(
        "peer",
        0,
        config,
        registry=registry,
        replies=_Replies(),
        control=_Replies(),
        peer_budget=PeerBudget(config.peer_byte_budget),
        stats=MuxIngressStats(),
    )
    assert table.snapshot().epoch is None
    slot = IngressSlot(8, config.slot_byte_budget)
    registry.bind(1, 2, slot)
    sid = slot_id(0, 0)
    item = encode_item("x")
    payload = encode_batch(
        BatchHeader(lane=0, record_count=3, peer_epoch=9, batch_seq=0),
        [
            (RecordType.OPEN_SLOT, sid, 0, open_slot_body(1, 2)),
            (RecordType.DATA, sid, 1, item),
            (RecordType.DATA, sid, 3, item),  # ahead of 2: held
        ],
    )
    header, records = decode_batch(payload)
    table.handle_batch(header, records, 0.0)
    snap = table.snapshot()
    assert (snap.epoch, snap.live_slots) == (header.peer_epoch, 1)
    assert (snap.held_records, snap.held_bytes) == (1, len(item))
    assert (snap.buffered_records, snap.buffered_bytes) == (1, len(item))
    slot.take()
    assert table.snapshot().buffered_records == 0 and snap.buffered_records == 1
