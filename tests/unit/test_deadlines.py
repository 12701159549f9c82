"""The connection's deadlines, and the shell's one loop timer that serves them."""

from __future__ import annotations

import asyncio

from velomux_quic.transport.deadlines import Deadline, Deadlines, LoopTimer


def test_deadlines_report_the_earliest_and_fire_in_order() -> None:
    deadlines = Deadlines()
    assert deadlines.next_at is None and deadlines.due(1e9) == []
    deadlines.set(Deadline.PMTU, 5.0)
    deadlines.set(Deadline.KEEP_ALIVE, 3.0)
    deadlines.set(Deadline.HANDSHAKE, 7.0)
    assert deadlines.next_at == 3.0
    deadlines.set(Deadline.KEEP_ALIVE, 6.0)  # moved, not added
    assert deadlines.next_at == 5.0
    assert deadlines.due(4.9) == []
    assert deadlines.due(6.0) == [Deadline.KEEP_ALIVE, Deadline.PMTU]
    assert deadlines.next_at == 7.0 and deadlines.get(Deadline.PMTU) is None
    deadlines.set(Deadline.HANDSHAKE, None)
    assert deadlines.next_at is None
    deadlines.set(Deadline.OPENINGS, 1.0)
    deadlines.clear()
    assert deadlines.next_at is None and deadlines.due(2.0) == []


async def test_the_loop_timer_fires_once_at_the_latest_time_it_was_moved_to() -> None:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    woke = asyncio.Event()

    def fire(now: float) -> None:
        fired.append(now)
        woke.set()

    timer = LoopTimer(loop, fire)
    start = loop.time()
    timer.wake_at(start + 0.05)
    timer.wake_at(start + 0.01)  # moved earlier: the first handle is cancelled
    timer.wake_at(start + 0.01)  # the same time again: nothing to do
    await asyncio.wait_for(woke.wait(), 5)
    assert len(fired) == 1 and fired[0] >= start + 0.01  # never before what was asked

    woke.clear()
    timer.wake_at(loop.time() + 0.01)
    timer.wake_at(None)  # nothing to wake for
    timer.soon(woke.set)
    await asyncio.wait_for(woke.wait(), 5)
    await asyncio.sleep(0.05)  # past the cancelled time: there is no event for "did not fire"
    assert len(fired) == 1
