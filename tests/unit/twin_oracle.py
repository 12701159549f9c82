"""The other twin of the record path, as a process: runs the differential scenarios.

``python -m tests.unit.twin_oracle`` reads one JSON request per line on stdin (``[name,
args]``), runs ``tests.unit.twin_scenarios.SCENARIOS[name](*args)`` and writes the JSON
result on one line; it exits when stdin closes. The test starts it with the record path it
does not run itself (``VELOMUX_PURE_PYTHON`` set the other way), so every scenario runs
once on each twin."""

from __future__ import annotations

import json
import sys

from tests.unit.twin_scenarios import SCENARIOS, implementation


def main() -> int:
    sys.stdout.write(json.dumps(implementation()) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        name, args = json.loads(line)
        sys.stdout.write(json.dumps(SCENARIOS[name](*args)) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
