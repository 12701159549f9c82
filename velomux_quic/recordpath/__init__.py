"""Which implementation of the record path runs: the compiled one, or its pure-Python twin.

The per-record loops of the mux and the streaming layer (staging a record into its slot,
packing ready slots into a batch, a whole pass in :func:`send_pass`, walking a received
batch, delivering bodies into slots with their credit bookkeeping, the consumer's take)
exist twice: as the plain Python of their modules, which is the reference, and as a Cython
extension beside each layer (``velomux_quic/mux/_compiled.pyx``,
``velomux_quic/streaming/_compiled.pyx``) that does the same work in C. Both give the same
bytes on the wire, the same errors, the same bounds and the same metrics; the test suite
runs against both, and differential property tests compare them on the same inputs.

One switch chooses, once, at import: ``VELOMUX_PURE_PYTHON=1`` selects the pure twin;
anything else (or unset) selects the compiled one. There is no silent fallback: a build
that lost its extension would otherwise run several times slower with nothing to say so,
so when the compiled module cannot be imported and the switch is not set, importing
velomux_quic fails with :class:`CompiledRecordPathMissing`, saying how to fix it.

Each twinned class or function is marked where the pure one is defined, with
:meth:`Twins.of`: the decorator returns the compiled twin of the same name when the
compiled path runs, and the pure definition (unchanged) otherwise.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final, Literal, TypeVar

__all__ = [
    "IMPLEMENTATION",
    "PURE_PYTHON_ENV",
    "TWINNED",
    "CompiledRecordPathMissing",
    "RecordPath",
    "Twin",
    "Twins",
]

RecordPath = Literal["compiled", "pure-python"]
"""The two implementations of the record path, as the snapshot and ``--version`` name them."""

PURE_PYTHON_ENV: Final = "VELOMUX_PURE_PYTHON"
"""Set to ``1`` (or ``true``, ``yes``) to run the pure-Python twin."""


def _pure_requested() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


IMPLEMENTATION: Final[RecordPath] = "pure-python" if _pure_requested() else "compiled"
"""The implementation this process runs, chosen once at import."""


class CompiledRecordPathMissing(ImportError):
    """The compiled record path is not built in this installation and the pure-Python twin
    was not asked for.

    An ``ImportError`` (it is raised while importing velomux_quic, before the library's own
    exception tree is usable); its message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Twin:
    """One twinned definition: where it lives, its pure-Python definition, and the one this
    process runs (the compiled twin, or the pure definition itself)."""

    name: str
    """``module.qualname`` of the pure definition."""
    pure: Any
    selected: Any


TWINNED: Final[list[Twin]] = []
"""Every twinned definition, as the modules were imported (for tests and introspection)."""

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise CompiledRecordPathMissing(
            f"the compiled record path ({name}) cannot be imported: {exc}. This installation "
            "was built without its Cython extension, or the extension does not match this "
            "Python. Rebuild it (`pip install --force-reinstall --no-binary velomux_quic "
            "velomux_quic` with a C compiler), or run the "
            f"pure-Python twin, several times slower per record, with {PURE_PYTHON_ENV}=1."
        ) from exc


class Twins:
    """The compiled twins of one layer's modules, or none when the pure twin runs.

    ``Twins("velomux_quic.mux._compiled")`` imports that extension when the compiled path
    is selected (failing loudly when it cannot) and nothing otherwise.
    """

    __slots__ = ("module", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.module: ModuleType | None = None if IMPLEMENTATION == "pure-python" else _load(name)

    def of(self, definition: T) -> T:
        """Decorate a pure-Python class or function that has a compiled twin of the same
        name: the twin when the compiled path runs, ``definition`` itself otherwise."""
        name: str = getattr(definition, "__name__")  # noqa: B009 (a class or a function)
        where = f"{getattr(definition, '__module__', '?')}.{name}"
        if self.module is None:
            TWINNED.append(Twin(where, definition, definition))
            return definition
        twin: Any = getattr(self.module, name, None)
        if twin is None:
            raise CompiledRecordPathMissing(
                f"{self.name} has no compiled twin of {name}: the extension is older than "
                f"the Python sources; rebuild it (`make install`) or set {PURE_PYTHON_ENV}=1"
            )
        TWINNED.append(Twin(where, definition, twin))
        return twin  # type: ignore[no-any-return]

    def method(self, definition: F) -> F:
        """As :meth:`of`, for a method: the compiled twin is a module-level function of the
        class's name and the method's (``EgressBatcher_offer``), taking the instance first,
        which binds as a method because Cython functions are descriptors."""
        where = f"{definition.__module__}.{definition.__qualname__}"
        if self.module is None:
            TWINNED.append(Twin(where, definition, definition))
            return definition
        owner = definition.__qualname__.split(".")[-2]
        name = f"{owner}_{definition.__name__}"
        twin: Any = getattr(self.module, name, None)
        if twin is None:
            raise CompiledRecordPathMissing(
                f"{self.name} has no compiled twin of {owner}.{definition.__name__}: the "
                f"extension is older than the Python sources; rebuild it (`make install`) "
                f"or set {PURE_PYTHON_ENV}=1"
            )
        TWINNED.append(Twin(where, definition, twin))
        return twin  # type: ignore[no-any-return]
