"""Lifecycle events as log lines: one event per line, ``event key=value ...``.

A node says what happens to it (start, the address it listens on, peers connected and
lost, attaches refused, drain, close) at INFO, and what happens to its streams at DEBUG;
never anything per record. Each line's message is the event's name followed by its
fields in ``key=value`` form (a value with a space, a quote or ``=`` is JSON-quoted), so a
reader greps it and a machine splits it; the same name and fields ride on the record as
``record.event`` and ``record.fields`` for a structured handler.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Hashable

__all__ = ["EventThrottle", "format_fields", "log_event"]

# The QUIC engines (aioquic, qh3) log to "quic". Without a handler there, a program that
# configured no logging would get the engine's WARNING lines on stderr through Python's
# last-resort handler ("Error: 304, reason: untrusted_chain" for every refused
# handshake), which the library reports itself as typed errors and events. A
# NullHandler is the library's usual answer: a program that configures logging (a root
# handler) still receives every record.
logging.getLogger("quic").addHandler(logging.NullHandler())


def format_fields(event: str, fields: dict[str, object]) -> str:
    """``event key=value ...``, quoting values that would not split cleanly."""
    parts = [event]
    for key, value in fields.items():
        text = str(value)
        if not text or any(ch in text for ch in ' "=\n'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def log_event(logger: logging.Logger, level: int, event: str, **fields: object) -> None:
    """Log one lifecycle event (formatted only when the level is enabled)."""
    if logger.isEnabledFor(level):
        logger.log(
            level, "%s", format_fields(event, fields), extra={"event": event, "fields": fields}
        )


class EventThrottle:
    """At most one line per key per ``interval`` seconds, for events a peer can repeat at
    will (a refused attach): the rest are counted and reported with the next line."""

    def __init__(self, interval: float = 1.0, max_keys: int = 1024) -> None:
        self._interval = interval
        self._max_keys = max_keys
        self._last: dict[Hashable, tuple[float, int]] = {}

    def allow(self, key: Hashable) -> int | None:
        """None to stay silent now, else how many were suppressed since the last line."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self._max_keys:
            self._last.clear()  # bounded: a flood of keys forgets, never grows
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]
