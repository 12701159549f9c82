"""Which implementation of the record path runs: the compiled one, or the pure Python.

The per-record loops of the mux and the streaming layer (staging a record into its slot,
packing ready slots into a batch, a whole pass in :func:`send_pass`, walking a received
batch, delivering bodies into slots with their credit bookkeeping, the consumer's take)
run either as plain Python or compiled to C by Cython. Both give the same bytes on the
wire, the same errors, the same bounds and the same metrics; the test suite runs against
both, and differential property tests compare them on the same inputs.

Each record-path module (:data:`COMPILED_MODULES`) is written once, as a plain Python
module, with its C types declared beside it in an augmenting ``.pxd`` of the same name; the
build compiles that very file into an extension of the same name. The finder this module
installs decides which of the two files an import of it loads: the extension on the
compiled path, the ``.py`` source on the pure path. Where a representation that is fast in
C is slow interpreted, the module branches on ``cython.compiled`` (Cython decides it at
build time); where Cython is not installed, :mod:`.shadow` stands in. What pure-mode Cython
cannot declare (a type slot) is set by a small C-only *companion* that holds no logic,
which the compiled module imports with :func:`companion`.

One switch chooses, once, at import: ``VELOMUX_PURE_PYTHON=1`` selects pure Python;
anything else (or unset) selects the compiled path. There is no silent fallback: a build
that lost its extensions would otherwise run several times slower with nothing to say so,
so when a compiled module or its companion cannot be imported and the switch is not set,
importing velomux_quic fails with :class:`CompiledRecordPathMissing`, saying how to fix
it. The package imports this module first, so the finder is in place before any compiled
module is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final, Literal

__all__ = [
    "COMPANION_MODULES",
    "COMPILED_MODULES",
    "IMPLEMENTATION",
    "PURE_PYTHON_ENV",
    "CompiledRecordPathMissing",
    "RecordPath",
    "companion",
    "load_module",
]

RecordPath = Literal["compiled", "pure-python"]
"""The two implementations of the record path, as the snapshot and ``--version`` name them."""

PURE_PYTHON_ENV: Final = "VELOMUX_PURE_PYTHON"
"""Set to ``1`` (or ``true``, ``yes``) to run the record path as plain Python."""


def _pure_requested() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


IMPLEMENTATION: Final[RecordPath] = "pure-python" if _pure_requested() else "compiled"
"""The implementation this process runs, chosen once at import."""


class CompiledRecordPathMissing(ImportError):
    """The compiled record path is not built in this installation and the pure-Python path
    was not asked for.

    An ``ImportError`` (it is raised while importing velomux_quic, before the library's own
    exception tree is usable); its message says how to fix it."""


COMPILED_MODULES: Final = (
    "velomux_quic.mux.arrival",
    "velomux_quic.mux.batch_codec",
    "velomux_quic.mux.channel",
    "velomux_quic.mux.credit",
    "velomux_quic.mux.egress",
    "velomux_quic.mux.slots",
    "velomux_quic.streaming.channels",
    "velomux_quic.streaming.frames",
    "velomux_quic.streaming.inbox",
    "velomux_quic.streaming.reader",
    "velomux_quic.streaming.sender",
)
"""The modules written once and compiled as they are where built (each has a ``.pxd``
beside it, and an extension of the same name in setup.py)."""

COMPANION_MODULES: Final = (
    "velomux_quic.streaming._reader_send",
    "velomux_quic.streaming._sender_send",
)
"""The companions (see :func:`companion`): C-only extensions of a ``.pyx`` each, built
only for the compiled path (setup.py's extensions too)."""


def _missing(name: str, why: str) -> CompiledRecordPathMissing:
    return CompiledRecordPathMissing(
        f"the compiled record path ({name}) cannot be imported: {why}. This installation "
        "was built without its Cython extension, or the extension does not match this "
        "Python. Rebuild it (`pip install --force-reinstall --no-binary velomux_quic "
        "velomux_quic` with a C compiler), or run the record path as plain Python, "
        f"several times slower per record, with {PURE_PYTHON_ENV}=1."
    )


def _spec(name: str, implementation: RecordPath) -> importlib.machinery.ModuleSpec:
    """Where ``name`` (one of :data:`COMPILED_MODULES`) is, as ``implementation`` runs it:
    its ``.py`` source, or the extension built from it. The package above it is imported
    already (Python imports a module's packages first)."""
    package, _, leaf = name.rpartition(".")
    directories: Sequence[str] = sys.modules[package].__path__
    loader: importlib.abc.Loader
    if implementation == "pure-python":
        suffixes = importlib.machinery.SOURCE_SUFFIXES
    else:
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for directory in directories:
        for suffix in suffixes:
            found = Path(directory) / f"{leaf}{suffix}"
            if not found.is_file():
                continue
            if implementation == "pure-python":
                loader = importlib.machinery.SourceFileLoader(name, str(found))
            else:
                loader = importlib.machinery.ExtensionFileLoader(name, str(found))
            spec = importlib.util.spec_from_file_location(name, found, loader=loader)
            assert spec is not None  # a file location with a loader always gives a spec
            return spec
    if implementation == "pure-python":
        raise ModuleNotFoundError(f"{name}: no {leaf}.py in {list(directories)}", name=name)
    raise _missing(name, f"no extension built from {leaf}.py in {list(directories)}")


class _RecordPathFinder(importlib.abc.MetaPathFinder):
    """Imports each of :data:`COMPILED_MODULES` from the file the switch chose: without it,
    Python would load the extension whenever one is built beside the source (it prefers
    extensions), and the source, silently, when none is."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        return _spec(fullname, IMPLEMENTATION)


if not any(isinstance(finder, _RecordPathFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RecordPathFinder())

_OTHERS: Final[dict[str, ModuleType]] = {}


def load_module(name: str, implementation: RecordPath) -> ModuleType:
    """One of :data:`COMPILED_MODULES` as ``implementation`` runs it, whichever this
    process selected: the module itself for the selected one, and for the other a copy
    of its own, kept apart from ``sys.modules`` (for tests that run both in one process).

    The copy imports the other modules as this process runs them: a compiled module that
    cimports another (the sender cimports the channels and the frames) loads apart only
    where the compiled path runs, since its C declarations need the compiled classes.
    """
    if name not in COMPILED_MODULES:
        raise ValueError(f"{name} is not one of the compiled modules: {COMPILED_MODULES}")
    if implementation == IMPLEMENTATION:
        return importlib.import_module(name)
    module = _OTHERS.get(name)
    if module is None:
        importlib.import_module(name.rpartition(".")[0])
        spec = _spec(name, implementation)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
        _OTHERS[name] = module
    return module


def _load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except CompiledRecordPathMissing:
        # A compiled module the extension cimports is the one missing: its own message
        # names it and says how to fix it, which wrapping it again would only repeat.
        raise
    except ImportError as exc:
        raise _missing(name, str(exc)) from exc


def companion(name: str) -> ModuleType | None:
    """Import ``name`` where the compiled path runs, and nothing on the pure path: an
    extension that completes a compiled module in C with what pure-mode Cython cannot
    declare (a type slot), and holds no logic of its own. The compiled module imports its
    companion as it is defined, so the two load together; a missing companion raises
    :class:`CompiledRecordPathMissing`, as a missing compiled module does."""
    return None if IMPLEMENTATION == "pure-python" else _load(name)
