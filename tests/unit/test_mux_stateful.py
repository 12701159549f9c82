"""A stateful model of one producer batcher and one consumer table over an in-memory wire.

Hypothesis drives one :class:`EgressBatcher` (the producer's node) and one
:class:`IngressTable` (the consumer's node), joined in both directions the way the
transport joins them: the producer's batches are decoded and applied to the consumer's
table; the table's replies (credit, closes) go into the consumer node's own batcher,
whose batches are decoded and applied to the producer node's table, which hands them to
the producer's batcher. Time is an explicit clock. Admission can be held (the batcher
parks) and resolved later, in order; the wire never reorders the batches of one lane.

Checked after every step: no slot has more than C data records outstanding (in its
C + 1 buffer plus on the wire), the producer never holds more credit than the buffer has
room for, the reader never stalls, every record a consumer takes is the next one its
producer sent (exactly once, in order), and a dropped stream delivers nothing more.

At the end both nodes run the way their drivers do (a poll after every change and at each
batcher's own deadline, a doorbell visit after every read; no periodic walk, and no
flush except the application's under ``Manual``) until nothing moves. Then credit granted
equals records taken on every stream both sides kept, every stream is finalized and
drained, every stream the consumer kept ends with ``Finalized`` after all its records,
and no slot stays live on either side. A second machine adds refused admissions (epoch
death): the streams it kills end with ``Dropped`` after a prefix of their records.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from velomux_quic.mux.config import AutoFlush, Manual, MuxConfig
from velomux_quic.mux.credit import IngressSlot, PeerBudget
from velomux_quic.mux.egress import EgressBatcher, EgressSlot, OutgoingBatch
from velomux_quic.mux.ingress import IngressTable, InMemoryBindRegistry, MuxIngressStats
from velomux_quic.mux.protocol import (
    CloseReason,
    LifecycleAction,
    RecordType,
    decode_batch,
    decode_close_slot,
    decode_open_slot,
)
from velomux_quic.streaming.frames import DROPPED, FINALIZED, encode_item, is_terminal_sentinel

MAX_LIVE = 8
"""Streams live at once (open on the producer, or still unread on the consumer)."""

MAX_STREAMS = 24
"""Streams per run: far below 256, so a slot id (index, generation) never wraps."""

PRODUCER = "producer-node"
CONSUMER = "consumer-node"

POLICIES = (
    AutoFlush(),
    AutoFlush(on_admission=False, max_linger=0.002),
    AutoFlush(on_admission=False, max_linger=0.005, on_complete=True),
    AutoFlush(on_admission=False, max_linger=0.010, at_bytes=96),
    Manual(),
)

DELAYS = st.sampled_from([0.0, 0.0005, 0.001, 0.002, 0.005, 0.05, 0.25])

BENIGN_DROPS = frozenset({"closed_slot", "unknown_slot"})
"""Records for a slot the consumer dropped (retired, or never admitted): expected."""


# -- the two nodes, wired as the transport wires them -------------------------------------


class _Replies:
    """ReplySink: this node's ingress about the peer's slots, into this node's batcher."""

    def __init__(self, node: _Node) -> None:
        self._node = node

    def credit(self, slot_id: int, delta: int) -> None:
        assert delta > 0, "a zero or negative grant"
        self._node.batcher.reply_credit(slot_id, delta, self._node.clock())

    def close(self, slot_id: int, reason: CloseReason) -> None:
        self._node.batcher.reply_close(slot_id, reason)

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        batcher = self._node.batcher
        if batcher.pending_closes() >= batcher.config.reject_lane_cap:
            return False
        self.close(slot_id, reason)
        return True


class _Control:
    """EgressControl: the peer's control about this node's slots, into this node's batcher."""

    def __init__(self, node: _Node) -> None:
        self._node = node

    def credits(self, grants: list[tuple[int, int]]) -> None:
        self._node.batcher.on_credits(grants, self._node.clock())

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None:
        self._node.batcher.on_peer_close(slot_id, reason)

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        self._node.batcher.on_lifecycle(session, action)


class _Node:
    """One node's half of the (peer, lane): its batcher, its table, its outgoing wire.

    ``admitting`` holds written batches whose admission is pending (the batcher is parked
    while it is not empty); ``wire`` holds admitted batches on their way, in order.
    """

    def __init__(self, peer: str, config: MuxConfig, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.batcher = EgressBatcher(0, config)
        self.registry = InMemoryBindRegistry()
        self.budget = PeerBudget(config.peer_byte_budget)
        self.stats = MuxIngressStats()
        self.table = IngressTable(
            peer,
            0,
            config,
            registry=self.registry,
            replies=_Replies(self),
            control=_Control(self),
            peer_budget=self.budget,
            stats=self.stats,
        )
        self.admitting: deque[OutgoingBatch] = deque()
        self.wire: deque[bytes] = deque()


# -- the model of one stream --------------------------------------------------------------


class _ProducerOwner:
    """The producer's side of a slot, as the batcher tells it of a close."""

    def __init__(self, closed: Callable[[object], None]) -> None:
        self._closed = closed

    def slot_stopped(self) -> None:
        raise AssertionError("nothing stops a stream in this machine")

    def slot_closed(self, reason: object) -> None:
        self._closed(reason)


@dataclass(eq=False)
class _Stream:
    key: int
    credit: int
    anchor_id: int
    session_id: int
    eslot: EgressSlot = field(repr=False)
    islot: IngressSlot = field(repr=False)
    sent: list[bytes] = field(default_factory=list)
    """Records the batcher accepted (``offer`` returned True), in order."""
    pending: deque[bytes] = field(default_factory=deque)
    """Records the producer still waits to hand over (its byte budget was full)."""
    written: int = 0
    """Data records the batcher wrote into batches."""
    taken: list[bytes] = field(default_factory=list)
    """Data records the consumer took, in order."""
    ended: bytes | None = None
    """The terminal the consumer took."""
    finishing: bool = False
    terminal_offered: bool = False
    terminal_written: bool = False
    paused: bool = False
    dropped: bool = False
    """The consumer withdrew the feed (its anchor was cancelled)."""
    dead: bool = False
    """Epoch death closed the slot, or a refused batch carried one of its records."""
    closed_reason: object = None

    @property
    def next_value(self) -> int:
        return len(self.sent) + len(self.pending)

    @property
    def outstanding(self) -> int:
        """Data records written and not yet taken: in the buffer, or on the wire."""
        return self.written - len(self.taken)

    @property
    def buffered_data(self) -> int:
        """Data records in the consumer's buffer (a terminal there is not data)."""
        islot = self.islot
        terminal_buffered = islot.terminal and self.ended is None and not islot.withdrawn
        return len(islot) - (1 if terminal_buffered else 0)


def _pick(candidates: Sequence[_Stream], pick: int) -> _Stream:
    return candidates[pick % len(candidates)]


# -- the machine ----------------------------------------------------------------------------


class MuxMachine(RuleBasedStateMachine):
    """One producer-side batcher and one consumer-side table; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.now = 0.0
        self.streams: list[_Stream] = []
        self.by_slot: dict[int, _Stream] = {}
        self.dying = False
        # Whatever exception is being handled around the whole run (Hypothesis may replay
        # an example inside a handler): teardown compares against it, see there.
        self.ambient = sys.exc_info()[1]

    def clock(self) -> float:
        return self.now

    @initialize(
        policy=st.sampled_from(POLICIES),
        reply_linger=st.sampled_from([0.0, 0.001, 0.010]),
        floor=st.sampled_from([0.0, 0.002]),
        max_batch_bytes=st.sampled_from([128, 512, 60 * 1024]),
    )
    def setup(
        self, policy: AutoFlush | Manual, reply_linger: float, floor: float, max_batch_bytes: int
    ) -> None:
        self.config = MuxConfig(
            flush_policy=policy,
            reply_linger=reply_linger,
            drain_visit_floor=floor,
            max_batch_bytes=max_batch_bytes,
        )
        # Each node's table is named after the peer whose batches it applies.
        self.producer = _Node(CONSUMER, self.config, self.clock)
        self.consumer = _Node(PRODUCER, self.config, self.clock)
        self.ready = True

    # -- candidates ------------------------------------------------------------------------

    def _active(self) -> list[_Stream]:
        return [s for s in self.streams if s.eslot.live or (not s.dropped and s.ended is None)]

    def _senders(self) -> list[_Stream]:
        return [s for s in self.streams if s.eslot.live and not s.finishing]

    def _readers(self) -> list[_Stream]:
        return [s for s in self.streams if not s.dropped and not s.paused and len(s.islot)]

    def _droppable(self) -> list[_Stream]:
        """Streams the consumer may still drop; at most a third of all streams are dropped,
        so that most streams run to their end."""
        if 3 * sum(s.dropped for s in self.streams) >= len(self.streams):
            return []
        return [s for s in self.streams if not s.dropped and s.ended is None]

    def _blocked(self) -> list[_Stream]:
        return [s for s in self.streams if s.pending or (s.finishing and not s.terminal_offered)]

    # -- the producer ----------------------------------------------------------------------

    def _open(self, credit: int, budget: int) -> _Stream:
        key = len(self.streams)
        anchor_id, session_id = 1000 + key, 5000 + key
        islot = IngressSlot(credit, budget)
        self.consumer.registry.bind(anchor_id, session_id, islot, peer=PRODUCER)
        eslot = self.producer.batcher.open_slot(anchor_id, session_id, credit=credit, budget=budget)
        stream = _Stream(key, credit, anchor_id, session_id, eslot, islot)
        eslot.owner = _ProducerOwner(partial(self._producer_slot_closed, stream))
        previous = self.by_slot.get(eslot.slot_id)
        assert previous is None or not previous.eslot.live, "a live slot id was handed out again"
        self.by_slot[eslot.slot_id] = stream
        self.streams.append(stream)
        return stream

    def _producer_slot_closed(self, stream: _Stream, reason: object) -> None:
        stream.closed_reason = reason
        if reason == CloseReason.PEER_GONE:
            assert self.dying, "a slot closed as PeerGone without an epoch death"
            stream.dead = True
        else:
            assert reason == CloseReason.UNKNOWN_SLOT, f"the producer's slot closed: {reason!r}"
            assert stream.dropped, "the consumer closed a stream it did not drop"

    def _push(self, stream: _Stream) -> None:
        """Hand over what the producer waits to send; its send fails once the slot closed."""
        batcher = self.producer.batcher
        eslot = stream.eslot
        while stream.pending:
            if not eslot.live:
                stream.pending.clear()
                return
            if not batcher.offer(eslot, stream.pending[0], self.now):
                return  # the byte budget is full: the producer waits, the record stays
            stream.sent.append(stream.pending.popleft())
        if stream.finishing and not stream.terminal_offered and eslot.live:
            batcher.offer_terminal(eslot, FINALIZED, self.now)
            stream.terminal_offered = True

    @precondition(lambda self: len(self._active()) < MAX_LIVE and len(self.streams) < MAX_STREAMS)
    @rule(
        credit=st.integers(2, 4),
        budget=st.sampled_from([48, 160, 1 << 20]),
        count=st.integers(0, 3),
        pad=st.integers(0, 40),
    )
    def open_stream(self, credit: int, budget: int, count: int, pad: int) -> None:
        """A producer attaches and hands over its first ``count`` records at once."""
        self._hand_over(self._open(credit, budget), count, pad)

    def _hand_over(self, stream: _Stream, count: int, pad: int) -> None:
        for _ in range(count):
            stream.pending.append(encode_item([stream.key, stream.next_value, "p" * pad]))
        self._push(stream)

    @precondition(lambda self: bool(self._senders()))
    @rule(pick=st.integers(0, MAX_LIVE - 1), count=st.integers(1, 4), pad=st.integers(0, 40))
    def send(self, pick: int, count: int, pad: int) -> None:
        self._hand_over(_pick(self._senders(), pick), count, pad)

    @precondition(lambda self: bool(self._senders()))
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def finalize(self, pick: int) -> None:
        stream = _pick(self._senders(), pick)
        stream.finishing = True
        self._push(stream)

    @precondition(lambda self: bool(self._blocked()))
    @rule()
    def retry_blocked(self) -> None:
        for stream in self._blocked():
            self._push(stream)

    # -- the consumer ----------------------------------------------------------------------

    def _take_one(self, stream: _Stream) -> bool:
        body = stream.islot.take()
        if body is None:
            return False
        assert not stream.dropped, "a dropped stream delivered a record"
        assert stream.ended is None, f"{body!r} was read after the stream's terminal"
        if is_terminal_sentinel(body):
            stream.ended = body
            if body == FINALIZED:
                assert stream.terminal_offered and not stream.dead
                assert stream.taken == stream.sent, "Finalized overtook (or lost) data records"
            else:
                assert body == DROPPED, f"the stream ended with {body!r}"
                assert stream.dead, "Dropped for a stream its producer did not lose"
        else:
            position = len(stream.taken)
            assert position < stream.written, "a record was read before it was written"
            assert body == stream.sent[position], (
                f"stream {stream.key}: record {position} is not the next one its producer sent"
            )
            stream.taken.append(body)
        return True

    @precondition(lambda self: bool(self._readers()))
    @rule(pick=st.integers(0, MAX_LIVE - 1), count=st.integers(1, 5))
    def take(self, pick: int, count: int) -> None:
        stream = _pick(self._readers(), pick)
        for _ in range(count):
            if not self._take_one(stream):
                break

    @precondition(lambda self: bool(self._readers()))
    @rule()
    def read_all(self) -> None:
        """Every consumer that is reading catches up with what its buffer holds."""
        for stream in self._readers():
            while self._take_one(stream):
                pass

    @precondition(lambda self: any(not s.dropped for s in self.streams))
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def pause_or_resume(self, pick: int) -> None:
        stream = _pick([s for s in self.streams if not s.dropped], pick)
        stream.paused = not stream.paused

    @precondition(lambda self: bool(self._droppable()))
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def drop(self, pick: int) -> None:
        """The anchor was cancelled: its bind is released (if unclaimed), its feed withdrawn."""
        stream = _pick(self._droppable(), pick)
        stream.dropped = True
        self.consumer.registry.release(stream.anchor_id, stream.session_id)
        stream.islot.withdraw()

    @precondition(lambda self: self.ready)
    @rule(walk=st.booleans())
    def return_credit(self, walk: bool) -> None:
        """The doorbell visit of the drained slots (rate-limited), or the periodic walk."""
        if walk:
            self.consumer.table.sweep(self.now)
        else:
            self.consumer.table.visit_dirty(self.now)

    # -- the wire ----------------------------------------------------------------------------

    def _check_producer_batch(self, batch: OutgoingBatch) -> None:
        """What the producer wrote: its streams' records, in order, within their rules."""
        header, records = decode_batch(batch.payload)
        assert header.lane == 0 and header.peer_epoch == self.producer.batcher.epoch
        previous: tuple[int, int] | None = None
        for record_type, sid, seq, body in records:
            stream = self.by_slot.get(sid)
            assert stream is not None, f"a record for slot {sid:#x}, which was never opened"
            if record_type == RecordType.OPEN_SLOT:
                assert seq == 0 and stream.written == 0 and not stream.terminal_written
                assert decode_open_slot(body) == (stream.anchor_id, stream.session_id)
            elif record_type == RecordType.DATA:
                data = bytes(body)
                assert not stream.terminal_written, "a record after the terminal"
                assert seq == stream.written + 1, "frame_seq is not dense"
                if is_terminal_sentinel(data):
                    assert data == FINALIZED and stream.terminal_offered
                    assert stream.written == len(stream.sent), "the terminal overtook data"
                    stream.terminal_written = True
                else:
                    assert stream.written < len(stream.sent)
                    assert data == stream.sent[stream.written], "egress reordered a slot"
                    stream.written += 1
            elif record_type == RecordType.CLOSE_SLOT:
                assert previous == (RecordType.DATA, sid) and stream.terminal_written, (
                    "a CloseSlot not right after its terminal"
                )
                assert seq == stream.written + 2
                assert decode_close_slot(body) == CloseReason.TERMINAL_SENT
            else:
                raise AssertionError(f"the producer wrote a {RecordType(record_type)!r}")
            previous = (record_type, sid)

    def _check_reply_batch(self, batch: OutgoingBatch) -> None:
        """What the consumer wrote: credit and closes only, for slots it knows."""
        _, records = decode_batch(batch.payload)
        for record_type, sid, seq, body in records:
            assert seq == 0, "a reply is not sequenced"
            stream = self.by_slot.get(sid)
            assert stream is not None, f"a reply for slot {sid:#x}, which was never opened"
            if record_type == RecordType.CLOSE_SLOT:
                assert decode_close_slot(body) == CloseReason.UNKNOWN_SLOT
                assert stream.dropped, "the consumer closed a stream it did not drop"
            else:
                assert record_type == RecordType.CREDIT_UPDATE, f"a {RecordType(record_type)!r}"

    def _poll(self, node: _Node, park: bool) -> None:
        check = self._check_producer_batch if node is self.producer else self._check_reply_batch
        batches = node.batcher.poll(self.now)
        for batch in batches:
            check(batch)
        if park and batches:
            node.admitting.extend(batches)
            node.batcher.parked = True
        else:
            node.wire.extend(batch.payload for batch in batches)

    def _admit(self, node: _Node, count: int) -> None:
        for _ in range(min(count, len(node.admitting))):
            node.wire.append(node.admitting.popleft().payload)
        node.batcher.parked = bool(node.admitting)

    def _deliver(self, node: _Node, count: int) -> None:
        peer = self.consumer if node is self.producer else self.producer
        for _ in range(min(count, len(node.wire))):
            header, records = decode_batch(node.wire.popleft())
            peer.table.handle_batch(header, records, self.now)

    def _side(self, consumer: bool) -> _Node:
        return self.consumer if consumer else self.producer

    @precondition(lambda self: self.ready)
    @rule(consumer=st.booleans(), kick=st.booleans(), park=st.booleans(), dt=DELAYS)
    def poll(self, consumer: bool, kick: bool, park: bool, dt: float) -> None:
        """The clock moves on, then one side's batcher writes what is due; ``park`` holds
        the admission of what it wrote (the batcher parks until it is admitted)."""
        self.now += dt
        node = self._side(consumer)
        if kick:
            node.batcher.kick()
        self._poll(node, park)

    @precondition(lambda self: self.ready)
    @rule(consumer=st.booleans())
    def timer_fires(self, consumer: bool) -> None:
        """The clock moves to the batcher's own deadline (if it has one), and it polls."""
        node = self._side(consumer)
        deadline = node.batcher.next_deadline()
        if deadline is not None:
            self.now = max(self.now, deadline)
        self._poll(node, park=False)

    @precondition(
        lambda self: self.ready and bool(self.producer.admitting or self.consumer.admitting)
    )
    @rule(consumer=st.booleans(), count=st.integers(1, 3))
    def admit(self, consumer: bool, count: int) -> None:
        self._admit(self._side(consumer), count)

    @precondition(lambda self: self.ready and bool(self.producer.wire or self.consumer.wire))
    @rule(consumer=st.booleans(), count=st.integers(1, 4))
    def deliver(self, consumer: bool, count: int) -> None:
        self._deliver(self._side(consumer), count)

    @precondition(lambda self: self.ready)
    @rule(dt=DELAYS, kick=st.booleans())
    def round_trip(self, dt: float, kick: bool) -> None:
        """The clock moves on, both batchers write what is due (unless parked), and the
        wire delivers everything admitted."""
        self.now += dt
        for node in (self.producer, self.consumer):
            if kick:
                node.batcher.kick()
            self._poll(node, park=False)
            self._deliver(node, len(node.wire))

    # -- invariants (after every step) -------------------------------------------------------

    @invariant()
    def credit_is_never_exceeded(self) -> None:
        for stream in self.streams:
            outstanding = stream.outstanding
            assert 0 <= outstanding <= stream.credit, (
                f"stream {stream.key}: {outstanding} data records outstanding against C="
                f"{stream.credit}"
            )
            eslot = stream.eslot
            if eslot.live:
                assert eslot.credit >= 0
                assert eslot.credit + outstanding <= stream.credit, (
                    f"stream {stream.key}: the producer holds {eslot.credit} credit with "
                    f"{outstanding} records outstanding against C={stream.credit}"
                )
            islot = stream.islot
            assert len(islot) <= stream.credit + 1
            assert 0 <= stream.buffered_data <= stream.credit
            assert islot.data_delivered <= islot.granted, "ingress admitted past the grant"
            assert islot.data_delivered <= stream.written
            if stream.dropped:
                assert len(islot) == 0, "a dropped stream still holds records"
            else:
                assert islot.data_delivered == len(stream.taken) + stream.buffered_data

    @invariant()
    def ingress_never_faults(self) -> None:
        if not self.ready:
            return
        for node in (self.producer, self.consumer):
            stats = node.stats
            assert stats.reader_stall == 0, "the reader stalled"
            assert stats.protocol_errors == 0
            assert stats.hold_overflow == stats.held_records == 0
            assert stats.batch_seq_gaps == stats.generation_mismatch == 0
            assert stats.malformed_records == stats.slot_limit == stats.control_refused == 0
            unexpected = {k: n for k, n in stats.drops.items() if n and k not in BENIGN_DROPS}
            assert not unexpected, f"records dropped: {unexpected}"
            assert node.batcher.stats.control_refused == 0
        assert not any(self.producer.stats.drops.values()), "a reply was dropped"

    @invariant()
    def slot_accounting(self) -> None:
        if not self.ready:
            return
        opened = sum(1 for s in self.streams if s.islot.opened and not s.islot.closed)
        assert self.consumer.table.live_slots == self.consumer.stats.live_slots == opened
        assert self.producer.batcher.live_slots == sum(1 for s in self.streams if s.eslot.live)
        buffered = sum(s.islot.bytes_buffered for s in self.streams)
        assert self.consumer.budget.used == buffered
        assert self.producer.table.live_slots == self.consumer.batcher.live_slots == 0

    # -- teardown: finalize everything, drain everything, reconcile ---------------------------

    def _fingerprint(self) -> tuple[int, ...]:
        return (
            sum(len(s.sent) for s in self.streams),
            sum(s.written for s in self.streams),
            sum(len(s.taken) for s in self.streams),
            sum(s.ended is not None for s in self.streams),
            sum(s.terminal_offered for s in self.streams),
            self.producer.batcher.stats.records_sent,
            self.consumer.batcher.stats.records_sent,
            self.consumer.stats.records_received,
            self.producer.stats.records_received,
        )

    def _check_step(self) -> None:
        self.credit_is_never_exceeded()
        self.ingress_never_faults()
        self.slot_accounting()

    def _settle(self) -> None:
        """Run both nodes the way their drivers do until nothing moves: admit everything,
        poll each batcher after every change and at its own deadline, ring the doorbell
        after every read (at most once per floor), and read every kept stream.

        No periodic walk and no kicks, except that under ``Manual`` the application
        flushes the producer's data: every credit return here must come from the arrival
        path or the doorbell, and every write from the batchers' own deadlines.
        """
        for stream in self.streams:
            stream.paused = False
        manual = isinstance(self.config.flush_policy, Manual)
        producer, consumer, table = self.producer, self.consumer, self.consumer.table
        last: tuple[int, ...] | None = None
        for _ in range(10_000):
            for stream in self._blocked():
                self._push(stream)
            for node in (producer, consumer):
                self._admit(node, len(node.admitting))
            if manual:
                producer.batcher.kick()
            self._poll(producer, park=False)
            self._deliver(producer, len(producer.wire))
            for stream in self.streams:
                if not stream.dropped:
                    while self._take_one(stream):
                        pass
            table.visit_dirty(self.now)
            self._poll(consumer, park=False)
            self._deliver(consumer, len(consumer.wire))
            self._check_step()
            fingerprint = self._fingerprint()
            if fingerprint != last:
                last = fingerprint
                continue
            # Nothing moved at this instant: sleep until the earliest timer.
            timers = [producer.batcher.next_deadline(), consumer.batcher.next_deadline()]
            if len(table.dirty):
                timers.append(table.next_visit_at)
            due = [t for t in timers if t is not None]
            if not due:
                return
            assert min(due) > self.now, "a timer is due but polling it does nothing"
            self.now = min(due)
        raise AssertionError("the streams never settled")

    def _check_credit_returned(self) -> None:
        """At quiescence, on every stream both sides keep: credit granted equals records
        taken, and the producer holds its whole window again."""
        for stream in self.streams:
            assert not stream.pending or not stream.eslot.live, "a producer still waits"
            if stream.dropped:
                assert not stream.eslot.live, "the producer never heard of the cancel"
                continue
            if stream.dead or stream.terminal_offered:
                continue
            islot, eslot = stream.islot, stream.eslot
            assert eslot.live and islot.opened and not islot.closed
            assert stream.written == len(stream.sent) == len(stream.taken), (
                f"stream {stream.key}: of {len(stream.sent)} records sent, {stream.written} "
                f"were written and {len(stream.taken)} taken"
            )
            assert islot.granted == stream.credit + len(stream.taken), (
                f"stream {stream.key}: granted {islot.granted - stream.credit} for "
                f"{len(stream.taken)} records taken"
            )
            assert islot.withheld_credit == 0
            assert eslot.credit == islot.outstanding_credit == stream.credit, (
                f"stream {stream.key}: the producer holds {eslot.credit} of C={stream.credit}"
            )

    def _check_ended(self) -> None:
        assert self.producer.batcher.live_slots == 0
        assert self.consumer.table.live_slots == self.consumer.stats.live_slots == 0
        assert len(self.consumer.registry) == 0, "a bind was never claimed"
        assert self.consumer.budget.used == 0
        for node in (self.producer, self.consumer):
            assert not node.admitting and not node.wire
            assert node.batcher.next_deadline() is None and node.batcher.pending_closes() == 0
        for stream in self.streams:
            islot = stream.islot
            assert not stream.eslot.live and not stream.pending
            if stream.dropped:
                assert len(islot) == 0
            elif stream.dead:
                if islot.opened:
                    assert stream.ended == DROPPED and islot.exhausted
                else:
                    assert stream.ended is None and not stream.taken
            else:
                assert stream.ended == FINALIZED, f"stream {stream.key} ended {stream.ended!r}"
                assert stream.taken == stream.sent and islot.exhausted

    def teardown(self) -> None:
        # Runs in a ``finally``: when a step already failed (or the run was cut short),
        # report that failure rather than one from driving a broken state to its end.
        if not self.ready or sys.exc_info()[1] is not self.ambient:
            return
        self._settle()
        self._check_credit_returned()
        for stream in self.streams:
            if stream.eslot.live and not stream.finishing:
                stream.finishing = True
                self._push(stream)
        table_epoch = self.consumer.table.epoch
        if table_epoch is not None and table_epoch != self.producer.batcher.epoch:
            # The consumer still follows a dead epoch: a batch of the new one retires it.
            closing = self._open(2, 1 << 20)
            closing.finishing = True
            self._hand_over(closing, 1, 0)
        self._settle()
        for stream in self.streams:
            if stream.dead and not stream.islot.opened and not stream.dropped:
                # Its OpenSlot was refused with its batch: the accept window reaps the bind.
                released = self.consumer.registry.release(stream.anchor_id, stream.session_id)
                assert released is stream.islot
        self._check_ended()


class MuxEpochMachine(MuxMachine):
    """The same, where the transport may refuse the parked batches (epoch death)."""

    @precondition(lambda self: self.ready and bool(self.producer.admitting))
    @rule()
    def refuse_admission(self) -> None:
        node = self.producer
        for batch in node.admitting:
            _, records = decode_batch(batch.payload)
            for _, sid, _, _ in records:
                self.by_slot[sid].dead = True
        node.admitting.clear()
        self.dying = True
        try:
            node.batcher.epoch_death()
        finally:
            self.dying = False
        assert not node.batcher.parked and node.batcher.live_slots == 0


def _settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# A passing run takes seconds; the timeouts leave room for shrinking a failure.


@pytest.mark.timeout(900)
def test_mux_stateful() -> None:
    run_state_machine_as_test(MuxMachine, settings=_settings(200, 100))


@pytest.mark.timeout(900)
def test_mux_stateful_epoch_death() -> None:
    run_state_machine_as_test(MuxEpochMachine, settings=_settings(150, 100))


def test_a_record_staged_before_its_open_slot_leaves_on_the_linger_timer() -> None:
    """A shrunk sequence, replayed as is: under a linger policy a record offered before
    its slot's OpenSlot was written must still leave when the window ends, with no other
    wake (no more records, no credit, no kick)."""
    state = MuxMachine()
    state.setup(
        policy=AutoFlush(on_admission=False, max_linger=0.002),
        reply_linger=0.0,
        floor=0.0,
        max_batch_bytes=128,
    )
    state.open_stream(credit=2, budget=48, count=1, pad=0)
    state.teardown()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mux_stateful_extended() -> None:
    run_state_machine_as_test(MuxMachine, settings=_settings(3_000, 150))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mux_stateful_epoch_death_extended() -> None:
    run_state_machine_as_test(MuxEpochMachine, settings=_settings(2_000, 150))
