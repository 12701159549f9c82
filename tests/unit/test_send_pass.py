"""``send_pass`` into the mux core, in memory: a real batcher and driver, a recording messenger.

The messenger double admits every batch at once and keeps its payload, so each test can
decode what would have gone on the wire and check it against what was handed over (an
oracle): per slot, frame sequence numbers 1, 2, 3... with the items in the order given,
nothing lost, nothing twice, and the batches a pass took.
"""

from __future__ import annotations

import asyncio
from typing import Any

from velomux_quic import ChannelClosed, PassOutcome, SerializationError
from velomux_quic.mux.config import Manual, MuxConfig
from velomux_quic.mux.protocol import CloseReason
from velomux_quic.streaming.frames import PACKER_BUFFER, pooled_packers
from velomux_quic.streaming.sender import send_pass

from .mux_rig import RecordingRig


async def test_send_and_send_pass_mixed_on_one_stream_keep_its_order_and_a_pass_is_one_flush() -> (
    None
):
    rig = RecordingRig(MuxConfig())
    senders = [rig.sender() for _ in range(8)]
    await rig.settle()  # the OpenSlots
    expected: list[list[Any]] = [[] for _ in senders]
    for n in range(6):
        if n % 2:
            for i, sender in enumerate(senders):
                await sender.send([i, n, "send"])
                expected[i].append([i, n, "send"])
            continue
        before = len(rig.messenger.payloads)
        pairs = [(s, [i, n, k]) for k in range(2) for i, s in enumerate(senders)]
        assert await send_pass(pairs) == PassOutcome(len(pairs))
        for _, item in pairs:
            expected[item[0]].append(item)
        await rig.settle()
        assert len(rig.messenger.payloads) - before == 1  # the whole pass in one batch
    await rig.settle()
    assert rig.data() == rig.expect(expected)


async def test_a_pass_past_credit_and_budget_leaves_the_rest_over_until_credit_is_granted() -> None:
    rig = RecordingRig(MuxConfig(initial_credit=2, slot_byte_budget=100))
    stalled, other = rig.sender(), rig.sender()
    await rig.settle()
    items = [f"{n:02d}" + "x" * 30 for n in range(10)]
    pairs = [(stalled, item) for item in items] + [(other, "a"), (other, "b")]
    first = await send_pass(pairs)
    # Nothing was packed yet, so the budget stops the stalled stream at three records.
    assert first == PassOutcome(5, tuple(range(3, 10)))
    await rig.settle()
    assert stalled.credit == 0 and stalled.queued_bytes > 0  # two sent, one withheld
    assert rig.metrics.producer_send_backpressure == 7
    waiting = asyncio.ensure_future(
        send_pass([pairs[index] for index in first.left], wait=True, timeout=5)
    )
    slot_id = rig.channels[0].slot.slot_id
    for _ in range(20):  # the consumer grants two credits at a time until all is taken
        await rig.settle()
        if waiting.done():
            break
        assert rig.batcher.on_credit(slot_id, 2, rig.driver.now())
        rig.driver.wake()
    assert waiting.result() == PassOutcome(7)
    for _ in range(3):
        rig.batcher.on_credit(slot_id, 2, rig.driver.now())
        rig.driver.wake()
        await rig.settle()
    assert rig.data() == rig.expect([items, ["a", "b"]])
    # The second call counted its own left-overs once each, never again while waiting.
    assert 7 < rig.metrics.producer_send_backpressure <= 7 + 7


async def test_manual_stages_a_pass_until_the_kick() -> None:
    rig = RecordingRig(MuxConfig(flush_policy=Manual()))
    senders = [rig.sender() for _ in range(4)]
    await rig.settle()
    opens = len(rig.messenger.payloads)
    assert await send_pass([(s, i) for i, s in enumerate(senders)]) == PassOutcome(4)
    await rig.settle()
    assert len(rig.messenger.payloads) == opens  # staged, not written
    rig.batcher.kick()
    rig.driver.wake()
    await rig.settle()
    assert rig.data() == rig.expect([[0], [1], [2], [3]])


async def test_a_slot_closed_by_the_peer_and_an_unencodable_item_fail_only_their_pairs() -> None:
    rig = RecordingRig(MuxConfig())
    closed, live = rig.sender(), rig.sender()
    await rig.settle()
    assert rig.batcher.on_peer_close(rig.channels[0].slot.slot_id, CloseReason.UNKNOWN_SLOT)
    assert closed.is_cancelled
    outcome = await send_pass([(closed, 0), (live, 1), (live, {1, 2}), (live, 3), (closed, 4)])
    assert outcome.taken == 2 and outcome.left == ()
    assert sorted(outcome.failed) == [0, 2, 4]
    assert isinstance(outcome.failed[0], ChannelClosed)
    assert isinstance(outcome.failed[2], SerializationError)
    await rig.settle()
    assert rig.data() == rig.expect([[], [1, 3]])
    assert live.state == "open" and closed.state == "cancelled"


async def test_an_item_larger_than_a_batch_goes_alone_and_the_packer_that_grew_is_not_pooled() -> (
    None
):
    rig = RecordingRig(MuxConfig())
    small, large = rig.sender(), rig.sender()
    await rig.settle()
    pooled = pooled_packers()
    big = b"b" * (PACKER_BUFFER + 1000)  # past a batch, and past a pooled packer's buffer
    pairs = [(small, 0), (large, big), (small, 1), (large, "after")]
    assert await send_pass(pairs) == PassOutcome(4)
    assert pooled_packers() == pooled - 1  # it grew: dropped, not given back
    for _ in range(3):
        await rig.settle()
    assert rig.data() == rig.expect([[0, 1], [big, "after"]])
