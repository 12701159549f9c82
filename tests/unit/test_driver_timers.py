"""A batcher's linger timer writes what it was armed for, once, even when the loop runs it early.

An event loop runs a timer up to its clock's resolution before the time it was armed for:
uvloop's clock counts whole milliseconds, so a reply linger of under a millisecond is run
while the loop's clock still reads the time the linger began. Polled at that time, the
reply was not due, nothing was written, and the timer was armed again for the same past
deadline: it fired at every loop iteration until the clock moved on, a busy loop of up to a
millisecond after every credit return. In memory: a real batcher and driver, a messenger
double that records the batches (``mux_rig``), on each test loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.protocol import RecordType, decode_batch

from .mux_rig import RecordingMessenger, Rig

LINGER = 0.0004
"""Under uvloop's millisecond: its timer runs at the next loop iteration, in the same
millisecond as the reply it was armed for."""


class SignallingMessenger(RecordingMessenger):
    """Records every batch and resolves ``written`` at the first."""

    def __init__(self) -> None:
        super().__init__()
        self.written: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def send_message_on_lane(self, *args: Any, **kwargs: Any) -> None:
        super().send_message_on_lane(*args, **kwargs)
        if not self.written.done():
            self.written.set_result(None)


async def test_a_lingering_credit_reply_is_written_by_one_timer_wake() -> None:
    rig = Rig(MuxConfig(reply_linger=LINGER), SignallingMessenger())
    driver = rig.driver
    driver.batcher.reply_credit(7, 3, driver.now())
    driver.wake()  # the reply is not due yet: this wake writes nothing and arms the linger
    await asyncio.wait_for(rig.messenger.written, 5.0)

    # The timer ran once (or not at all, where the clock moved on before the first wake's
    # poll): no poll found the deadline it was armed for not due yet.
    assert driver.wakes[1] <= 1
    [payload] = rig.messenger.payloads
    _, records = decode_batch(payload)
    assert [(record_type, slot) for record_type, slot, _, _ in records] == [
        (RecordType.CREDIT_UPDATE, 7)
    ]
    assert driver.batcher.next_deadline() is None  # nothing left to linger for
