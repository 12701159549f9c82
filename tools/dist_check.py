"""``make dist-check``: the built wheels, tried as a user who found them on a package index.

Each wheel (one per declared Python) must be one a package index accepts: its name's and
its WHEEL file's platform tags manylinux (an index refuses ``linux_x86_64``), its Python
tag the one it was built for, and its extension modules stripped (no debug sections, no
static symbol table). It reads the wheels' metadata (the license expression and file, the
project URLs, the classifiers, a long description whose links work off the repository)
and the sdist's contents. Then it installs the wheel of the Python it runs on with its
``demo`` and ``test`` extras into a fresh virtual environment in a temporary directory
outside the checkout and, from another temporary directory, runs what a user runs:
``velomux --help`` and every subcommand's help, ``velomux --version``, ``velomux certs
dev``, the getting-started program (the block docs/getting-started.md shows, as a file),
the examples (``tests/integration/test_examples.py`` with that environment's pytest,
which must import the installed package, not the checkout's) and ``velomux demo`` with
``--compare --plot`` and with ``--impair``. Every other wheel goes into a fresh
environment of its own Python, which runs ``velomux --version`` and imports the package,
its compiled record path in use. Any failure exits 1 naming the step.

    python tools/dist_check.py [--dist dist] [--keep] [VERSION ...]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pythons import VERSIONS, interpreter

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


def built(dist: Path, version: str, pythons: Sequence[str]) -> tuple[dict[str, Path], Path]:
    """The wheel of ``version`` for each of ``pythons`` in ``dist`` and its sdist (exactly
    one of each)."""
    wheels: dict[str, Path] = {}
    found = sorted(dist.glob(f"velomux_quic-{version}-*.whl"))
    for python in pythons:
        tag = "cp" + python.replace(".", "")
        matching = [p for p in found if p.name.split("-")[2] == tag]
        if len(matching) == 1:
            wheels[python] = matching[0]
    sdists = sorted(dist.glob(f"velomux_quic-{version}.tar.gz"))
    if len(wheels) != len(pythons) or len(found) != len(pythons) or len(sdists) != 1:
        raise CheckFailed(
            f"expected one wheel of {version} for each of Python {', '.join(pythons)} and "
            f"one sdist in {dist}, found {[p.name for p in found + sdists]}: run `make dist`"
        )
    return wheels, sdists[0]


def tag_problems(filename: str, wheel_file: str, python: str) -> list[str]:
    """Why a package index would refuse this wheel's tags (none: it would take them).

    ``filename`` is the wheel's name, ``wheel_file`` its ``.dist-info/WHEEL`` text; both
    must say manylinux for every platform, and the Python and ABI tags must be ``python``'s.
    """
    problems = []
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) != 5:
        return [f"{filename} is not name-version-python-abi-platform.whl"]
    python_tag, abi_tag, platforms = parts[2], parts[3], parts[4].split(".")
    expected = "cp" + python.replace(".", "")
    if (python_tag, abi_tag) != (expected, expected):
        problems.append(f"tagged {python_tag}-{abi_tag}, not {expected}-{expected}")
    if bad := [p for p in platforms if not p.startswith("manylinux")]:
        problems.append(f"platform tags {bad} are not manylinux: a package index refuses them")
    declared = sorted(
        line.split(":", 1)[1].strip() for line in wheel_file.splitlines() if line.startswith("Tag:")
    )
    named = sorted(f"{python_tag}-{abi_tag}-{platform}" for platform in platforms)
    if declared != named:
        problems.append(f"the WHEEL file's tags {declared} differ from the name's {named}")
    if "Root-Is-Purelib: false" not in wheel_file:
        problems.append("the WHEEL file does not say Root-Is-Purelib: false")
    return problems


def elf_sections(image: bytes) -> list[str]:
    """The section names of a 64-bit little-endian ELF file (an x86_64 extension module)."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise CheckFailed("not a 64-bit little-endian ELF file")
    header_offset = int.from_bytes(image[0x28:0x30], "little")
    entry_size = int.from_bytes(image[0x3A:0x3C], "little")
    count = int.from_bytes(image[0x3C:0x3E], "little")
    names_index = int.from_bytes(image[0x3E:0x40], "little")

    def header(index: int) -> tuple[int, int, int]:
        at = header_offset + index * entry_size
        name = int.from_bytes(image[at : at + 4], "little")
        offset = int.from_bytes(image[at + 0x18 : at + 0x20], "little")
        size = int.from_bytes(image[at + 0x20 : at + 0x28], "little")
        return name, offset, size

    _, names_offset, names_size = header(names_index)
    names = image[names_offset : names_offset + names_size]
    return [
        names[start : names.index(b"\0", start)].decode()
        for start, _, _ in (header(index) for index in range(count))
    ]


def unstripped(image: bytes) -> list[str]:
    """The sections a stripped extension module has none of: debug information and the
    static symbol table (the dynamic one, which imports need, stays)."""
    return [name for name in elf_sections(image) if name.startswith(".debug") or name == ".symtab"]


def check_wheel_files(wheel: Path, python: str) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        if problems := tag_problems(wheel.name, archive.read(info).decode(), python):
            raise CheckFailed(f"{wheel.name}: {'; '.join(problems)}")
        modules = [n for n in names if n.endswith(".so")]
        if len(modules) < 2:
            raise CheckFailed(f"{wheel.name} carries {modules}, not the compiled record path")
        sizes = []
        for module in modules:
            image = archive.read(module)
            if debug := unstripped(image):
                raise CheckFailed(f"{wheel.name}: {module} is not stripped (has {debug})")
            sizes.append(f"{Path(module).name.split('.')[0]} {len(image) / 1e6:.2f} MB")
    print(f"  {wheel.name}: manylinux, stripped ({', '.join(sizes)})")


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
    print("  " + run([velomux, "--version"], scratch, timeout=60).strip().replace("\n", "; "))

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


def check_other_python(wheel: Path, python: str, workdir: Path) -> None:
    """The wheel of another Python in a fresh environment of that Python: it installs, the
    command runs and the compiled record path loads."""
    found = interpreter(python)
    if found is None:
        raise CheckFailed(f"Python {python} not found: `pyenv install {python}`")
    env_dir = workdir / f"venv{python}"
    scratch = workdir / f"user{python}"
    scratch.mkdir()
    run([found, "-m", "venv", env_dir], workdir, timeout=300)
    bin_dir = env_dir / "bin"
    run([bin_dir / "python", "-m", "pip", "install", "--quiet", wheel], workdir, timeout=900)
    printed = run([bin_dir / "velomux", "--version"], scratch, timeout=60).strip()
    print("  " + printed.replace("\n", "; "))
    probe = (
        "import velomux_quic, sys; from velomux_quic import runtime_info; "
        "print(runtime_info().record_path, velomux_quic.__file__, sys.version.split()[0])"
    )
    path, located, version = run([bin_dir / "python", "-c", probe], scratch, timeout=60).split()
    if path != "compiled" or Path(located).is_relative_to(ROOT) or not version.startswith(python):
        raise CheckFailed(f"Python {python} ran {path} from {located} on {version}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("pythons", nargs="*", default=list(VERSIONS), help="e.g. 3.12")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where make dist wrote")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    args = parser.parse_args(argv)
    meta = project()
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="velomux-dist-check-"))
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        wheels, sdist = built(args.dist.resolve(), str(meta["version"]), args.pythons)
        print(f"dist-check: {', '.join(w.name for w in wheels.values())}, {sdist.name}")
        for python, wheel in wheels.items():
            check_wheel_files(wheel, python)
            check_wheel_metadata(wheel, meta)
        check_sdist(sdist)
        if running not in wheels:
            raise CheckFailed(f"no wheel for Python {running}, which runs this check")
        check_installed(wheels[running], workdir)
        for python, wheel in wheels.items():
            if python != running:
                check_other_python(wheel, python, workdir)
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
