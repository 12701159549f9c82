"""A smoke test of ``perf/batch_path_instructions.py``: two nodes in one process under
callgrind, each stage of the per-batch path counted in its own window."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from .test_perf_tokens import ONCE_PER_CI, run_script

pytestmark = ONCE_PER_CI

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "batch_path_instructions.py"


@pytest.mark.timeout(240)
def test_every_stage_of_a_batch_is_counted_in_its_window(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed (`make valgrind` installs Debian's)")
    report = tmp_path / "batch.json"
    command = [
        sys.executable, str(SCRIPT), "--engine", "aioquic", "--records", "1", "16",
        "--passes", "3", "--json", str(report),
    ]  # fmt: skip
    returncode, stdout, stderr = run_script(command, timeout=230)
    assert returncode == 0, stderr
    document = json.loads(report.read_text())
    one, sixteen = document["results"]
    assert (one["records"], sixteen["records"]) == (1, 16)
    for result in (one, sixteen):
        for stage in ("write", "transmit", "receive", "answer", "acks"):
            instructions, calls = result[stage]
            assert instructions > result["empty"][0], stage  # more than the wrapper itself
            # Every batch is written, sent and received; the answers (acknowledgements,
            # credit) may cover several batches each.
            assert calls >= (1 if stage in ("write", "transmit", "receive") else 0.1), stage
    # Sixteen records cost the write and the receive more than one does. The receive is
    # compared per call: a batch's datagrams may come with an acknowledgement's or not.
    assert sixteen["write"][0] > one["write"][0]
    assert sixteen["receive"][0] / sixteen["receive"][1] > one["receive"][0] / one["receive"][1]
    assert "instructions per batch" in stdout
