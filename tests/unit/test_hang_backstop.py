"""tests/hang_backstop.py ends a run stuck in a test that pytest-timeout cannot end, and
only such a run: each case runs a small test file in a pytest process of its own, with a
1 s timeout and a 2 s grace, and reads what that process printed and how it ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = """\
[pytest]
timeout = 1
hang_backstop_grace = 2
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""


def run_pytest(tmp_path: Path, tests: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text(SETTINGS)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.hang_backstop"]\n')
    (tmp_path / "test_cases.py").write_text(tests)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_cases.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,  # the backstop ends these runs within 3 s of each stuck test's start
    )


def test_a_timeout_failure_an_asyncio_task_swallows_ends_the_run_saying_where(
    tmp_path: Path,
) -> None:
    # pytest-timeout's failure is raised in whatever runs when the signal comes: here a
    # task's step that never yields, which keeps it as the task's exception and ends; the
    # test's own task then waits for ever with no timer left.
    result = run_pytest(
        tmp_path,
        """\
import asyncio

async def test_waits_on_a_busy_loop():
    async def spin():
        while True:
            sum(range(20000))
    spinner = asyncio.ensure_future(spin())
    await asyncio.Event().wait()
""",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "hang backstop: test_cases.py::test_waits_on_a_busy_loop is still running" in (
        result.stderr
    )
    assert "await asyncio.Event().wait()" in result.stderr  # where the test's task waits
    assert "Timeout (0:00:03)!" in result.stderr  # then every thread's stack, and the exit
    assert " passed" not in result.stdout and " failed" not in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's pthread mutex")
def test_a_main_thread_blocked_in_c_holding_the_gil_ends_the_run_with_its_stack(
    tmp_path: Path,
) -> None:
    # A C call made with the GIL held that never returns: neither a signal handler nor a
    # Python thread can run. faulthandler's watchdog, a C thread, still dumps and exits.
    result = run_pytest(
        tmp_path,
        """\
import ctypes

def test_deadlocks_in_c():
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # a normal mutex locked twice: never returns
""",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Timeout (0:00:03)!" in result.stderr
    assert 'test_cases.py", line 7 in test_deadlocks_in_c' in result.stderr


def test_a_test_pytest_timeout_ends_leaves_the_run_going(tmp_path: Path) -> None:
    result = run_pytest(
        tmp_path,
        """\
import time

def test_too_slow():
    time.sleep(30)

def test_next():
    pass
""",
    )
    assert result.returncode == 1
    assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert "hang backstop" not in result.stderr and "Timeout (0:00" not in result.stderr
