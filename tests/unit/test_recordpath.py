"""The record path's switch: which implementation runs, that it is the one asked for, that
a missing extension fails loudly, and that both show the same API.

The default run (``make test``) is compiled, so the first test there fails when the
extension did not build or was not loaded; ``.ci/run`` runs the unit and integration tests
again under ``VELOMUX_PURE_PYTHON=1``, where it checks the sources run instead."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import velomux_quic.node  # noqa: F401  (imports every compiled module)
from velomux_quic import runtime_info
from velomux_quic.programs.cli import version_text
from velomux_quic.recordpath import (
    COMPANION_MODULES,
    COMPILED_MODULES,
    IMPLEMENTATION,
    PURE_PYTHON_ENV,
    load_module,
)

from .twins import LEAF_MODULES

ROOT = Path(__file__).resolve().parents[2]

PURE_ASKED = os.environ.get(PURE_PYTHON_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def test_the_record_path_asked_for_is_the_one_loaded() -> None:
    assert ("pure-python" if PURE_ASKED else "compiled") == IMPLEMENTATION
    # The record path is written once: no hand-written twin of a module remains.
    assert not list(ROOT.joinpath("velomux_quic").rglob("_compiled.pyx"))


def test_each_compiled_module_is_loaded_from_the_file_the_switch_chose() -> None:
    for name in COMPILED_MODULES:
        module = sys.modules[name]
        assert module is load_module(name, IMPLEMENTATION)
        loaded = module.__file__ or ""
        if PURE_ASKED:
            assert loaded.endswith(".py"), loaded
        else:
            assert loaded.endswith((".so", ".pyd")), loaded


def test_the_other_implementation_of_a_compiled_module_loads_apart() -> None:
    """Tests that compare the two in one process get the other one without it replacing
    the module the library runs."""
    other = "compiled" if PURE_ASKED else "pure-python"
    for name in COMPILED_MODULES if other == "pure-python" else LEAF_MODULES:
        module = load_module(name, other)
        assert module is not sys.modules[name]
        assert module is load_module(name, other)
        loaded = module.__file__ or ""
        assert loaded.endswith((".so", ".pyd") if PURE_ASKED else ".py"), loaded


def test_a_module_outside_the_record_path_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of the compiled modules"):
        load_module("velomux_quic.node", "pure-python")


def _public_names(cls: type) -> set[str]:
    names = {name for name in dir(cls) if not name.startswith("_") or name == "__len__"}
    return names | {name for name in getattr(cls, "__slots__", ()) if not name.startswith("_")}


def test_the_compiled_classes_expose_the_pure_api() -> None:
    """A class of a compiled module has the same public attributes, properties and methods
    either way: a field its ``.pxd`` declared without ``public`` would be missing only where
    the module is compiled, and fail only where that name is used."""
    for name in COMPILED_MODULES if not PURE_ASKED else LEAF_MODULES:
        pure = load_module(name, "pure-python")
        compiled = load_module(name, "compiled")
        for attribute, cls in vars(pure).items():
            if inspect.isclass(cls) and cls.__module__ == name:
                other = getattr(compiled, attribute)
                missing = _public_names(cls) - set(dir(other))
                assert missing == set(), (name, attribute)


def test_version_names_the_record_path_and_the_engine() -> None:
    line = version_text()
    assert f"record path: {IMPLEMENTATION}" in line
    assert f"QUIC engine: {runtime_info().quic_engine} " in line
    shown = subprocess.run(
        [sys.executable, "-m", "velomux_quic.programs.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert shown.stdout.strip() == line


BLOCK_EXTENSION = (
    "import pathlib\n"
    "is_file = pathlib.Path.is_file\n"
    "pathlib.Path.is_file = lambda path: not (\n"
    "    path.name.startswith('egress.') and path.suffix == '.so') and is_file(path)\n"
    "import velomux_quic.node\n"
    "from velomux_quic.recordpath import IMPLEMENTATION; print(IMPLEMENTATION)\n"
)
"""A process whose egress extension is gone (as after a build that lost it)."""

NO_EXTENSIONS = (
    "import importlib.machinery; importlib.machinery.EXTENSION_SUFFIXES.clear()\n"
    "import velomux_quic\n"
    "from velomux_quic.recordpath import IMPLEMENTATION; print(IMPLEMENTATION)\n"
)
"""A process in which no compiled module has an extension built for this Python."""


def _run_without_extension(
    pure: str, script: str = BLOCK_EXTENSION
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, PURE_PYTHON_ENV: pure},
        cwd=ROOT,
    )


def test_a_missing_extension_fails_the_import_loudly() -> None:
    result = _run_without_extension("0")
    assert result.returncode != 0
    assert "CompiledRecordPathMissing" in result.stderr
    assert "(velomux_quic.mux.egress) cannot be imported" in result.stderr
    assert "pip install --force-reinstall --no-binary velomux_quic" in result.stderr
    assert "make install" not in result.stderr  # a pip user has no checkout
    assert f"{PURE_PYTHON_ENV}=1" in result.stderr


def _without_companion(companion: str) -> str:
    """A process whose ``companion`` (an awaitable's ``am_send`` slot) cannot be imported:
    the read or the send would still work, through ``__next__``, but slower, in silence."""
    return (
        f"import sys; sys.modules[{companion!r}] = None\n"
        "import velomux_quic.node\n"
        "from velomux_quic.recordpath import IMPLEMENTATION; print(IMPLEMENTATION)\n"
    )


@pytest.mark.parametrize("companion", COMPANION_MODULES)
def test_a_missing_companion_fails_the_import_loudly(companion: str) -> None:
    result = _run_without_extension("0", _without_companion(companion))
    assert result.returncode != 0
    assert "CompiledRecordPathMissing" in result.stderr
    assert companion in result.stderr
    assert _run_without_extension("1", _without_companion(companion)).stdout.strip() == (
        "pure-python"
    )


def test_the_companions_load_with_the_compiled_path_only() -> None:
    # The reader and the sender, imported with the node above, import their companions.
    for companion in COMPANION_MODULES:
        assert (companion in sys.modules) is not PURE_ASKED, companion


def test_a_compiled_module_without_its_extension_fails_the_import_loudly() -> None:
    """Python would load the module's source instead, silently: the finder refuses."""
    result = _run_without_extension("0", NO_EXTENSIONS)
    assert result.returncode != 0
    assert "CompiledRecordPathMissing" in result.stderr
    assert any(name in result.stderr for name in COMPILED_MODULES)
    assert "pip install --force-reinstall --no-binary velomux_quic" in result.stderr
    assert "make install" not in result.stderr  # a pip user has no checkout
    assert f"{PURE_PYTHON_ENV}=1" in result.stderr


NO_CREDIT_EXTENSION = (
    "import pathlib\n"
    "is_file = pathlib.Path.is_file\n"
    "pathlib.Path.is_file = lambda path: not path.name.startswith('credit.') and is_file(path)\n"
    "import velomux_quic\n"
)
"""A process in which only the mux's credit module has no extension (the arrival kernel
cimports it, so it may be missing while that extension is imported)."""


def test_a_module_another_extension_cimports_is_named_missing_once() -> None:
    result = _run_without_extension("0", NO_CREDIT_EXTENSION)
    assert result.returncode != 0
    assert "CompiledRecordPathMissing" in result.stderr
    assert "(velomux_quic.mux.credit) cannot be imported" in result.stderr
    assert result.stderr.count("cannot be imported") == 1, result.stderr


def test_the_switch_runs_pure_python_without_any_extension() -> None:
    result = _run_without_extension("1", NO_EXTENSIONS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pure-python"


def test_the_switch_runs_the_sources_without_an_extension() -> None:
    result = _run_without_extension("1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pure-python"


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_only_an_affirmative_switch_selects_the_sources(value: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-c", "from velomux_quic.recordpath import IMPLEMENTATION as I; print(I)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, PURE_PYTHON_ENV: value},
        check=True,
    )
    assert shown.stdout.strip() == "compiled"
