"""Running an entry point on the best event loop available, without touching global policy.

uvloop nearly doubles batched throughput and halves the consumer's CPU, so our own entry
points use it when it is installed. The library itself never sets a loop policy: it runs
on whatever loop it is called from.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory when installed and not disabled with ``VELOMUX_NO_UVLOOP=1``."""
    if os.environ.get("VELOMUX_NO_UVLOOP", "").lower() in ("1", "true", "yes", "on"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
