"""``make test-pythons``: the package built and tested under every Python it declares.

For each version (3.11, 3.12 and 3.13 unless given), from pyenv's versions or ``pythonX.Y``
on PATH: a fresh virtual environment in a temporary directory, the package installed with
its ``test`` extra from the wheel ``make dist`` built (from the sdist, under that Python:
the wheel a package index serves; compiling the sdist again here would repeat that work),
then the unit suite and a short integration subset, run by that environment's pytest
against the installed package (``--import-mode=append`` and ``VELOMUX_TEST_INSTALLED=1``:
a test session that would import the checkout fails). The tests run from a copy of the
checkout without the package's source, so the processes they start (``python -m ...``
from the tree's root) import the installed package too, never a copy built in place for
another Python. A missing interpreter fails, saying how to get it.

    python tools/test_pythons.py [--dist dist] [--workers N] [VERSION ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", ".mypy_cache",
    ".ruff_cache", ".hypothesis",
)  # fmt: skip
"""What the copy of the checkout the tests run from leaves out, besides the package."""
VERSIONS = ("3.11", "3.12", "3.13")
INTEGRATION = (
    "tests/integration/test_public_api.py",
    "tests/integration/test_streaming.py",
    "tests/integration/test_mux.py",
    "tests/integration/test_messenger.py",
    "tests/integration/test_transport.py",
)
"""A short subset of the integration suite: the public API, streaming on both paths, the
messenger and the transport over real QUIC between real nodes."""


def interpreter(version: str) -> Path | None:
    """Python ``version``'s interpreter: pyenv's newest X.Y.*, else ``pythonX.Y`` on PATH."""
    try:
        root = subprocess.run(
            ["pyenv", "root"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = sorted(
        Path(root, "versions").glob(f"{version}.*/bin/python{version}"),
        key=lambda path: [int(p) for p in path.parts[-3].split(".") if p.isdigit()],
    )
    if candidates:
        return candidates[-1]
    found = shutil.which(f"python{version}")
    return Path(found) if found else None


def run(
    command: Sequence[str | Path],
    cwd: Path,
    env: dict[str, str] | None = None,
    *,
    task: str = "test-pythons",
    shown_words: int = 4,
) -> None:
    """Run one step, print how long it took, and end the whole task on its failure."""
    started = time.monotonic()
    shown = " ".join(str(part) for part in command[:shown_words])
    result = subprocess.run([str(p) for p in command], cwd=cwd, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{task} FAILED: `{shown} ...` exited {result.returncode}")
    print(f"  ok ({time.monotonic() - started:.0f} s): {shown} ...", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), help="e.g. 3.12")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where make dist wrote")
    parser.add_argument(
        "--workers",
        default="0",
        help="pytest-xdist worker processes for each suite (auto: one per core; 0: none)",
    )
    args = parser.parse_args(argv)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheels = {
        v: sorted(args.dist.glob(f"velomux_quic-{version}-cp{v.replace('.', '')}-*.whl"))
        for v in args.versions
    }
    if absent := [v for v, found in wheels.items() if len(found) != 1]:
        print(
            f"test-pythons: not one wheel of {version} for Python {', '.join(absent)} in "
            f"{args.dist}: run `make dist` first",
            file=sys.stderr,
        )
        return 1
    found = {v: interpreter(v) for v in args.versions}
    if missing := [v for v, path in found.items() if path is None]:
        for v in missing:
            print(
                f"test-pythons: Python {v} not found. Install it with `pyenv install {v}` "
                f"(or put python{v} on PATH), then run `make test-pythons` again.",
                file=sys.stderr,
            )
        return 1
    started = time.monotonic()
    for v, python in found.items():
        assert python is not None
        print(f"test-pythons: Python {v} ({python})", flush=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"velomux-py{v}-"))
        try:
            env_dir = workdir / "venv"
            run([python, "-m", "venv", env_dir], workdir)
            pip: list[str | Path] = [env_dir / "bin" / "python", "-m", "pip"]
            run([*pip, "install", "--quiet", "--upgrade", "pip"], workdir)
            run([*pip, "install", "--quiet", f"{wheels[v][0].resolve()}[test]"], workdir)
            tree = workdir / "tree"
            shutil.copytree(
                ROOT, tree,
                ignore=lambda folder, names: {
                    *LEFT_OUT(folder, names), *(["velomux_quic"] if Path(folder) == ROOT else [])
                },
            )  # fmt: skip
            env = {**os.environ, "VELOMUX_TEST_INSTALLED": "1"}
            run(
                [env_dir / "bin" / "pytest", "-q", "-p", "no:cacheprovider",
                 "-n", args.workers, "--dist", "worksteal",
                 "--import-mode=append", f"--rootdir={tree}", "-c", tree / "pyproject.toml",
                 tree / "tests" / "unit", *(tree / path for path in INTEGRATION)],
                tree, env,
            )  # fmt: skip
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"test-pythons OK: {', '.join(found)} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
