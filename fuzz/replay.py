"""Which lines of each decoder the fuzz corpora reach: replay them under coverage.py.

::

    python -m fuzz.replay            # seed corpus plus what `make fuzz` learnt (build/fuzz/)

libFuzzer's ``cov`` counts edges of everything instrumented; this says, per decoder
function, how many of its lines and branches the inputs found so far execute, and which
lines none reaches. Needs ``coverage`` (in the ``fuzz`` extra).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Final

__all__ = ["DECODERS", "main"]

ROOT: Final = Path(__file__).resolve().parent.parent
PACKAGE: Final = ROOT / "velomux_quic"

DECODERS: Final[dict[str, list[str]]] = {
    "mux/protocol.py": ["_parse_header", "decode_header", "decode_batch"],
    "mux/records.py": [
        "decode_open_slot",
        "decode_close_slot",
        "decode_credit",
        "decode_lifecycle",
        "_control_body_error",
    ],
    "transport/framing.py": ["FrameDecoder.feed", "FrameDecoder._start_body", "FrameDecoder._fail"],
    "messenger/envelope.py": ["decode_envelope", "_decode_name", "_decode_headers"],
    "messenger/contents.py": ["decode_error", "StagedDescriptor.decode"],
    "streaming/control.py": [
        "_unpack",
        "_strict_map",
        "ControlMessage._from_fields",
        "ControlMessage.decode",
        "_Response.decode",
        "_wire_int",
        "_wire_opt_int",
        "_wire_str",
        "_wire_str_list",
        "_wire_cancel_handle",
        "StreamOpenTicket._validate",
    ],
    "ids.py": ["StreamAnchorHandle.from_wire"],
    "streaming/frames.py": [
        "decode_frame",
        "_decode_generic",
        "_map_entries",
        "_non_item",
        "is_terminal_sentinel",
        "is_heartbeat",
    ],
    "discovery/records.py": [
        "PeerRecord.from_bytes",
        "PeerRecord.from_json",
        "PeerRecord.__post_init__",
        "_check_host",
        "_check_port",
    ],
}
"""The decoding functions of every target, by module: what the corpora should cover."""


def main() -> int:
    try:
        import coverage
    except ImportError:
        print("coverage is not installed: pip install '.[fuzz]'", file=sys.stderr)
        return 2
    cov = coverage.Coverage(branch=True, include=[str(PACKAGE / "*")], data_file=None)
    cov.start()
    from fuzz.run import WORK_DIR, _seeds
    from fuzz.targets import TARGETS, check

    counts = {}
    for name, target in TARGETS.items():
        inputs = _seeds(name, WORK_DIR / name / "corpus")
        for data in inputs:
            check(target, data)
        counts[name] = len(inputs)
    cov.stop()
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "coverage.json"
        cov.json_report(outfile=str(report), include=[str(PACKAGE / "*")])
        files = json.loads(report.read_text())["files"]
    print("inputs replayed: " + ", ".join(f"{name} {count}" for name, count in counts.items()))
    print(f"{'decoder':<50} {'lines':>11} {'branches':>11}  lines no input reaches")
    lines_run = lines_all = branches_run = branches_all = 0
    for module, functions in DECODERS.items():
        (key,) = (name for name in files if Path(name).resolve() == PACKAGE / module)
        by_function = files[key]["functions"]
        for function in functions:
            entry = by_function[function]
            summary = entry["summary"]
            run, total = summary["covered_lines"], summary["num_statements"]
            taken, branches = summary.get("covered_branches", 0), summary.get("num_branches", 0)
            lines_run, lines_all = lines_run + run, lines_all + total
            branches_run, branches_all = branches_run + taken, branches_all + branches
            missing = ", ".join(map(str, entry["missing_lines"])) or "-"
            print(
                f"{module + ':' + function:<50} {run:>4}/{total:<4}  {taken:>4}/{branches:<4}  "
                f"{missing}"
            )
    print(f"all decoders: {lines_run}/{lines_all} lines, {branches_run}/{branches_all} branches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
