"""Tests marked ``alone`` run with no other test beside them when pytest-xdist runs the suite
in several workers.

A few tests assert a ratio of wall-clock times: how much slower a legitimate peer is while
a hostile one attacks the node, against the same peer a moment before. The two halves are
measured seconds apart, and a test in another worker that starts a burst of processes
between them moves the ratio by more than the bound allows. Such a test takes the run's
room exclusively, and every other test takes it shared, so an ``alone`` test starts once
the tests running in the other workers have ended and no test starts beside it until it
ends.

The room is a pair of ``flock`` locks on files in a directory the controller makes, names
to each worker in its ``workerinput`` (xdist's channel to a worker, so a pytest that a test
starts in a process of its own knows nothing of it) and removes at the end:

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
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

MARKER = "alone"
_WORKER_INPUT = "velomux_test_room"
"""The ``workerinput`` key naming the directory of the run's two lock files."""
_MADE = pytest.StashKey[Path]()
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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """In the controller, before each worker starts (an xdist hook): the room, made once."""
    config: pytest.Config = node.config
    made = config.stash.get(_MADE, None)
    if made is None:
        made = config.stash[_MADE] = Path(tempfile.mkdtemp(prefix="velomux-test-room-"))
    node.workerinput[_WORKER_INPUT] = str(made)


def pytest_configure(config: pytest.Config) -> None:
    directory = getattr(config, "workerinput", {}).get(_WORKER_INPUT)
    if directory is not None:  # an xdist worker of a run that made a room
        config.stash[_ROOM] = Room(Path(directory))


def pytest_unconfigure(config: pytest.Config) -> None:
    room = config.stash.get(_ROOM, None)
    if room is not None:
        room.close()
    made = config.stash.get(_MADE, None)
    if made is not None:
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
