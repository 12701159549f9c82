"""The live progress display: passes sent and tokens delivered, on a terminal only.

rich draws it (in the ``demo`` extra, and the ``perf`` one ``make`` installs); rich is
imported only when the display is on, so ``--json``, a pipe or a machine without rich
gets :class:`Silent`, which does nothing. Drawing runs on rich's own refresh thread a
few times a second; the engine only sets numbers.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Protocol

__all__ = ["Display", "Silent", "display_for"]


class Display(Protocol):
    """What the engine tells the display."""

    def __enter__(self) -> Display: ...
    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
    def arm(self, name: str, passes: int, tokens: int) -> None:
        """A new arm starts: ``passes`` forward passes, ``tokens`` tokens in all."""

    def update(self, passes: int, delivered: int) -> None:
        """Passes the engine has run, tokens the frontends have read so far."""

    def note(self, text: str) -> None:
        """A line for the person watching (nothing when silent)."""


class Silent:
    """No live display: stdout is not a terminal, ``--json`` was given, or rich is missing.
    Notes are printed as plain lines when ``echo`` (not under ``--json``)."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo

    def __enter__(self) -> Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def arm(self, name: str, passes: int, tokens: int) -> None:
        return None

    def update(self, passes: int, delivered: int) -> None:
        return None

    def note(self, text: str) -> None:
        if self.echo:
            print(text, flush=True)


class _Rich:
    """Two bars per arm, in one live region: the engine's passes, the tokens delivered."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[rate]}"),
            refresh_per_second=8,
        )
        self._passes: Any = None
        self._tokens: Any = None
        self._started = 0.0

    def __enter__(self) -> _Rich:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def arm(self, name: str, passes: int, tokens: int) -> None:
        import time

        self._passes = self._progress.add_task(f"{name} forward passes", total=passes, rate="")
        self._tokens = self._progress.add_task(f"{name} tokens read", total=tokens, rate="")
        self._started = time.perf_counter()

    def update(self, passes: int, delivered: int) -> None:
        import time

        elapsed = time.perf_counter() - self._started
        rate = f"{delivered / elapsed:,.0f} tokens/s" if elapsed > 0 else ""
        self._progress.update(self._passes, completed=passes)
        self._progress.update(self._tokens, completed=delivered, rate=rate)

    def note(self, text: str) -> None:
        self._progress.console.print(text, soft_wrap=True, markup=False, highlight=False)


def display_for(enabled: bool) -> Display:
    """rich's display when ``enabled`` and stdout is a terminal and rich imports; else
    :class:`Silent` (printing notes unless not ``enabled``)."""
    if not enabled or not sys.stdout.isatty():
        return Silent(echo=enabled)
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        print("(no live progress display: pip install 'velomux_quic[demo]')", file=sys.stderr)
        return Silent(echo=True)
    return _Rich()
