"""The backstop behind pytest-timeout: a test still running ``hang_backstop_grace`` seconds
after its timeout ends the whole run, with every thread's stack on stderr.

pytest-timeout's signal method (the one configured) fails a test from a SIGALRM handler
that runs in the main thread between two bytecodes, and the run goes on with the next test.
Two things defeat it. A main thread blocked in C never returns to the interpreter, so the
handler never runs (gRPC's core is C, called with the GIL held). And an asyncio task step
or loop callback that the handler interrupts receives the failure itself: the loop stores
it as that task's exception or logs it as an error in a callback, and the test runs on with
no timer left. The thread method is no way out: its timer is a Python thread, which needs
the GIL a blocked main thread can hold.

``faulthandler``'s watchdog is a C thread that needs neither the GIL nor the main thread.
Armed for each test when pytest-timeout arms its own timer, at the test's timeout plus the
grace, it writes every thread's Python stack to stderr and exits the process with status
1, so CI reports the hang, and where it is, instead of waiting out its own time limit. Half
way through the grace a Python timer first names the test and prints where each task of
every running event loop waits (a thread's stack shows only the loop's ``select``); it
needs the GIL, so a main thread blocked in C skips that part. A test that ends in time
disarms both. When ``faulthandler_timeout`` is set, pytest's own use of the same watchdog
is left alone and this one stands down.

Under pytest-xdist (``make test`` runs the suite in worker processes) the process that exits
is the worker: xdist reports its test as failed, starts a fresh worker for the tests still
to run, and the run fails at its end. The stacks go to the worker's stderr, which is the
run's own.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
from typing import Any, TextIO

import pytest

GRACE_OPTION = "hang_backstop_grace"
DEFAULT_GRACE = 30.0
"""Seconds past a test's timeout before the run ends: room for pytest-timeout's own failure
and the teardown after it."""

_STDERR = pytest.StashKey["TextIO | None"]()
"""A duplicate of the process's stderr taken before any test runs: while one runs, its
descriptor 2 is pytest's capture file, which nobody reads once the process has exited."""
_REPORTER = pytest.StashKey[threading.Timer]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        GRACE_OPTION,
        "seconds past a test's timeout after which a run still in that test prints where "
        "it waits and exits (0 turns the backstop off)",
        default=str(DEFAULT_GRACE),
    )


def pytest_configure(config: pytest.Config) -> None:
    grace = float(config.getini(GRACE_OPTION))
    faulthandler_timeout = float(config.getini("faulthandler_timeout") or 0)
    if grace <= 0 or faulthandler_timeout > 0:
        config.stash[_STDERR] = None
        return
    config.stash[_STDERR] = os.fdopen(os.dup(sys.stderr.fileno()), "w")


def pytest_unconfigure(config: pytest.Config) -> None:
    stream = config.stash.get(_STDERR, None)
    if stream is not None:
        faulthandler.cancel_dump_traceback_later()
        stream.close()


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Arm the backstop beside pytest-timeout's timer; returns None so that timer is
    armed too (the hook stops at the first implementation that returns a value)."""
    stream = item.config.stash.get(_STDERR, None)
    if stream is None or not settings.timeout:
        return
    timeout = float(settings.timeout)
    grace = float(item.config.getini(GRACE_OPTION))
    faulthandler.dump_traceback_later(timeout + grace, exit=True, file=stream)
    reporter = threading.Timer(
        timeout + grace / 2, _report, (item.nodeid, timeout + grace / 2, grace / 2, stream)
    )
    reporter.daemon = True
    reporter.name = "hang-backstop"
    item.stash[_REPORTER] = reporter
    reporter.start()


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    if item.config.stash.get(_STDERR, None) is None:
        return
    faulthandler.cancel_dump_traceback_later()
    reporter = item.stash.get(_REPORTER, None)
    if reporter is not None:
        reporter.cancel()


def _report(nodeid: str, elapsed: float, left: float, stream: TextIO) -> None:
    """Name the stuck test and show where each task of each running loop waits.

    Read from another thread while the loop runs: good enough for a report the process
    dies after, and every failure here is swallowed so the exit still comes.
    """
    stream.write(
        f"\nhang backstop: {nodeid} is still running {elapsed:g} s after it started, past "
        f"its timeout; every thread's stack follows in {left:g} s, then the run ends\n"
    )
    try:
        loops = [
            obj
            for obj in gc.get_objects()
            if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running()
        ]
        for loop in loops:
            for task in asyncio.all_tasks(loop):
                stream.write(f"-- {task!r}\n")
                task.print_stack(limit=8, file=stream)
    except Exception as exc:  # a report of a dying run: never let it stop the exit
        stream.write(f"(could not list the tasks: {exc!r})\n")
    stream.flush()
