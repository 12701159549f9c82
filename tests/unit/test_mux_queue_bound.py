"""The lane queue bound (``MuxConfig.peer_queue_bytes``), sans-IO and in memory.

What a (peer, lane) batcher holds staged across all its slots is bounded: past the bound a
producer whose stream already has records queued waits (``send``), or is refused at once
(``try_send``, ``send_pass``), until the transport takes data; a stream with nothing
queued always stages one record, so no stream is shut out by the others. The transport is
a real :class:`LaneGate` whose room the test opens and closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from velomux_quic.errors import ConfigurationError
from velomux_quic.ids import InstanceId
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.egress import EgressBatcher
from velomux_quic.mux.protocol import CloseReason, LifecycleAction, RecordType, decode_batch
from velomux_quic.streaming.sender import Retired, send_pass
from velomux_quic.transport.admission import LaneGate, SendOutcome

from .mux_rig import Rig

KiB = 1024
ITEM = b"x" * 1000  # one record of about 1 KiB once encoded


class GatedMessenger:
    """Hands every batch to a real LaneGate whose room the test controls."""

    def __init__(self) -> None:
        self.room = 0
        self.written: list[bytes] = []
        self.gate = LaneGate(lambda: self.room, lambda: False, self.written.append)
        self.releases: list[Callable[[str], None]] = []
        """What a staged payload's release would tell, one per staged batch, in order."""

    def send_message_on_lane(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        payload: Any,
        headers: Any = None,
        on_staged_release: Callable[[str], None] | None = None,
    ) -> SendOutcome:
        if on_staged_release is not None:
            self.releases.append(on_staged_release)
        return self.gate.send(bytes(payload))

    def open(self) -> int:
        """The transport took everything: room for all, admit what waits."""
        self.room = 1 << 40
        return self.gate.poll()

    def data_records(self) -> int:
        count = 0
        for payload in self.written:
            _, records = decode_batch(payload)
            count += sum(1 for record in records if record[0] == RecordType.DATA)
        return count


def gated_rig(config: MuxConfig) -> Rig[GatedMessenger]:
    return Rig(config, GatedMessenger())


def config(**overrides: Any) -> MuxConfig:
    values: dict[str, Any] = {"peer_queue_bytes": 16 * KiB, "initial_credit": 10_000}
    values.update(overrides)
    return MuxConfig(**values)


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="peer_queue_bytes"):
        MuxConfig(peer_queue_bytes=0)


def test_offer_refuses_a_non_empty_slot_past_the_bound_and_packing_gives_the_room_back() -> None:
    b = EgressBatcher(0, config())
    first, second = (b.open_slot(anchor_id=i, session_id=10 + i) for i in range(2))
    b.poll(0.0)  # the OpenSlots
    taken = 0
    while b.offer(first, ITEM, 0.0):
        taken += 1
    assert taken == 16 * KiB // len(ITEM) + 1  # checked before adding, like the slot budget
    assert b.queued_bytes == taken * len(ITEM) == first.queued_bytes
    assert b.stats.queue_full == 1
    assert not b.has_room(first)
    # A slot holding nothing still stages one record, then waits like the others.
    assert b.has_room(second) and b.offer(second, ITEM, 0.0)
    assert not b.offer(second, ITEM, 0.0) and not b.has_room(second)
    assert b.snapshot().queued_bytes == b.queued_bytes
    assert b.snapshot().queue_limit == 16 * KiB
    out = b.poll(0.0)
    sent = sum(1 for batch in out for record in decode_batch(batch.payload)[1] if record[0] == 0)
    assert sent == taken + 1
    assert b.queued_bytes == 0 and b.has_room(first) and b.has_room(second)


def test_closes_end_now_and_epoch_death_return_their_bytes_to_the_bound() -> None:
    b = EgressBatcher(0, config(initial_credit=1))
    slots = [b.open_slot(anchor_id=i, session_id=10 + i) for i in range(3)]
    b.poll(0.0)
    for slot in slots:
        for _ in range(4):
            assert b.offer(slot, ITEM, 0.0)
    b.poll(0.0)  # one record each goes (credit 1); three each are withheld
    assert b.queued_bytes == 3 * 3 * len(ITEM)
    assert b.on_peer_close(slots[0].slot_id, CloseReason.UNKNOWN_SLOT)
    assert b.queued_bytes == 2 * 3 * len(ITEM)
    b.end_now(slots[1], b"end", 0.0)
    assert b.queued_bytes == 3 * len(ITEM) + len(b"end")
    assert b.on_lifecycle(slots[2].session_id, LifecycleAction.CANCEL) is slots[2]
    assert b.queued_bytes == len(b"end")
    b.epoch_death()
    assert b.queued_bytes == 0


async def test_send_waits_at_the_bound_and_resumes_when_the_transport_takes_data() -> None:
    rig = gated_rig(config())
    sender = rig.sender()
    await rig.settle()  # the OpenSlot's batch waits in the gate: the batcher is parked
    assert rig.batcher.parked
    taken = 0
    while sender.try_send(ITEM):  # fails fast at the bound, never waits
        taken += 1
    assert rig.metrics.producer_send_backpressure == 1
    held = rig.batcher.queued_bytes
    assert 16 * KiB <= held <= 16 * KiB + len(ITEM) + 8
    waiting = asyncio.ensure_future(sender.send(ITEM))
    await rig.settle()
    assert not waiting.done(), "send() must wait while the lane queue is full"
    assert rig.metrics.producer_send_backpressure == 2
    assert rig.batcher.queued_bytes == held  # nothing more was staged while it waited
    rig.messenger.open()  # the transport admits the OpenSlot: the batcher drains
    await asyncio.wait_for(waiting, 5)
    await rig.settle()
    rig.messenger.open()
    await rig.settle()
    assert rig.messenger.data_records() == taken + 1  # every record, once
    assert rig.batcher.queued_bytes == 0


async def test_send_pass_leaves_pairs_over_at_the_bound_and_its_wait_resumes() -> None:
    rig = gated_rig(config())
    senders = [rig.sender() for _ in range(4)]
    await rig.settle()
    pairs = [(sender, b"y" * 3000) for _ in range(3) for sender in senders]
    outcome = await send_pass(pairs)
    # Each stream gets its first record in; past the bound the later ones are left over.
    assert outcome.taken < len(pairs) and outcome.left and not outcome.failed
    assert rig.batcher.queued_bytes <= 16 * KiB + 4 * 3100
    rest = [pairs[index] for index in outcome.left]
    finishing = asyncio.ensure_future(send_pass(rest, wait=True, timeout=5))
    await rig.settle()
    assert not finishing.done()
    for _ in range(20):
        rig.messenger.open()
        await rig.settle()
        if finishing.done():
            break
    assert (await finishing).complete


async def test_memory_stays_bounded_with_many_producers_against_a_stalled_transport() -> None:
    rig = gated_rig(config(peer_queue_bytes=32 * KiB))
    senders = [rig.sender() for _ in range(64)]
    await rig.settle()
    tasks = [asyncio.ensure_future(s.send(ITEM)) for s in senders for _ in range(40)]
    await rig.settle()
    limit = 32 * KiB + 64 * (len(ITEM) + 8)  # the bound plus one record per live slot
    assert rig.batcher.queued_bytes <= limit
    assert sum(task.done() for task in tasks) < len(tasks) // 4
    while not all(task.done() for task in tasks):
        rig.messenger.open()
        rig.messenger.room = 0  # the next batch waits again: the bound holds throughout
        await rig.settle()
        assert rig.batcher.queued_bytes <= limit
    rig.messenger.open()
    await rig.settle()
    assert rig.messenger.data_records() == len(tasks)


@pytest.mark.parametrize(
    ("release", "outcome"), [("pulled", Retired.SENT), ("refused", Retired.DISCARDED)]
)
async def test_a_staged_record_decides_its_streams_retirement_when_it_is_released(
    release: str, outcome: Retired
) -> None:
    rig = gated_rig(config())
    sender = rig.sender()
    rig.messenger.open()
    await rig.settle()
    await sender.send(b"z" * 200_000)  # past any batch and the eager budget: staged
    retired = sender.finalize()
    await rig.settle()
    assert len(rig.messenger.releases) == 1
    assert not retired.done(), "the terminal waits behind the staged record's fence"
    rig.messenger.releases[0](release)
    await rig.settle()
    assert retired.done() and retired.result() is outcome
    # Refused: the stream ended on the producer too (its slot closed, it was cancelled).
    assert sender.is_cancelled is (release != "pulled")
    assert rig.batcher.queued_bytes == 0
