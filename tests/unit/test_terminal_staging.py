"""A terminal handed over in the turn of its stream's last records follows them: in memory, a
real mux batcher and driver, a recording messenger (``mux_rig``).

A decode loop ends its streams right after their last tokens, without a turn between. The
records of that turn leave in one batch first; the terminals are staged after that batch
was handed to the transport, and leave in the next. A terminal with no record of its turn
waiting is staged at once, and so is a Detached (the next sender waits for it). A stream
cancelled or a driver closed between the two retires Discarded, and its terminal never goes
on the wire.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from velomux_quic import Retired
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.protocol import CloseReason, RecordType, decode_batch
from velomux_quic.streaming.frames import DETACHED, FINALIZED, encode_item

from .mux_rig import RecordingRig

STREAMS = 8


def batch_bodies(payload: bytes) -> list[bytes]:
    """The bodies of one batch's Data records, in order."""
    _, records = decode_batch(payload)
    return [bytes(body) for record_type, _, _, body in records if record_type == RecordType.DATA]


async def test_terminals_handed_over_in_the_turn_of_the_last_records_follow_them() -> None:
    rig = RecordingRig(MuxConfig())
    senders = [rig.sender() for _ in range(STREAMS)]
    await rig.settle()
    before = len(rig.messenger.payloads)
    for index, sender in enumerate(senders):  # one turn: the last pass, then the ends
        assert sender.try_send(["last", index])
    retired = [sender.finalize() for sender in senders]
    assert all(sender.state == "finished" for sender in senders)  # at once, as before
    assert all(
        sender.queued_bytes == len(encode_item(["last", i])) for i, sender in enumerate(senders)
    )  # the records wait; the terminals are not staged yet
    outcomes = await asyncio.wait_for(asyncio.gather(*retired), 5)
    assert outcomes == [Retired.SENT] * STREAMS
    written = [batch_bodies(payload) for payload in rig.messenger.payloads[before:]]
    assert written == [
        [encode_item(["last", index]) for index in range(STREAMS)],
        [FINALIZED] * STREAMS,
    ]


@pytest.mark.parametrize("yield_before_ends", [True, False])
async def test_the_cpu_is_given_up_once_between_the_records_and_their_turns_ends(
    monkeypatch: pytest.MonkeyPatch, yield_before_ends: bool
) -> None:
    """A consumer on this host that the records woke is queued on this core: it runs before
    the ends' staging, unless ``yield_before_ends`` is off."""
    rig = RecordingRig(MuxConfig(yield_before_ends=yield_before_ends))
    senders = [rig.sender() for _ in range(STREAMS)]
    await rig.settle()
    before = len(rig.messenger.payloads)
    batches_at_yield: list[int] = []
    monkeypatch.setattr(
        os, "sched_yield", lambda: batches_at_yield.append(len(rig.messenger.payloads) - before)
    )
    for index, sender in enumerate(senders):
        assert sender.try_send(["last", index])
    retired = [sender.finalize() for sender in senders]
    assert await asyncio.wait_for(asyncio.gather(*retired), 5) == [Retired.SENT] * STREAMS
    assert len(rig.messenger.payloads) - before == 2  # the records' batch, the terminals'
    # Once, after the records' batch was written and before the terminals' was.
    assert batches_at_yield == ([1] if yield_before_ends else [])


async def test_a_lone_terminal_gives_up_no_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    yields: list[None] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(None))
    rig = RecordingRig(MuxConfig())
    sender = rig.sender()
    await rig.settle()
    assert await asyncio.wait_for(sender.finalize(), 5) is Retired.SENT
    assert yields == []


async def test_a_detached_goes_with_the_records_of_its_turn() -> None:
    """The next sender's attach is taken once the Detached arrived: it waits for nothing."""
    rig = RecordingRig(MuxConfig())
    sender = rig.sender()
    await rig.settle()
    before = len(rig.messenger.payloads)
    assert sender.try_send("last")
    retired = sender.detach()
    assert sender.queued_bytes == len(encode_item("last")) + len(DETACHED)  # staged in the call
    assert await asyncio.wait_for(retired, 5) is Retired.SENT
    assert [batch_bodies(p) for p in rig.messenger.payloads[before:]] == [
        [encode_item("last"), DETACHED]
    ]


async def test_a_terminal_with_no_record_of_its_turn_waiting_is_staged_at_once() -> None:
    rig = RecordingRig(MuxConfig())
    sender = rig.sender()
    await rig.settle()
    assert sender.try_send("only")
    await rig.settle()  # the record left in its own turn
    before = len(rig.messenger.payloads)
    retired = sender.finalize()
    assert sender.queued_bytes == len(FINALIZED)  # staged in the call
    assert await asyncio.wait_for(retired, 5) is Retired.SENT
    assert [batch_bodies(p) for p in rig.messenger.payloads[before:]] == [[FINALIZED]]


async def test_a_stream_cancelled_before_its_terminal_was_staged_retires_discarded() -> None:
    rig = RecordingRig(MuxConfig())
    kept, cancelled = rig.sender(), rig.sender()
    await rig.settle()
    before = len(rig.messenger.payloads)
    assert kept.try_send("kept") and cancelled.try_send("cancelled")
    ends = kept.finalize(), cancelled.finalize()
    # The consumer's cancel reaches the slot before the terminals are staged.
    rig.batcher.close_slot(rig.channels[1].slot, CloseReason.PEER_GONE)
    assert cancelled.is_cancelled
    outcomes = await asyncio.wait_for(asyncio.gather(*ends), 5)
    assert list(outcomes) == [Retired.SENT, Retired.DISCARDED]
    bodies = [body for p in rig.messenger.payloads[before:] for body in batch_bodies(p)]
    assert bodies == [encode_item("kept"), FINALIZED]


async def test_a_driver_closed_before_the_terminals_were_staged_retires_them_discarded() -> None:
    rig = RecordingRig(MuxConfig())
    senders = [rig.sender() for _ in range(STREAMS)]
    await rig.settle()
    for sender in senders:
        assert sender.try_send("last")
    retired = [sender.finalize() for sender in senders]
    rig.batcher.epoch_death()  # as the mux transport closes a lane: its slots end
    rig.driver.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*retired), 5)
    assert outcomes == [Retired.DISCARDED] * STREAMS
