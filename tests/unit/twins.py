"""Both twins of a twinned definition, for tests that run against each in one process.

A sans-IO unit test of a twinned class or function, or of one defined in a compiled module
(``BatchBuilder``, the walk under ``decode_batch_owned``, ``IngressSlot``, ``DirtySet``,
...), takes the fixture made by :func:`each_twin`: it swaps the test module's own names for
the pure-Python definitions in one run of every test and for the compiled ones in the
other, whatever ``VELOMUX_PURE_PYTHON`` selected for the library (a compiled module's other
implementation is loaded apart, by :func:`~velomux_quic.recordpath.load_module`). A
test that drives a whole table or batcher uses what the library selected (the pure pass of
``.ci/run`` runs it the other way).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from velomux_quic.recordpath import (
    COMPILED_MODULES,
    IMPLEMENTATION,
    TWINNED,
    RecordPath,
    load_module,
)

IMPLEMENTATIONS = ("pure-python", "compiled")


def twin(module: str, name: str, implementation: RecordPath) -> Any:
    """``module.name`` as the pure twin defines it, or its compiled twin; for a definition
    of a compiled module (written once), as that module runs on each path."""
    if module in COMPILED_MODULES:
        return getattr(load_module(module, implementation), name)
    if implementation == "compiled":
        return getattr(_extension(module.rsplit(".", 1)[0] + "._compiled"), name)
    (found,) = [t for t in TWINNED if t.name == f"{module}.{name}"]
    return found.pure


LEAF_MODULES = (
    "velomux_quic.mux.batch_codec",
    "velomux_quic.mux.credit",
    "velomux_quic.mux.slots",
    "velomux_quic.streaming.channels",
    "velomux_quic.streaming.frames",
    "velomux_quic.streaming.inbox",
)
"""The compiled modules a twin extension cimports (none of them cimports another)."""


def _extension(name: str) -> Any:
    """A layer's extension of hand-written twins. On the pure path its C declarations still
    need the compiled classes of the modules it cimports (``EgressSlot``,
    ``IngressSlot``), so those stand in ``sys.modules`` while it is first imported, and the
    pure ones again after."""
    if IMPLEMENTATION == "compiled" or name in sys.modules:
        return importlib.import_module(name)
    assert set(LEAF_MODULES) <= set(COMPILED_MODULES)
    selected = {leaf: sys.modules.get(leaf) for leaf in LEAF_MODULES}
    try:
        for leaf in LEAF_MODULES:
            sys.modules[leaf] = load_module(leaf, "compiled")
        return importlib.import_module(name)
    finally:
        for leaf, module in selected.items():
            if module is None:
                sys.modules.pop(leaf, None)
            else:
                sys.modules[leaf] = module


def each_twin(module: str, *names: str, into: str | None = None) -> Callable[..., Iterator[str]]:
    """A fixture, parametrized over both twins, that swaps ``names`` (imported from
    ``module`` by the test module, or by the library module ``into``, whose own functions
    then run on each twin) for the twin of each run."""

    @pytest.fixture(params=IMPLEMENTATIONS)
    def swap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
        target = sys.modules[into or request.module.__name__]
        for name in names:
            monkeypatch.setattr(target, name, twin(module, name, request.param))
        yield request.param

    return swap
