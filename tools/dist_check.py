"""``make dist-check``: the built wheel, tried as a user who found it on a package index.

It reads the wheel's metadata (the license expression and file, the project URLs, the
classifiers, a long description whose links work off the repository) and the sdist's
contents, then installs the wheel with its ``demo`` and ``test`` extras into a fresh
virtual environment in a temporary directory outside the checkout and, from another
temporary directory, runs what a user runs: ``velomux --help`` and every subcommand's
help, ``velomux --version`` when the command has it, ``velomux certs dev``, the
getting-started program (the block docs/getting-started.md shows, as a file), the
examples (``tests/integration/test_examples.py`` with that environment's pytest, which
must import the installed package, not the checkout's) and ``velomux demo`` with
``--compare --plot`` and with ``--impair``. Any failure exits 1 naming the step.

    python tools/dist_check.py [--dist dist] [--keep]
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import venv
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "https://github.com/velomux/velomux_quic"
URLS = ("Homepage", "Documentation", "Repository", "Changelog", "Issues")
SMALL = ["--requests", "64", "--tokens", "16", "--timeout", "30"]
MARKUP = re.compile(r"``|:(?:class|func|meth|mod|attr):|SUPPRESS")


class CheckFailed(Exception):
    """One step did not do what it should; the message says what."""


def project() -> dict[str, object]:
    document = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: dict[str, object] = document["project"]
    return found


def built(dist: Path, version: str) -> tuple[Path, Path]:
    """The wheel and the sdist of ``version`` in ``dist`` (exactly one of each)."""
    wheels = sorted(dist.glob(f"velomux_quic-{version}-*.whl"))
    sdists = sorted(dist.glob(f"velomux_quic-{version}.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise CheckFailed(
            f"expected one wheel and one sdist of {version} in {dist}, found "
            f"{[p.name for p in wheels + sdists]}: run `make dist` first"
        )
    return wheels[0], sdists[0]


def check_wheel_metadata(wheel: Path, meta: dict[str, object]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        text = archive.read(info).decode()
        licenses = [n for n in names if ".dist-info/licenses/" in n]
    message = email.parser.Parser().parsestr(text)
    version = tuple(int(part) for part in message["Metadata-Version"].split("."))
    if version < (2, 4):
        raise CheckFailed(f"Metadata-Version {message['Metadata-Version']}, not 2.4 (PEP 639)")
    if message["License-Expression"] != "Apache-2.0":
        raise CheckFailed(f"License-Expression is {message['License-Expression']!r}")
    if message.get_all("License-File") != ["LICENSE"] or not any(
        n.endswith("licenses/LICENSE") for n in licenses
    ):
        raise CheckFailed(f"the wheel does not carry LICENSE: {licenses}")
    urls = {entry.split(",")[0].strip() for entry in message.get_all("Project-URL") or []}
    if missing := [name for name in URLS if name not in urls]:
        raise CheckFailed(f"project URLs missing from the wheel: {missing}")
    classifiers = message.get_all("Classifier") or []
    expected = meta["classifiers"]
    assert isinstance(expected, list)
    if classifiers != expected or not any("3.13" in c for c in classifiers):
        raise CheckFailed(f"classifiers differ from pyproject.toml: {classifiers}")
    if message["Requires-Python"] != meta["requires-python"]:
        raise CheckFailed(f"Requires-Python is {message['Requires-Python']!r}")
    if message["Description-Content-Type"] != "text/markdown":
        raise CheckFailed("the long description is not declared as Markdown")
    description = message.get_payload()
    assert isinstance(description, str)
    links = re.findall(r"\]\(([^)\s]+)\)", description)
    if relative := [link for link in links if "://" not in link]:
        raise CheckFailed(f"the long description has relative links: {relative}")
    if "pip install velomux_quic" not in description:
        raise CheckFailed("the long description does not say how to install from an index")
    print(f"  metadata: {len(classifiers)} classifiers, {len(urls)} URLs, LICENSE, "
          f"{len(links)} absolute links")  # fmt: skip


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {
            Path(name).relative_to(Path(name).parts[0]).as_posix() for name in archive.getnames()
        }
    wanted = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "velomux_quic/__init__.py"}
    if missing := sorted(wanted - names):
        raise CheckFailed(f"the sdist lacks {missing}")
    print(f"  sdist: {len(names)} files, {', '.join(sorted(wanted))} among them")


def run(
    command: Sequence[str | Path], cwd: Path, *, timeout: float, env: dict[str, str] | None = None
) -> str:
    """Run ``command``; its stdout, or CheckFailed with the end of both streams."""
    started = time.monotonic()
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, check=False, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    shown = " ".join(str(part) for part in command[:6])
    if result.returncode != 0:
        raise CheckFailed(
            f"`{shown} ...` exited {result.returncode}:\n{result.stdout[-3000:]}"
            f"\n{result.stderr[-3000:]}"
        )
    last = result.stdout.strip().splitlines()[-1:] if "pytest" in shown else []
    print(f"  ok ({time.monotonic() - started:.1f} s): {shown}" + "".join(f" ({x})" for x in last))
    return result.stdout


def getting_started_program() -> str:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    blocks: list[str] = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return next(block for block in blocks if "asyncio.run(" in block)


def check_installed(wheel: Path, workdir: Path) -> None:
    env_dir = workdir / "venv"
    scratch = workdir / "user"
    scratch.mkdir()
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    python, velomux = bin_dir / "python", bin_dir / "velomux"
    run([python, "-m", "pip", "install", "--quiet", f"{wheel}[demo,test]"], workdir, timeout=900)
    located = run([python, "-c", "import velomux_quic; print(velomux_quic.__file__)"], scratch,
                  timeout=60).strip()  # fmt: skip
    if Path(located).is_relative_to(ROOT):
        raise CheckFailed(f"the fresh environment imports the checkout: {located}")

    top = run([velomux, "--help"], scratch, timeout=60)
    helps = {"velomux": top}
    for group in ("certs", "demo", "node", "probe"):
        helps[group] = run([velomux, group, "--help"], scratch, timeout=60)
    for command in ("init-ca", "issue", "renew", "trust", "dev"):
        helps[f"certs {command}"] = run([velomux, "certs", command, "--help"], scratch, timeout=60)
    if bad := {name: m.group(0) for name, text in helps.items() if (m := MARKUP.search(text))}:
        raise CheckFailed(f"help texts with markup or suppressed entries: {bad}")
    if "--version" in top:
        print("  " + run([velomux, "--version"], scratch, timeout=60).strip())
    else:
        print("  (velomux has no --version yet)")

    run([velomux, "certs", "dev", "--out", "certs/dev"], scratch, timeout=120)
    if not (scratch / "certs" / "dev" / "node-a" / "node.pem").is_file():
        raise CheckFailed("velomux certs dev made no node-a certificate")

    (scratch / "stream.py").write_text(getting_started_program())
    printed = run([python, "stream.py"], scratch, timeout=120)
    if printed.splitlines() != ["Hello, world!"]:
        raise CheckFailed(f"the getting-started program printed {printed!r}")

    environment = {**os.environ, "VELOMUX_TEST_INSTALLED": "1"}
    run(
        [bin_dir / "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
         f"--rootdir={ROOT}", "-c", ROOT / "pyproject.toml",
         ROOT / "tests" / "integration" / "test_examples.py"],
        scratch, timeout=900, env=environment,
    )  # fmt: skip

    plot = scratch / "cdf.png"
    out = run([velomux, "demo", "--certs", "certs/dev", *SMALL, "--compare", "--plot", plot,
               "--json"], scratch, timeout=300)  # fmt: skip
    document = json.loads(out)
    arms = {row["arm"] for row in document["arms"]}
    if not document["ok"] or arms != {"mux", "per-stream", "grpc"} or document["skipped"]:
        raise CheckFailed(f"velomux demo --compare: {out[:2000]}")
    if plot.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise CheckFailed("velomux demo --plot drew no PNG")
    out = run([velomux, "demo", "--certs", "certs/dev", *SMALL, "--impair",
               "loss=1%,delay=2ms", "--json"], scratch, timeout=300)  # fmt: skip
    document = json.loads(out)
    forwarded = document["arms"][0].get("proxy", {}).get("client_to_server", {}).get("forwarded")
    if not document["ok"] or not forwarded:
        raise CheckFailed(f"velomux demo --impair: {out[:2000]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where make dist wrote")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    args = parser.parse_args(argv)
    meta = project()
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="velomux-dist-check-"))
    try:
        wheel, sdist = built(args.dist.resolve(), str(meta["version"]))
        print(f"dist-check: {wheel.name}, {sdist.name}")
        check_wheel_metadata(wheel, meta)
        check_sdist(sdist)
        check_installed(wheel, workdir)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"dist-check FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"  kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"dist-check OK in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
