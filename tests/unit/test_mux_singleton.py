"""Singletons, the egress fence, staged refusals and LifecycleSlot, sans-IO.

The producer side runs an :class:`EgressBatcher` on an explicit clock; the consumer side
reuses the ingress harness (real codec, real table). Refusals go through the same function
the transport installs as the messenger's staged-refusal hook.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_mux_ingress import (
    Harness,
    close,
    data,
    drops,
    opening,
    read,
    terminal,
)
from velomux_quic.errors import UsageError
from velomux_quic.messenger.messenger import StagedRefusal
from velomux_quic.mux.config import Manual, MuxConfig
from velomux_quic.mux.credit import IngressSlot
from velomux_quic.mux.egress import EgressBatcher, EgressSlot, OutgoingBatch
from velomux_quic.mux.handlers import MUX_SLOT_HEADER, MuxSlotRef
from velomux_quic.mux.protocol import (
    BatchHeader,
    CloseReason,
    LifecycleAction,
    RecordType,
    close_slot_body,
    decode_batch,
    decode_lifecycle,
    encode_batch,
    lifecycle_body,
    slot_id,
)
from velomux_quic.mux.singleton import SingletonCounters, apply_staged_refusal
from velomux_quic.streaming.frames import DROPPED, FINALIZED, FrameKind, decode_frame

SMALL = b"s" * 40
CAP = 1024


def batcher(*, eager: int | None = None, **config: Any) -> EgressBatcher:
    config.setdefault("max_batch_bytes", CAP)
    return EgressBatcher(0, MuxConfig(**config), eager_budget=eager)


def records(batch: OutgoingBatch) -> list[tuple[int, int, int, bytes]]:
    _, recs = decode_batch(batch.payload)
    return [(t, s, q, bytes(b)) for t, s, q, b in recs]


def opened(b: EgressBatcher, count: int) -> list[EgressSlot]:
    slots = [b.open_slot(anchor_id=100 + i, session_id=200 + i) for i in range(count)]
    assert all(not batch.headers for batch in b.poll(0.0))  # the OpenSlot flush
    return slots


def seqs_of(out: list[OutgoingBatch], slot: EgressSlot) -> list[tuple[int, int]]:
    """(record_type, frame_seq) of every record of ``slot`` across ``out``, in order."""
    return [(t, q) for batch in out for t, s, q, _ in records(batch) if s == slot.slot_id]


class Owner:
    """A SlotOwner that records what the batcher told it."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def slot_stopped(self) -> None:
        self.events.append("stopped")

    def slot_closed(self, reason: object) -> None:
        self.events.append(reason)


def watched(b: EgressBatcher, slot: EgressSlot) -> tuple[Owner, list[object]]:
    """``slot``'s owner, and the retirement guards the batcher drops, as they are told."""
    owner = Owner()
    slot.owner = owner
    dropped: list[object] = []
    b.on_guard_dropped = dropped.append
    return owner, dropped


# -- egress: singletons and the fence -------------------------------------------------------


def test_a_record_over_the_cap_within_the_eager_budget_goes_alone_inline_unfenced() -> None:
    b = batcher(eager=10_000)
    a, c = opened(b, 2)
    big = b"B" * 4000
    for body in (SMALL, big, SMALL):
        assert b.offer(a, body, 0.0)
    b.offer(c, SMALL, 0.0)
    out = b.poll(0.0)
    assert [len(records(x)) for x in out] == [1, 1, 2]
    single = out[1]
    assert records(single) == [(RecordType.DATA, a.slot_id, 2, big)]
    assert single.headers is None and single.fence is None and single.carries_data
    # Inline rides the ordered lane: the slot's next record follows in the same poll.
    assert seqs_of(out, a) == [(RecordType.DATA, 1), (RecordType.DATA, 2), (RecordType.DATA, 3)]
    assert (b.counters.inline, b.counters.staged, b.counters.fences_raised) == (1, 0, 0)


def test_a_staged_singleton_names_its_stream_and_fences_its_slot_until_admitted() -> None:
    b = batcher(eager=2000)
    a, c = opened(b, 2)
    big = b"B" * 4000
    for body in (SMALL, big, b"after"):
        b.offer(a, body, 0.0)
    b.offer(c, b"c1", 0.0)
    out = b.poll(0.0)
    single = out[1]
    assert records(single) == [(RecordType.DATA, a.slot_id, 2, big)]
    assert single.headers == {MUX_SLOT_HEADER: f"{b.epoch}:{a.slot_id}:{a.session_id}"}
    assert MuxSlotRef.parse(single.headers[MUX_SLOT_HEADER]) == MuxSlotRef(
        b.epoch, a.slot_id, a.session_id
    )
    assert single.fence is a and a.fenced
    assert seqs_of(out, a) == [(RecordType.DATA, 1), (RecordType.DATA, 2)]  # "after" waits
    assert seqs_of(out, c) == [(RecordType.DATA, 1)]
    # While the fence is up, other slots flow and this slot's records, terminal and
    # close included, stay behind it, under every flush trigger.
    for n in range(3):
        b.offer(c, bytes([n]), 1.0)
        flowing = b.poll(1.0)
        assert seqs_of(flowing, c) == [(RecordType.DATA, 2 + n)] and not seqs_of(flowing, a)
    b.offer_terminal(a, FINALIZED, 2.0, guard="retired")
    b.kick()
    assert not seqs_of(b.poll(2.0), a)
    assert b.queued_records() == (0, 2)  # fenced records count as withheld
    b.lift_fence(a, 3.0)  # the staged send was admitted
    (after,) = b.poll(3.0)
    assert seqs_of([after], a) == [
        (RecordType.DATA, 3),
        (RecordType.DATA, 4),
        (RecordType.CLOSE_SLOT, 5),
    ]
    assert after.guards == ["retired"] and not a.live
    assert (b.counters.inline, b.counters.staged, b.counters.fences_raised) == (0, 1, 1)


def test_only_one_fenced_singleton_per_slot() -> None:
    b = batcher(eager=2000)
    (a,) = opened(b, 1)
    b.offer(a, b"1" * 3000, 0.0)
    b.offer(a, b"2" * 3000, 0.0)
    (first,) = b.poll(0.0)
    assert first.fence is a and b.poll(0.0) == []
    b.lift_fence(a, 0.0)
    (second,) = b.poll(0.0)
    assert second.fence is a and seqs_of([second], a) == [(RecordType.DATA, 2)]
    assert b.counters.fences_raised == 2


def test_inline_versus_staged_is_decided_by_the_eager_budget_not_the_byte_cap() -> None:
    body = b"x" * 3000
    size = 16 + 13 + len(body)  # the batch the messenger is handed
    for eager, staged in ((size, False), (size - 1, True)):
        b = batcher(eager=eager)
        (a,) = opened(b, 1)
        b.offer(a, body, 0.0)
        (single,) = b.poll(0.0)
        assert len(single.payload) == size
        assert (single.headers is not None, single.fence is a) == (staged, staged)
    # Without an eager budget of its own, a batcher takes its byte cap: every singleton
    # is then over it and staged.
    assert batcher().eager_budget == CAP


def test_a_large_terminal_goes_with_its_close_and_gives_its_guard_to_the_staged_send() -> None:
    b = batcher(eager=2000)
    (a,) = opened(b, 1)
    b.offer(a, SMALL, 0.0)
    end = b"T" * 3000  # e.g. a TransportError with a very large message
    b.offer_terminal(a, end, 0.0, guard="retired")
    _, single = b.poll(0.0)
    assert records(single) == [
        (RecordType.DATA, a.slot_id, 2, end),
        (RecordType.CLOSE_SLOT, a.slot_id, 3, bytes([CloseReason.TERMINAL_SENT])),
    ]
    assert single.guards == ["retired"] and single.headers is not None
    assert single.fence is None and not a.live  # nothing left to fence: the slot is done
    assert b.counters.fences_raised == 0 and b.counters.staged == 1


def test_a_singleton_spends_one_data_credit() -> None:
    b = batcher(eager=100_000, initial_credit=1)
    (a,) = opened(b, 1)
    b.offer(a, b"x" * 3000, 0.0)
    b.offer(a, SMALL, 0.0)
    assert len(b.poll(0.0)) == 1  # the singleton alone
    assert a.credit == 0 and b.poll(0.0) == []  # the next record waits for credit
    assert b.stats.credit_exhausted == 1
    b.on_credit(a.slot_id, 1, 0.0)
    assert seqs_of(b.poll(0.0), a) == [(RecordType.DATA, 2)]


def test_a_record_larger_than_the_slot_byte_budget_is_taken_when_the_queue_is_empty() -> None:
    b = batcher(slot_byte_budget=1000)
    (a,) = opened(b, 1)
    assert b.offer(a, b"x" * 5000, 0.0)  # a 4 MiB item on a 1 MiB slot, scaled down
    assert not b.offer(a, SMALL, 0.0)  # the producer waits until it leaves
    b.poll(0.0)
    assert b.offer(a, SMALL, 0.0)


def test_epoch_death_under_a_fence_closes_the_slot_and_a_late_admission_is_harmless() -> None:
    b = batcher(eager=2000)
    (a,) = opened(b, 1)
    owner, dropped = watched(b, a)
    b.offer(a, b"x" * 3000, 0.0)
    b.offer_terminal(a, FINALIZED, 0.0, guard="retired")
    assert b.poll(0.0)[0].fence is a
    b.epoch_death()  # the staged send was refused
    assert not a.live and dropped == ["retired"] and owner.events == [CloseReason.PEER_GONE]
    b.lift_fence(a, 0.0)
    assert b.poll(0.0) == []


@pytest.mark.parametrize("terminal_queued", [False, True])
def test_a_staged_record_lost_unpulled_ends_its_slot_on_the_wire_before_the_index_is_reused(
    terminal_queued: bool,
) -> None:
    """The fenced records and a queued terminal (its guard Discarded) give way to a Dropped
    terminal and its close, in turn after the lost record; the index is freed only once
    they are written, so the next stream's OpenSlot follows them on the lane."""
    b = batcher(eager=2000)
    (a,) = opened(b, 1)
    owner, dropped = watched(b, a)
    b.offer(a, SMALL, 0.0)
    b.offer(a, b"x" * 3000, 0.0)
    b.offer(a, b"withheld", 0.0)
    if terminal_queued:
        b.offer_terminal(a, FINALIZED, 0.0, guard="retired")
    assert seqs_of(b.poll(0.0), a) == [(RecordType.DATA, 1), (RecordType.DATA, 2)]
    b.end_lost(a, DROPPED, 1.0)  # the staged payload expired unpulled
    assert owner.events == [CloseReason.PEER_GONE] and a.live
    assert dropped == (["retired"] if terminal_queued else [])
    reused = b.open_slot(anchor_id=7, session_id=8)
    assert reused.index != a.index  # not free until the end is written
    out = b.poll(1.0)
    assert seqs_of(out, a) == [(RecordType.DATA, 3), (RecordType.CLOSE_SLOT, 4)]
    ends = [body for batch in out for t, s, _, body in records(batch) if s == a.slot_id]
    assert ends == [DROPPED, close_slot_body(CloseReason.TERMINAL_SENT)]
    assert not a.live and b.queued_bytes == 0 and b.live_slots == 1
    assert b.open_slot(anchor_id=9, session_id=10).index == a.index
    b.end_lost(a, DROPPED, 2.0)  # a late second release: the slot is gone, nothing moves
    assert owner.events == [CloseReason.PEER_GONE] and not seqs_of(b.poll(2.0), a)


# -- egress: LifecycleSlot both ways ---------------------------------------------------------


def lifecycle_records(out: list[OutgoingBatch]) -> list[tuple[int, LifecycleAction]]:
    return [
        decode_lifecycle(body)
        for batch in out
        for t, _, _, body in records(batch)
        if t == RecordType.LIFECYCLE_SLOT
    ]


def test_lifecycle_replies_coalesce_per_session_cancel_beats_stop_and_are_urgent() -> None:
    b = batcher(flush_policy=Manual())
    b.reply_lifecycle(7, LifecycleAction.STOP)
    b.reply_lifecycle(7, LifecycleAction.CANCEL)
    b.reply_lifecycle(7, LifecycleAction.STOP)  # a stop after a cancel changes nothing
    b.reply_lifecycle(8, LifecycleAction.STOP)
    assert b.pending_lifecycle(7) is LifecycleAction.CANCEL
    out = b.poll(0.0)  # no kick under Manual: urgent like a close
    assert lifecycle_records(out) == [(7, LifecycleAction.CANCEL), (8, LifecycleAction.STOP)]
    assert [r[1:3] for r in records(out[0])] == [(0, 0), (0, 0)]  # the session names it
    assert b.pending_lifecycle(7) is None and b.poll(0.0) == []
    assert b.counters.lifecycle_sent == 2
    assert b.stats.record_types[RecordType.LIFECYCLE_SLOT] == 2


def test_a_pending_lifecycle_reply_survives_this_sides_epoch_death() -> None:
    b = batcher()
    b.reply_lifecycle(7, LifecycleAction.CANCEL)
    b.epoch_death()
    assert lifecycle_records(b.poll(0.0)) == [(7, LifecycleAction.CANCEL)]


def test_stop_tells_the_owner_and_leaves_the_slot_open() -> None:
    b = batcher()
    (a,) = opened(b, 1)
    owner = Owner()
    a.owner = owner
    assert b.on_lifecycle(a.session_id, LifecycleAction.STOP) is a
    assert owner.events == ["stopped"] and a.live
    b.offer(a, SMALL, 0.0)
    assert seqs_of(b.poll(0.0), a) == [(RecordType.DATA, 1)]


def test_cancel_closes_the_slot_drops_its_queue_and_guard_and_tells_the_owner() -> None:
    b = batcher(initial_credit=1)
    (a,) = opened(b, 1)
    owner, dropped = watched(b, a)
    b.offer(a, SMALL, 0.0)
    b.offer(a, SMALL, 0.0)
    b.offer_terminal(a, FINALIZED, 0.0, guard="retired")
    b.poll(0.0)  # one record left; the rest wait for credit
    assert b.on_lifecycle(a.session_id, LifecycleAction.CANCEL) is a
    assert not a.live and not a.queue and b.live_slots == 0
    assert owner.events == [LifecycleAction.CANCEL] and dropped == ["retired"]
    with pytest.raises(UsageError):
        b.offer(a, SMALL, 0.0)  # the MuxChannel turns a closed slot into ChannelClosed
    assert b.poll(0.0) == []


def test_a_late_lifecycle_signal_cannot_reach_a_reused_slot() -> None:
    b = batcher()
    (a,) = opened(b, 1)
    owner = Owner()
    a.owner = owner
    b.offer_terminal(a, FINALIZED, 0.0)
    b.poll(0.0)
    reused = b.open_slot(anchor_id=1, session_id=999)
    reused.owner = owner
    assert reused.index == a.index
    assert b.on_lifecycle(a.session_id, LifecycleAction.CANCEL) is None
    assert b.on_lifecycle(12345, LifecycleAction.STOP) is None
    assert reused.live and owner.events == []


def test_the_owner_hears_every_close_but_its_own_terminal_and_its_own_abort() -> None:
    b = batcher()
    slots = opened(b, 5)
    owners = [Owner() for _ in slots]
    for slot, owner in zip(slots, owners, strict=True):
        slot.owner = owner
    unknown, protocol, aborted, finished, gone = slots
    b.on_peer_close(unknown.slot_id, CloseReason.UNKNOWN_SLOT)
    b.on_peer_close(protocol.slot_id, CloseReason.PROTOCOL_ERROR)
    b.cancel_slot(aborted)
    b.offer_terminal(finished, FINALIZED, 0.0)
    b.poll(0.0)
    b.epoch_death()
    assert [o.events for o in owners] == [
        [CloseReason.UNKNOWN_SLOT],
        [CloseReason.PROTOCOL_ERROR],
        [],
        [],
        [CloseReason.PEER_GONE],
    ]
    assert not gone.live


# -- ingress: the refusal by header ---------------------------------------------------------


def refusal(
    ref: str | None,
    *,
    peer: str = "peer-a",
    lane: int = 0,
    handler: str = "_stream_batch",
    size: int = 5_000_000,
    limit: int = 1_048_576,
) -> StagedRefusal:
    headers = None if ref is None else {MUX_SLOT_HEADER: ref}
    return StagedRefusal(peer, lane, handler, headers, size, limit)  # type: ignore[arg-type]


def refuse(h: Harness, ref: str | None, **options: Any) -> str | None:
    tables = {("peer-a", h.lane): h.table}
    return apply_staged_refusal(
        refusal(ref, **options),
        tables,  # type: ignore[arg-type]
        h.registry,
        h.stats,
    )


def session_of(index: int, generation: int = 0) -> int:
    return 2000 + index * 256 + generation  # what Harness.open binds


def read_error(slot: Any) -> tuple[list[object], str]:
    out: list[object] = []
    message = ""
    while (body := slot.take()) is not None:
        kind, value = decode_frame(body)
        if kind is FrameKind.TRANSPORT_ERROR:
            message = str(value)
            out.append(kind.name)
        else:
            out.append(value if kind is FrameKind.ITEM else kind.name)
    return out, message


def test_a_refusal_retires_exactly_its_slot_with_an_error_naming_both_sizes() -> None:
    h = Harness()
    sid, slot = h.open(1)
    other, other_slot = h.open(2)
    # Record 2 is the refused singleton; 3 and the terminal and close overtook it.
    h.send([data(sid, 1, "a"), data(other, 1, "x")])
    h.send([data(sid, 3, "c"), terminal(sid, 4), close(sid, 5), data(other, 2, "y")])
    assert refuse(h, f"{h.epoch}:{sid}:{session_of(1)}") == "applied"
    values, message = read_error(slot)
    # The held terminal (it spent the reserve) is dropped: the stream ends with the error.
    assert values == ["a", "TRANSPORT_ERROR"] and slot.exhausted
    assert "5000000 bytes" in message and "1048576 bytes" in message
    assert h.sink.lifecycles == [(session_of(1), LifecycleAction.CANCEL)]
    assert h.sink.closes == []  # never a CloseSlot: a late one could end a reused id
    assert h.table.slot(sid) is None and h.stats.live_slots == 1
    assert h.stats.held_records == 0 and h.stats.refusals["applied"] == 1
    assert read(other_slot) == ["x", "y"]
    h.send([data(other, 3, "z"), data(sid, 6, "late")])
    assert read(other_slot) == ["z"] and drops(h.stats) == {"closed_slot": 1}


@pytest.mark.parametrize(
    "ref",
    [
        "{epoch}:{sid}:{wrong_session}",
        "{old_epoch}:{sid}:{session}",
        "{epoch}:{wrong_generation}:{session}",
    ],
)
def test_a_refusal_naming_another_lifetime_is_stale_and_does_nothing(ref: str) -> None:
    h = Harness()
    sid, slot = h.open(1)
    h.send([data(sid, 1, "a")])
    named = ref.format(
        epoch=h.epoch,
        old_epoch=h.epoch - 1,
        sid=sid,
        wrong_generation=slot_id(1, 1),
        session=session_of(1),
        wrong_session=session_of(1) + 1,
    )
    assert refuse(h, named) == "stale"
    h.send([data(sid, 2, "b")])
    assert read(slot) == ["a", "b"] and h.sink.lifecycles == []
    assert h.stats.refusals == {"applied": 0, "waiting": 0, "stale": 1, "malformed": 0}


@pytest.mark.parametrize("value", [None, "", "1:2", "01:2:3", "a:b:c", "1:2:3:4"])
def test_a_refusal_without_a_readable_header_is_counted_and_ignored(value: str | None) -> None:
    h = Harness()
    sid, slot = h.open(1)
    assert refuse(h, value) == "malformed"
    assert h.stats.refusals["malformed"] == 1 and h.table.slot(sid) is slot


def test_a_refused_staged_payload_of_another_handler_is_not_the_muxs() -> None:
    h = Harness()
    assert refuse(h, "1:2:3", handler="_rv_something") is None
    assert h.stats.refusals == {"applied": 0, "waiting": 0, "stale": 0, "malformed": 0}


def test_a_refusal_ends_a_slot_that_waits_aside_and_spares_the_index_new_stream() -> None:
    h = Harness()
    old, old_slot = h.open(2, generation=1)
    h.send([terminal(old, 2), close(old, 3)])  # record 1 is the staged singleton
    new, new_slot = h.open(2, generation=2)  # the sender reused the index at once
    assert refuse(h, f"{h.epoch}:{old}:{session_of(2, 1)}") == "applied"
    values, message = read_error(old_slot)
    assert values == ["TRANSPORT_ERROR"] and "staged_payload_max" in message
    h.send([data(new, 1, "new")])
    assert read(new_slot) == ["new"] and h.table.slot(new) is new_slot
    assert h.stats.live_slots == 1


@pytest.mark.parametrize(
    ("reason", "limit", "detail", "says"),
    [
        ("pull_count", 8, "", ["5000000 bytes", "8 staged payloads", "max_pulls_per_peer"]),
        ("pull_bytes", 65536, "", ["5000000 bytes", "max_pull_bytes_per_peer (65536 bytes)"]),
        ("lost", 0, "could not pull it from peer-a: timed out", ["was lost", "timed out"]),
    ],
)
def test_a_refusal_past_the_pull_bounds_or_a_failed_pull_says_why_and_ends_its_slot(
    reason: str, limit: int, detail: str, says: list[str]
) -> None:
    h = Harness()
    sid, slot = h.open(1)
    h.send([data(sid, 1, "a"), terminal(sid, 3), close(sid, 4)])  # 2 never arrives
    named = refusal(f"{h.epoch}:{sid}:{session_of(1)}", limit=limit)
    named.reason, named.detail = reason, detail
    assert apply_staged_refusal(named, {("peer-a", h.lane): h.table}, h.registry, h.stats) == (  # type: ignore[arg-type]
        "applied"
    )
    values, message = read_error(slot)
    assert values == ["a", "TRANSPORT_ERROR"] and "staged_payload_max" not in message
    assert all(part in message for part in says), message
    assert h.sink.lifecycles == [(session_of(1), LifecycleAction.CANCEL)]
    assert h.table.slot(sid) is None and h.stats.live_slots == 0


def test_a_staged_record_after_its_later_records_and_close_lands_in_order() -> None:
    h = Harness()
    old, old_slot = h.open(2, generation=1)
    h.send([data(old, 1, "a"), data(old, 3, "c"), terminal(old, 4), close(old, 5)])
    new, new_slot = h.open(2, generation=2)  # the old slot moved aside
    h.send([data(new, 1, "new")])
    h.table.handle_staged_batch(*decode_staged(h, [data(old, 2, "BIG")]), 0.0)
    assert read(old_slot) == ["a", "BIG", "c", "FINALIZED"] and old_slot.exhausted
    assert read(new_slot) == ["new"] and not drops(h.stats)
    # A staged record whose slot is gone by the time it resolves: stale_singleton.
    h.table.handle_staged_batch(*decode_staged(h, [data(old, 2, "again")]), 0.0)
    assert drops(h.stats) == {"stale_singleton": 1}


def decode_staged(h: Harness, recs: list[Any]) -> tuple[Any, Any]:
    header = BatchHeader(h.lane, len(recs), h.epoch, h.batch_seq)
    h.batch_seq += 1
    return decode_batch(encode_batch(header, recs))


# -- ingress: a refusal that overtakes its OpenSlot -----------------------------------------


def test_a_refusal_waits_on_the_bind_and_the_open_slot_ends_the_stream_at_once() -> None:
    h = Harness()
    h.open(5)  # the epoch is known; this stream's OpenSlot is still on the lane
    sid = slot_id(1, 0)
    slot = h.bind(1001, session_of(1))
    assert refuse(h, f"{h.epoch}:{sid}:{session_of(1)}") == "waiting"
    assert h.sink.lifecycles == [] and not slot.opened
    h.send([opening(sid, 1001, session_of(1)), data(sid, 2, "after")])
    values, message = read_error(slot)
    assert values == ["TRANSPORT_ERROR"] and "1048576" in message
    assert h.sink.lifecycles == [(session_of(1), LifecycleAction.CANCEL)]
    assert h.table.slot(sid) is None and h.stats.live_slots == 1
    assert h.stats.refusals["waiting"] == 1 and h.stats.refusals["applied"] == 1


def test_a_waiting_refusal_for_another_slot_id_or_epoch_does_not_end_the_claim() -> None:
    for ref in ("{epoch}:{other}:{session}", "{next_epoch}:{sid}:{session}"):
        h = Harness()
        sid = slot_id(1, 0)
        slot = h.bind(1001, session_of(1))
        named = ref.format(
            epoch=h.epoch,
            next_epoch=h.epoch + 1,
            sid=sid,
            other=slot_id(1, 1),
            session=session_of(1),
        )
        assert refuse(h, named) == "waiting"
        h.send([opening(sid, 1001, session_of(1)), data(sid, 1, "ok")])
        assert read(slot) == ["ok"] and h.sink.lifecycles == [] and slot.refusals is None


def test_another_peers_refusal_for_the_same_session_neither_replaces_nor_blocks() -> None:
    h = Harness()
    sid = slot_id(1, 0)
    slot = h.bind(1001, session_of(1))  # a pre-bind: any peer may claim it
    mine = f"{h.epoch}:{sid}:{session_of(1)}"
    assert refuse(h, mine) == "waiting"
    assert refuse(h, f"7:{slot_id(9, 9)}:{session_of(1)}", peer="peer-b") == "waiting"
    assert set(slot.refusals or {}) == {("peer-a", 0), ("peer-b", 0)}
    h.send([opening(sid, 1001, session_of(1))])
    assert read_error(slot)[0] == ["TRANSPORT_ERROR"]

    # Only the other peer's refusal waits: peer-a's OpenSlot opens the stream normally.
    h = Harness()
    slot = h.bind(1001, session_of(1))
    assert refuse(h, mine, peer="peer-b") == "waiting"
    h.send([opening(sid, 1001, session_of(1)), data(sid, 1, "ok")])
    assert read(slot) == ["ok"] and h.sink.lifecycles == []


def test_a_bind_that_names_its_sender_takes_no_refusal_from_another_peer() -> None:
    h = Harness()
    slot = IngressSlot(h.config.initial_credit, h.config.slot_byte_budget)
    h.registry.bind(1001, session_of(1), slot, peer="peer-a")  # an attach names its sender
    assert refuse(h, f"1:{slot_id(1, 0)}:{session_of(1)}", peer="peer-b") == "stale"
    assert slot.refusals is None


def test_a_stale_refusal_with_no_slot_and_no_bind_does_nothing() -> None:
    h = Harness()
    sid, slot = h.open(1)
    h.send([terminal(sid, 1), close(sid, 2)])
    assert refuse(h, f"{h.epoch}:{sid}:{session_of(1)}") == "stale"
    assert read(slot) == ["FINALIZED"] and h.sink.lifecycles == []


def test_a_released_bind_forgets_its_session() -> None:
    h = Harness()
    h.bind(1001, session_of(1))
    assert h.registry.release(1001, session_of(1)) is not None
    assert h.registry.waiting_bind("peer-a", session_of(1)) is None


# -- both sides: LifecycleSlot on the wire ---------------------------------------------------


def test_lifecycle_records_reach_egress_control_and_are_counted() -> None:
    h = Harness()
    h.send(
        [
            (RecordType.LIFECYCLE_SLOT, 0, 0, lifecycle_body(42, LifecycleAction.STOP)),
            (RecordType.LIFECYCLE_SLOT, 0, 0, lifecycle_body(43, LifecycleAction.CANCEL)),
        ]
    )
    assert h.control.events == [
        ("lifecycle", 42, LifecycleAction.STOP),
        ("lifecycle", 43, LifecycleAction.CANCEL),
    ]
    assert h.stats.lifecycle_received == 2


def test_a_staged_singleton_round_trip_from_batcher_to_refusal() -> None:
    """The header the batcher writes is the one the refusal hook reads."""
    b = EgressBatcher(0, MuxConfig(max_batch_bytes=CAP), eager_budget=2000)
    slot = b.open_slot(anchor_id=1001, session_id=session_of(1))
    h = Harness()
    h.epoch = b.epoch
    bound = h.bind(1001, session_of(1))
    for batch in b.poll(0.0):
        h.table.handle_batch(*decode_batch(batch.payload), 0.0)
    b.offer(slot, b"x" * 5000, 0.0)
    (single,) = b.poll(0.0)
    assert single.headers is not None
    assert refuse(h, single.headers[MUX_SLOT_HEADER]) == "applied"
    assert read_error(bound)[0] == ["TRANSPORT_ERROR"]
    # The reply is what the producer's ingress hands to its batcher's on_lifecycle.
    ((session, action),) = h.sink.lifecycles
    assert b.on_lifecycle(session, action) is slot and not slot.live


def test_counters_can_be_shared_by_every_batcher_of_a_node() -> None:
    shared = SingletonCounters()
    for lane in (0, 1):
        b = EgressBatcher(lane, MuxConfig(max_batch_bytes=CAP), eager_budget=2000, counters=shared)
        (a,) = opened(b, 1)
        b.offer(a, b"x" * 3000, 0.0)
        b.poll(0.0)
    assert shared.staged == 2 and shared.fences_raised == 2
