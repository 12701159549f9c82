"""Run every benchmark in perf/ and keep each one's report.

Each benchmark runs in its own process, one after another (they would disturb each other's
figures if run together); its stdout goes to ``<out>/<name>.txt`` and its stderr (progress,
warnings, a failure's diagnosis) passes through. The exit status is non-zero if any
benchmark failed, timed out or could not start.

    python perf/run_all.py --short --out perf/results    # what `make perf` runs
    python perf/run_all.py                               # every benchmark at its defaults

``--short`` gives each benchmark the flags that make it finish in well under 30 s on a
small machine; without it each runs at its own defaults (several minutes in all). A
``*_bench.py`` that this script does not know runs at its defaults either way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SHORT_FLAGS: dict[str, list[str]] = {
    "framing_bench": ["--repeat", "1"],
    "envelope_bench": ["--ops", "100000", "--repeat", "2"],
    "mux_codec_bench": ["--batches", "100", "--repeat", "3"],
    "stream_frames_bench": ["--records", "50000", "--repeat", "3"],
    "tokens": ["--short", "--json", "perf/results/tokens-short.json"],
    "quic_lanes": [
        "--short",
        "--json",
        "perf/results/quic_lanes-short.json",
        "--png",
        "perf/results/quic_lanes-short.png",
    ],
}
"""The benchmarks in the order they run, and their flags under ``--short``."""

TIMEOUT_S = {"short": 300.0, "full": 3600.0}
"""The longest one benchmark may take before it is killed and counted as failed."""


def benchmarks() -> list[str]:
    """The known benchmarks first, in their order, then any other ``*_bench.py``."""
    found = sorted(path.stem for path in HERE.glob("*_bench.py"))
    known = [name for name in SHORT_FLAGS if (HERE / f"{name}.py").exists()]
    return known + [name for name in found if name not in SHORT_FLAGS]


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run_one(name: str, flags: list[str], out: Path, timeout: float) -> tuple[bool, str]:
    """Run one benchmark, its stdout into ``out/<name>.txt``; (succeeded, what happened)."""
    report = out / f"{name}.txt"
    command = [sys.executable, str(HERE / f"{name}.py"), *flags]
    started = time.perf_counter()
    with report.open("w") as stdout:
        try:
            # The benchmarks' own relative paths (and python -m velomux_quic) resolve from
            # the repository root, whatever the caller's working directory.
            process = subprocess.run(
                command, stdout=stdout, cwd=HERE.parent, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return False, f"killed after {timeout:g} s"
        except OSError as exc:
            return False, f"did not start: {exc}"
    elapsed = time.perf_counter() - started
    if process.returncode != 0:
        return False, f"exit status {process.returncode} after {elapsed:.1f} s"
    return True, f"{elapsed:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--short", action="store_true", help="the quick version of every benchmark")
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "results",
        help="where each benchmark's stdout goes, as <name>.txt (default perf/results)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    timeout = TIMEOUT_S["short" if args.short else "full"]
    env_note = " (VELOMUX_NO_UVLOOP set)" if os.environ.get("VELOMUX_NO_UVLOOP") else ""
    print(f"{'short' if args.short else 'full'} benchmarks, reports in {_shown(out)}{env_note}")
    failed: list[str] = []
    for name in benchmarks():
        flags = SHORT_FLAGS.get(name, []) if args.short else []
        shown = " ".join([f"perf/{name}.py", *flags])
        print(f"-> {shown}", flush=True)
        ok, what = run_one(name, flags, out, timeout)
        print(f"   {'ok' if ok else 'FAILED'}: {what}, {_shown(out / f'{name}.txt')}", flush=True)
        if not ok:
            failed.append(name)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("every benchmark succeeded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
