"""Tests marked ``alone`` run with no other test beside them when pytest-xdist runs the suite
in several workers.

A few tests assert a ratio of wall-clock times: how much slower a legitimate peer is while
a hostile one attacks the node, against the same peer a moment before. The two halves are
measured seconds apart, and a test in another worker that starts a burst of processes
between them moves the ratio by more than the bound allows. Such a test takes the run's
room exclusively, and every other test takes it shared, so an ``alone`` test starts once
the tests running in the other workers have ended and no test starts beside it until it
ends.

The room is a pair of ``flock`` locks on files in a directory the controller makes (its
path reaches the workers in the environment they inherit; a pytest that a test starts in a
process of its own is no worker, and takes no lock) and removes at the end:

* ``room``: shared for a test, exclusive for an ``alone`` one;
* ``gate``: taken exclusively for the moment of entering the room, and held by an ``alone``
  test for as long as it waits and runs, so tests that arrive later wait at the gate and
  cannot keep the room shared for ever.

The locks are taken around the whole test protocol (setup, call, teardown), before
pytest-timeout arms the test's timer, so a wait for the room never counts against a test's
timeout. Without workers (``-n 0``, or a run outside ``make``) nothing is locked.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path

import pytest

MARKER = "alone"
_LOCKS_VARIABLE = "VELOMUX_TEST_ROOM"
"""The directory of the run's two lock files, set by the controller for its workers."""
_MADE = pytest.StashKey[Path]()
_INHERITED = pytest.StashKey["str | None"]()
_ROOM = pytest.StashKey["Room"]()


class Room:
    """A worker's open handles on the run's two lock files (a lock belongs to an open file,
    so each worker opens its own)."""

    def __init__(self, directory: Path) -> None:
        self._gate = open(directory / "gate", "a+b")  # noqa: SIM115 - held for the session
        self._room = open(directory / "room", "a+b")  # noqa: SIM115 - held for the session

    def enter(self, alone: bool) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(self._room, fcntl.LOCK_EX)  # the gate stays held until it leaves
            return
        try:
            fcntl.flock(self._room, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def leave(self, alone: bool) -> None:
        fcntl.flock(self._room, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def close(self) -> None:
        for handle in (self._gate, self._room):
            handle.close()


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None:  # an xdist worker
        directory = os.environ.get(_LOCKS_VARIABLE)
        if directory is not None:
            config.stash[_ROOM] = Room(Path(directory))
    elif config.getoption("numprocesses", None):
        # A controller makes its own room even when it runs inside a test of an outer run
        # (whose variable it inherited): its workers must never wait on the outer room.
        made = Path(tempfile.mkdtemp(prefix="velomux-test-room-"))
        config.stash[_MADE] = made
        config.stash[_INHERITED] = os.environ.get(_LOCKS_VARIABLE)
        os.environ[_LOCKS_VARIABLE] = str(made)  # the workers, started after this, inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    room = config.stash.get(_ROOM, None)
    if room is not None:
        room.close()
    made = config.stash.get(_MADE, None)
    if made is not None:
        inherited = config.stash.get(_INHERITED, None)
        if inherited is None:
            os.environ.pop(_LOCKS_VARIABLE, None)
        else:
            os.environ[_LOCKS_VARIABLE] = inherited
        shutil.rmtree(made, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    room = item.config.stash.get(_ROOM, None)
    if room is None:
        yield
        return
    alone = item.get_closest_marker(MARKER) is not None
    room.enter(alone)
    try:
        yield
    finally:
        room.leave(alone)
