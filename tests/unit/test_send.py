"""``StreamSender.send`` into the mux core, in memory (the rig of ``mux_rig``): the call
takes the item when the stream has room and returns an awaitable already done; otherwise
it returns the wait for room. Either is awaited, made a task of and cancelled as a
coroutine is."""

from __future__ import annotations

import asyncio

import pytest

from velomux_quic import ChannelClosed, SendTimeout, SerializationError
from velomux_quic.mux.config import MuxConfig
from velomux_quic.streaming.sender import SENT, StreamSender

from .mux_rig import RecordingRig

ITEM = "x" * 40
"""A record of about 50 bytes: two fill the slot byte budget of :func:`_tight_rig`."""


def _tight_rig() -> RecordingRig:
    return RecordingRig(MuxConfig(initial_credit=2, slot_byte_budget=100))


async def _fill(rig: RecordingRig, sender: StreamSender) -> int:
    """Spend the stream's credit and then its byte budget: no send can be taken until the
    consumer grants credit. The number of items taken."""
    taken = 0
    for _ in range(2):
        while sender.try_send(ITEM):
            taken += 1
        await rig.settle()  # what credit allows goes out
    assert sender.credit == 0 and not sender.try_send(ITEM)
    return taken


async def test_a_send_with_room_takes_the_item_in_the_call_and_returns_one_done() -> None:
    rig = RecordingRig(MuxConfig())
    sender = rig.sender()
    await rig.settle()
    pending = sender.send("a")
    assert pending is SENT
    assert sender.queued_bytes > 0  # taken by the call, before any await
    assert await pending is None
    assert await SENT is None  # it holds nothing: awaited again, it is still done
    task = asyncio.create_task(sender.send("b"))  # a task takes it like a coroutine
    assert "coro=<StreamSender.send()>" in repr(task)  # named as the coroutine would be
    assert await task is None
    await rig.settle()
    assert rig.data() == rig.expect([["a", "b"]])


async def test_a_send_without_room_returns_the_wait_which_takes_the_item_once_room_opens() -> None:
    rig = _tight_rig()
    sender = rig.sender()
    await rig.settle()
    taken = await _fill(rig, sender)
    backpressure = rig.metrics.producer_send_backpressure
    waiting = sender.send("last")
    assert waiting is not SENT and asyncio.iscoroutine(waiting)
    task = asyncio.create_task(waiting)
    await rig.settle()
    assert not task.done(), "send() must wait while the stream has no room"
    assert rig.metrics.producer_send_backpressure == backpressure + 1
    slot_id = rig.channels[0].slot.slot_id
    for _ in range(4):  # the consumer grants credit: the wait ends, everything goes out
        rig.batcher.on_credit(slot_id, 2, rig.driver.now())
        rig.driver.wake()
        await rig.settle()
    assert task.result() is None
    assert rig.data() == rig.expect([[ITEM] * taken + ["last"]])


async def test_a_wait_cancelled_or_timed_out_takes_nothing_and_the_stream_goes_on() -> None:
    rig = _tight_rig()
    sender = rig.sender()
    await rig.settle()
    sent = await _fill(rig, sender)
    with pytest.raises(SendTimeout, match="was not sent"):
        await sender.send("timed out", timeout=0.01)
    task = asyncio.create_task(sender.send("cancelled"))
    await rig.settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    slot_id = rig.channels[0].slot.slot_id
    for _ in range(4):
        rig.batcher.on_credit(slot_id, 2, rig.driver.now())
        rig.driver.wake()
        await rig.settle()
    await sender.send("after")
    await rig.settle()
    assert rig.data() == rig.expect([[ITEM] * sent + ["after"]])


async def test_a_send_that_cannot_be_taken_raises_from_the_call() -> None:
    rig = RecordingRig(MuxConfig())
    sender = rig.sender()
    await rig.settle()
    with pytest.raises(SerializationError):
        sender.send(object())  # nothing to await: the call raises
    sender.finalize()
    with pytest.raises(ChannelClosed, match="the stream has ended"):
        sender.send("late")


def test_the_done_awaitable_runs_the_coroutine_protocol() -> None:
    with pytest.raises(StopIteration):
        SENT.send(None)
    with pytest.raises(StopIteration):
        next(iter(SENT.__await__()))
    with pytest.raises(ValueError, match="thrown"):
        SENT.throw(ValueError("thrown"))
    with pytest.raises(KeyError):
        SENT.throw(KeyError)
    SENT.close()  # nothing to close


async def test_a_turns_sends_schedule_one_wake_and_a_later_send_the_next() -> None:
    rig = RecordingRig(MuxConfig())
    senders = [rig.sender() for _ in range(3)]
    await rig.settle()  # the OpenSlots
    wakes = rig.driver.wakes[0]
    written = len(rig.messenger.payloads)
    for sender in senders:
        assert sender.try_send("a")
    assert rig.batcher.wake_pending
    await rig.settle()
    assert not rig.batcher.wake_pending
    assert rig.driver.wakes[0] == wakes + 1  # one wake wrote the turn's three records
    assert len(rig.messenger.payloads) == written + 1
    assert senders[0].try_send("b")  # after the wake ran: the next one is scheduled
    assert rig.batcher.wake_pending
    await rig.settle()
    assert rig.data() == rig.expect([["a", "b"], ["a"], ["a"]])
    rig.driver.close()
    assert not rig.batcher.wake_pending
