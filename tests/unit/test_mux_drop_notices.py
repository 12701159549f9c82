"""Drop notices, sans-IO, on the table's clock: a record of a slot the consumer no longer
has (its consumer withdrew, its OpenSlot was refused, or the OpenSlot never arrived) is
answered again when the earlier notice may have been lost, and only a bounded number of
times per slot.

The case they exist for: a producer stopped (SIGSTOP) past the idle timeout, whose
consumer dropped its streams meanwhile. The consumer's notices leave on connections that
die with them; the resumed producer streams on, on a new connection, into the dropped
slots, and must be told again there.
"""

from __future__ import annotations

import pytest

from tests.unit.test_mux_ingress import Harness, data, drops, opening
from velomux_quic.errors import ConfigurationError
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.protocol import CloseReason, slot_id

UNKNOWN = CloseReason.UNKNOWN_SLOT


def answers_over(h: Harness, sid: int, start: float, stop: float, step: float) -> list[float]:
    """Send one record of ``sid`` every ``step`` seconds from ``start`` until ``stop`` (a
    batch each, as a producer streaming at that pace would); the times it was answered."""
    answered: list[float] = []
    seq = 1
    now = start
    while now < stop:
        h.send([data(sid, seq)], now=now)
        if h.sink.rejects.drain():
            answered.append(now)
        seq += 1
        now = round(now + step, 6)
    return answered


def test_a_slot_dropped_while_the_connection_was_lost_is_answered_on_the_new_one() -> None:
    """The consumer withdrew (its watchdog fired while the producer was stopped) and sent
    its close on a connection that then died; the resumed producer's next record, on the
    next connection, is answered with the close again."""
    h = Harness()
    sid, slot = h.open(0)
    h.send([data(sid, 1)])
    slot.withdraw()
    assert h.table.visit_dirty(0.0)
    assert h.sink.closes == [(sid, UNKNOWN)]
    h.sink.closes.clear()  # lost with the connection it left on
    h.send([data(sid, 2), data(sid, 3)], now=10.0, batch_seq=40)  # resumed: later batches
    assert h.sink.rejects.drain() == [(sid, UNKNOWN)]
    assert drops(h.stats) == {"unknown_slot": 2}
    assert h.stats.drop_notices == {"answered": 1, "limited": 1}
    assert h.stats.live_slots == 0


def test_a_record_of_a_slot_whose_open_slot_was_lost_is_answered() -> None:
    """The OpenSlot left on a connection that died before the consumer read it; the
    consumer's watchdog dropped the stream, whose slot this table never had. The producer's
    later records are its only chance to learn: each slot is answered, and the answer
    does not open anything."""
    h = Harness()
    h.bind(77, 88)  # bound by the attach; its OpenSlot never arrives
    lost = [slot_id(index, 3) for index in range(4)]
    h.send([data(sid, 1) for sid in lost], now=5.0)
    assert sorted(h.sink.rejects.drain()) == [(sid, UNKNOWN) for sid in lost]
    assert drops(h.stats) == {"closed_slot": 4}
    assert h.stats.drop_notices == {"answered": 4, "limited": 0}
    assert h.stats.live_slots == 0


def test_a_refused_slots_records_repeat_its_refusal_with_its_reason() -> None:
    h = Harness(max_slots_per_table=4)
    sid = slot_id(9, 0)  # past the table's slot limit: refused as a protocol error
    h.send([opening(sid, 7, 1), data(sid, 1)])
    assert h.sink.rejects.drain() == [(sid, CloseReason.PROTOCOL_ERROR)]
    h.send([data(sid, 2)], now=1.0)
    assert h.sink.rejects.drain() == [(sid, CloseReason.PROTOCOL_ERROR)]
    assert drops(h.stats) == {"unknown_slot": 2}


def test_a_peer_hammering_a_dropped_slot_gets_a_bounded_number_of_answers() -> None:
    """A record every 10 ms for two minutes (12,000 of them) draws the close's four
    repeats, at 1, 3, 7 and 15 s after it (each wait twice the last), and no more; every
    other record is counted as limited."""
    h = Harness()
    sid, slot = h.open(0)
    slot.withdraw()
    assert h.table.visit_dirty(0.0)
    answered = answers_over(h, sid, 0.01, 120.0, 0.01)
    assert answered == [1.0, 3.0, 7.0, 15.0]
    limit = MuxConfig().drop_notice_limit
    assert len(answered) == limit - 1  # the close was the first notice
    records = round(120.0 / 0.01) - 1
    assert h.stats.drop_notices == {"answered": limit - 1, "limited": records - (limit - 1)}
    assert drops(h.stats) == {"unknown_slot": records}


def test_a_slot_never_opened_here_gets_at_most_the_limit_in_answers() -> None:
    h = Harness(drop_notice_limit=2, drop_notice_interval=0.5)
    sid = slot_id(3, 1)
    assert answers_over(h, sid, 0.0, 60.0, 0.25) == [0.0, 0.5]
    assert h.stats.drop_notices["answered"] == 2


def test_the_slots_a_table_remembers_telling_are_bounded() -> None:
    """Slot ids are the peer's choice: the table remembers the last ``max_refused_slots``
    it told, and a forgotten one is answered as one never told. Never more than one
    answer per record, whatever the ids."""
    h = Harness(max_refused_slots=8)
    sids = [slot_id(index, 0) for index in range(100)]
    h.send([data(sid, 1) for sid in sids])
    assert len(h.sink.rejects.drain()) == 100
    # Inside every slot's backoff, the most recently told first: those 8 are remembered
    # (limited); the rest were forgotten, and are answered as if never told.
    h.send([data(sid, 2) for sid in reversed(sids)], now=0.5)
    answered = {sid for sid, _ in h.sink.rejects.drain()}
    assert answered == set(sids[:92])
    assert h.stats.drop_notices == {"answered": 192, "limited": 8}


def test_a_full_reject_lane_answers_nothing_and_counts_the_refusal() -> None:
    h = Harness(reject_cap=1)
    h.send([data(slot_id(1, 0), 1), data(slot_id(2, 0), 1)])
    assert h.sink.rejects.drain() == [(slot_id(1, 0), UNKNOWN)]
    assert h.stats.control_refused == 1
    h.send([data(slot_id(2, 0), 2)])  # not told yet, so answered at once
    assert h.sink.rejects.drain() == [(slot_id(2, 0), UNKNOWN)]


def test_a_new_stream_on_the_slot_id_starts_with_no_notices() -> None:
    """The generation wraps after 256 streams on one index: a stream opened on an id that
    was told before gets its own notices when it ends."""
    h = Harness(drop_notice_limit=2)
    sid = slot_id(0, 0)
    h.send([data(sid, 1)])  # answered: never opened
    assert h.sink.rejects.drain() == [(sid, UNKNOWN)]
    h.send([data(sid, 2)], now=1.0)  # answered again: the limit is spent
    h.send([data(sid, 3)], now=1.5)
    assert h.sink.rejects.drain() == [(sid, UNKNOWN)]
    assert h.stats.drop_notices == {"answered": 2, "limited": 1}
    h.bind(1000, 2000)
    h.send([opening(sid, 1000, 2000)], now=2.0)
    slot = h.table.slot(sid)
    assert slot is not None
    slot.withdraw()
    assert h.table.visit_dirty(2.0) and h.sink.closes == [(sid, UNKNOWN)]
    h.send([data(sid, 1)], now=3.0)
    assert h.sink.rejects.drain() == [(sid, UNKNOWN)]
    assert h.stats.drop_notices == {"answered": 3, "limited": 1}


def test_the_drop_notice_bounds_are_validated() -> None:
    with pytest.raises(ConfigurationError):
        MuxConfig(drop_notice_limit=0)  # the notice that ended the slot is the first
    with pytest.raises(ConfigurationError):
        MuxConfig(drop_notice_interval=-1.0)
