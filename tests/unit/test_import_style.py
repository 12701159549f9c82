"""One import style inside the library: its modules name each other relatively.

A relative import says at a glance that a name is the package's own and which layer it
comes from (``..errors``, ``.certs``), and it keeps working however the package is
installed or vendored. The programs (``programs/``, ``__main__``) are the exception on
purpose: they sit on the public surface and import the package as a user's program does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "velomux_quic"
PROGRAMS = (PACKAGE / "programs", PACKAGE / "__main__.py")

pytestmark = pytest.mark.skipif(not PACKAGE.is_dir(), reason="runs on a checkout's source")


def _library_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == program or program in path.parents for program in PROGRAMS)
    ]


def _absolute_imports_of_the_package(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [
            f"{path.relative_to(root)}:{node.lineno}: {name}"
            for name in names
            if name == "velomux_quic" or name.startswith("velomux_quic.")
        ]
    return found


def test_library_modules_import_the_package_relatively() -> None:
    modules = _library_modules()
    assert len(modules) > 100  # the walk found the package
    absolute = [line for path in modules for line in _absolute_imports_of_the_package(path)]
    assert absolute == [], "import the package's own modules relatively:\n" + "\n".join(absolute)


def test_the_check_sees_an_absolute_import(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "import os\nimport velomux_quic.node\nfrom velomux_quic.errors import VelomuxError\n"
        "from . import x\nfrom velomux_quicker import y\n"
    )
    assert _absolute_imports_of_the_package(module, tmp_path) == [
        "module.py:2: velomux_quic.node",
        "module.py:3: velomux_quic.errors",
    ]
