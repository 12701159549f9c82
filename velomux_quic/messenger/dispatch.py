"""Ordered dispatch: one queue per (handler, sender, lane), drained by one task while busy.

Order is the transport's: frames of one (sender, lane) arrive in order, and each queue hands
them to its coroutine handler one at a time. Different senders and lanes have different
queues, so a slow handler holds up only the messages behind it. A queue's task exists only
while the queue has work, so idle (sender, lane) pairs cost nothing.

Queues are bounded by backpressure rather than by dropping: past ``max_backlog`` messages
the transport stops reading that (sender, lane), its flow-control window closes, and the
sender's sends go Pending until the handler catches up (to half the backlog).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from ..ids import InstanceId

__all__ = ["OrderedDispatcher"]

logger = logging.getLogger(__name__)

Job = tuple[Any, ...]
Runner = Callable[[Job], Coroutine[Any, Any, None]]
LaneKey = tuple[InstanceId, int]


class _Queue:
    __slots__ = ("handler", "items", "lane_key", "paused", "task")

    def __init__(self, handler: str, lane_key: LaneKey) -> None:
        self.handler = handler
        self.lane_key = lane_key
        self.items: deque[tuple[float, Job]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.paused = False


class OrderedDispatcher:
    """Runs jobs in arrival order per key; see the module docstring."""

    def __init__(
        self,
        run: Runner,
        *,
        max_backlog: int,
        pause: Callable[[InstanceId, int], None],
        resume: Callable[[InstanceId, int], None],
        observe_wait: Callable[[str, float], None],
    ) -> None:
        self._run = run
        self._max_backlog = max_backlog
        self._pause = pause
        self._resume = resume
        self._observe_wait = observe_wait
        self._queues: dict[tuple[str, InstanceId, int], _Queue] = {}
        self._paused: dict[LaneKey, int] = {}
        self._spawned: set[asyncio.Task[None]] = set()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        """The messenger's loop, taken at the first job: ``asyncio.get_running_loop()``
        makes a ``getpid()`` system call each time on Python 3.11."""

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def queues(self) -> int:
        """Live (handler, sender, lane) queues: only those with work exist."""
        return len(self._queues)

    def depth(self) -> int:
        """Messages waiting in every queue, not yet handled."""
        return sum(len(q.items) for q in self._queues.values())

    def submit(self, handler: str, sender: InstanceId, lane: int, job: Job) -> None:
        """Queue ``job`` behind the earlier messages of (handler, sender, lane); pause the lane
        at the backlog bound."""
        if self._closed:
            return
        key = (handler, sender, lane)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(handler, (sender, lane))
        queue.items.append((time.monotonic(), job))
        if not queue.paused and len(queue.items) >= self._max_backlog:
            queue.paused = True
            self._pause_lane(queue.lane_key)
        if queue.task is None:
            queue.task = self._running_loop().create_task(self._drain(key, queue))

    def spawn(self, job: Job) -> None:
        """Run one job concurrently, in no particular order (``dispatch="spawn"``)."""
        if self._closed:
            return
        task = self._running_loop().create_task(self._run(job))
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def _drain(self, key: tuple[str, InstanceId, int], queue: _Queue) -> None:
        items = queue.items
        try:
            while items:
                enqueued, job = items.popleft()
                self._observe_wait(queue.handler, time.monotonic() - enqueued)
                await self._run(job)  # the runner reports handler failures itself
                if queue.paused and len(items) <= self._max_backlog // 2:
                    queue.paused = False
                    self._resume_lane(queue.lane_key)
        finally:
            queue.task = None
            if not items and self._queues.get(key) is queue:
                del self._queues[key]
                if queue.paused:
                    queue.paused = False
                    self._resume_lane(queue.lane_key)

    def _pause_lane(self, lane_key: LaneKey) -> None:
        count = self._paused.get(lane_key, 0)
        self._paused[lane_key] = count + 1
        if count == 0:
            logger.info(
                "pausing %s lane %d: ordered backlog reached %d", *lane_key, self._max_backlog
            )
            self._pause(*lane_key)

    def _resume_lane(self, lane_key: LaneKey) -> None:
        count = self._paused.get(lane_key, 0) - 1
        if count <= 0:
            self._paused.pop(lane_key, None)
            self._resume(*lane_key)
        else:
            self._paused[lane_key] = count

    async def close(self) -> None:
        """Stop every queue and spawned job; queued messages are dropped."""
        self._closed = True
        tasks = [q.task for q in self._queues.values() if q.task is not None]
        tasks.extend(self._spawned)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._queues.clear()
        self._spawned.clear()
