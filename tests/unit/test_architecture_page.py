"""docs/architecture.md names real code: every module path it gives exists.

The page is where a newcomer learns which file holds what; a path that moved or was
renamed without the page following sends that reader to nothing. The page names paths in
two ways: in backticks in the prose (``transport/connection.py``, ``mux/driver.py``,
relative to the package unless they start at the repository's root) and in the "Where the
code is" tree, whose indentation says which folder a name is in.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "velomux_quic"

pytestmark = pytest.mark.skipif(
    os.environ.get("VELOMUX_TEST_INSTALLED") == "1",
    reason="checks the checkout's page against the checkout's source; a run against an "
    "installed package (make test-pythons) has no source tree beside the page",
)
ROOT_FOLDERS = ("velomux_quic/", "tests/", "perf/", "docs/", "tools/", "examples/", "fuzz/")
# A backticked token that names a file or folder: path segments, ending in .py/.pyx/.pxd or /.
PATH_IN_PROSE = re.compile(r"`((?:[\w.-]+/)*[\w.-]+(?:\.pyx?|\.pxd|/))`")
# The names a tree line starts with: one, or several separated by commas.
TREE_NAMES = re.compile(r"([\w.-]+/?(?:,\s*[\w.-]+/?)*)")


def _resolve(name: str) -> Path:
    if name.startswith(ROOT_FOLDERS) or ("/" not in name.rstrip("/") and (ROOT / name).exists()):
        return ROOT / name
    return PACKAGE / name


def prose_paths() -> list[str]:
    text = PAGE.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return sorted(set(PATH_IN_PROSE.findall(prose)))


def tree_paths() -> list[Path]:
    """The files and folders the page's code tree names, as paths in the repository."""
    text = PAGE.read_text()
    blocks = re.findall(r"```\n(velomux_quic/.*?)```", text, flags=re.DOTALL)
    assert blocks, "docs/architecture.md has no 'Where the code is' tree starting at velomux_quic/"
    named: list[Path] = []
    parents: dict[int, Path] = {}
    for line in blocks[0].splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        head = TREE_NAMES.match(line.strip())
        assert head, f"a line of the code tree names no file or folder: {line!r}"
        parent = ROOT if indent == 0 else parents.get(indent - 2, ROOT)
        for name in (part.strip() for part in head.group(1).split(",")):
            path = parent / name.rstrip("/")
            named.append(path)
            if name.endswith("/"):
                parents[indent] = path
    return named


def test_every_path_in_the_prose_exists() -> None:
    names = prose_paths()
    assert len(names) > 10, "the page should name the modules it talks about"
    missing = [name for name in names if not _resolve(name).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_path_in_the_code_tree_exists() -> None:
    named = tree_paths()
    assert len(named) > 10
    missing = [str(path.relative_to(ROOT)) for path in named if not path.exists()]
    assert not missing, f"docs/architecture.md's code tree names paths that do not exist: {missing}"


def test_every_subpackage_is_in_the_code_tree() -> None:
    named = set(tree_paths())
    packages = {path.parent for path in PACKAGE.glob("*/__init__.py")}
    left_out = sorted(str(path.relative_to(ROOT)) for path in packages - named)
    assert not left_out, f"docs/architecture.md's code tree leaves out packages: {left_out}"
