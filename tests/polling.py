"""The one bounded poll of the test suite, for a state that no event announces.

Most waits in the tests await an event the library or a recorder sets. A few states have
none: a snapshot value (a connection held by the peer's window, a sender's credit), a
counter a hostile peer drives, a peer list fed by a discovery watch. Those tests poll this
one helper: bounded in time, and failing with what was awaited rather than a bare
TimeoutError from somewhere inside the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["poll_until"]


async def poll_until(
    predicate: Callable[[], bool],
    what: str = "",
    *,
    timeout: float = 10.0,
    interval: float = 0.01,
) -> None:
    """Return once ``predicate()`` holds; check it every ``interval`` seconds for at most
    ``timeout`` seconds, then fail with an AssertionError naming ``what`` (or the
    predicate) and the time waited."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or predicate}")
        await asyncio.sleep(interval)
