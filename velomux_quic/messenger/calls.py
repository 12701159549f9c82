"""Calls waiting for an answer (``am_sync`` acks and ``unary`` responses).

An answer is accepted only from the peer the call went to: message ids are ours, but the
peer is proven by its certificate, so another node cannot complete (or fail) our call by
guessing an id.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from ..errors import CallError, UnaryTimeout
from ..ids import InstanceId

__all__ = ["PendingCalls"]


class _Call:
    __slots__ = ("future", "handler", "peer", "timer")

    def __init__(self, peer: InstanceId, handler: str, future: asyncio.Future[Any]) -> None:
        self.peer = peer
        self.handler = handler
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class PendingCalls:
    """Message id -> waiting call, with per-call timeouts on the loop's timer wheel."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        """The messenger's loop, taken at the first call: ``asyncio.get_running_loop()``
        makes a ``getpid()`` system call each time on Python 3.11."""

    def __len__(self) -> int:
        return len(self._calls)

    def start(
        self, peer: InstanceId, handler: str, timeout: float
    ) -> tuple[int, asyncio.Future[Any]]:
        """Register a call to ``peer``'s ``handler``: its message id and the future its answer
        (or its UnaryTimeout after ``timeout`` s) completes."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        message_id = next(self._ids) & 0xFFFF_FFFF_FFFF_FFFF or next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        call = _Call(peer, handler, future)
        call.timer = loop.call_later(timeout, self._timed_out, message_id, timeout)
        self._calls[message_id] = call
        future.add_done_callback(lambda _: self._forget(message_id))
        return message_id, future

    def resolve(self, peer: InstanceId, message_id: int, result: Any) -> bool:
        """Complete the call ``message_id`` with ``result``; False when no call of ``peer``'s
        has that id."""
        call = self._calls.get(message_id)
        if call is None or call.peer != peer:
            return False
        if not call.future.done():
            call.future.set_result(result)
        return True

    def fail(self, peer: InstanceId, message_id: int, error: CallError) -> bool:
        """Fail the call ``message_id`` with ``error``; False when no call of ``peer``'s has
        that id."""
        call = self._calls.get(message_id)
        if call is None or call.peer != peer:
            return False
        if not call.future.done():
            call.future.set_exception(error)
        return True

    def fail_peer(self, peer: InstanceId, make_error: Callable[[str], CallError]) -> int:
        """Fail every call waiting on ``peer`` (its connection died)."""
        failed = 0
        for call in [c for c in self._calls.values() if c.peer == peer]:
            if not call.future.done():
                call.future.set_exception(make_error(call.handler))
                failed += 1
        return failed

    def fail_all(self, make_error: Callable[[str], CallError]) -> None:
        """Fail every waiting call (the messenger closed)."""
        for call in list(self._calls.values()):
            if not call.future.done():
                call.future.set_exception(make_error(call.handler))

    def _timed_out(self, message_id: int, timeout: float) -> None:
        call = self._calls.get(message_id)
        if call is not None and not call.future.done():
            call.future.set_exception(
                UnaryTimeout(
                    f"no answer from {call.peer} to {call.handler!r} within {timeout:.3g} s",
                    peer=call.peer,
                    handler=call.handler,
                )
            )

    def _forget(self, message_id: int) -> None:
        call = self._calls.pop(message_id, None)
        if call is not None and call.timer is not None:
            call.timer.cancel()
