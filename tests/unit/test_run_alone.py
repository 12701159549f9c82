"""tests/run_alone.py: under pytest-xdist a test marked ``alone`` runs with no other test
beside it, while the other tests still run side by side. Each case runs a small test file
in a pytest of its own with two workers; every test there logs when it starts and ends,
and the log's intervals are checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = """\
[pytest]
markers =
    alone: runs with no other test beside it
"""

TESTS = """\
import json
import os
import time

import pytest

def record(name, event):
    line = json.dumps([name, event, time.monotonic(), os.environ["PYTEST_XDIST_WORKER"]])
    with open(os.environ["ROOM_LOG"], "a") as log:
        log.write(line + "\\n")

@pytest.fixture(autouse=True)
def logged(request):
    record(request.node.name, "start")
    yield
    record(request.node.name, "end")

# Each test takes a while, so tests in the two workers would overlap if nothing kept them
# apart (the time is the test's work here, not a wait for anything).
@pytest.mark.alone
@pytest.mark.parametrize("number", range(3))
def test_alone(number):
    time.sleep(0.3)

@pytest.mark.parametrize("number", range(16))
def test_beside(number):
    time.sleep(0.1)
"""


def run_two_workers(tmp_path: Path) -> list[tuple[str, float, float, str]]:
    """Run TESTS in two workers; each test's (name, start, end, worker)."""
    (tmp_path / "pytest.ini").write_text(SETTINGS)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.run_alone"]\n')
    (tmp_path / "test_cases.py").write_text(TESTS)
    log = tmp_path / "log.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "worksteal", "test_cases.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ROOM_LOG": str(log)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers too are ended below if it hangs
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=50)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the run hung:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "19 passed" in result.stdout, result.stdout
    starts: dict[str, tuple[float, str]] = {}
    intervals = []
    for line in log.read_text().splitlines():
        name, event, at, worker = json.loads(line)
        if event == "start":
            starts[name] = (at, worker)
        else:
            began, worker = starts.pop(name)
            intervals.append((name, began, at, worker))
    assert not starts, f"tests that never ended: {starts}"
    return intervals


def test_a_test_marked_alone_runs_with_no_other_beside_it(tmp_path: Path) -> None:
    intervals = run_two_workers(tmp_path)
    assert len(intervals) == 19
    alone = [i for i in intervals if i[0].startswith("test_alone")]
    for name, began, ended, _ in alone:
        beside = [
            other[0]
            for other in intervals
            if other[0] != name and other[1] < ended and began < other[2]
        ]
        assert not beside, f"{name} ran beside {beside}"


def test_the_other_tests_still_run_side_by_side_in_both_workers(tmp_path: Path) -> None:
    intervals = run_two_workers(tmp_path)
    assert {worker for *_, worker in intervals} == {"gw0", "gw1"}
    beside = [i for i in intervals if i[0].startswith("test_beside")]
    overlapping = [
        (a[0], b[0]) for a in beside for b in beside if a[3] < b[3] and a[1] < b[2] and b[1] < a[2]
    ]
    assert overlapping, "no two tests of the two workers ever ran at the same time"
