"""How the programs run: on the best event loop available, without touching global policy,
and with the library's deprecation warnings shown to the operator.

uvloop nearly doubles batched throughput and halves the consumer's CPU, so our own entry
points use it when it is installed. The library itself never sets a loop policy: it runs
on whatever loop it is called from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import warnings
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = [
    "ENGINE_LOGGERS",
    "loop_factory",
    "quiet_engine_loggers",
    "run",
    "show_deprecated_settings",
]

T = TypeVar("T")

ENGINE_LOGGERS = ("quic", "http3")
"""The loggers aioquic and qh3 log to (both use these names)."""


def quiet_engine_loggers(*, debug: bool) -> None:
    """Keep the QUIC engine's own log records out of a command's output unless asked
    for debug: aioquic logs several INFO lines per connection, and a WARNING line
    (``Error: 304, reason: untrusted_chain``) for each handshake refused, which the
    library already reports as a typed error and its own lifecycle events. Its ERROR
    records still show."""
    for name in ENGINE_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.ERROR)


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


def show_deprecated_settings() -> None:
    """Show the warning a deprecated environment variable raises as a log record.

    Python hides a DeprecationWarning not raised in ``__main__``; an operator who still sets
    an old variable must read that it goes away in the next release, on standard error
    with the program's other log records."""
    logging.captureWarnings(True)
    warnings.filterwarnings("default", message="environment variable ", category=DeprecationWarning)
