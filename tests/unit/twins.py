"""Both implementations of a compiled module's definitions, for tests that run against each
in one process.

A sans-IO unit test of a class or function of a compiled module (``BatchBuilder``, the
walk under ``decode_batch_owned``, ``IngressSlot``, ``DirtySet``, ...) takes the fixture
made by :func:`each_twin`: it swaps the test module's own names for the module's source,
run as Python, in one run of every test and for its compiled form in the other, whatever
``VELOMUX_PURE_PYTHON`` selected for the library (the other implementation is loaded apart,
by :func:`~velomux_quic.recordpath.load_module`). A test that drives a whole table or
batcher uses what the library selected (the pure pass of ``.ci/run`` runs it the other
way).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from velomux_quic.recordpath import RecordPath, load_module

IMPLEMENTATIONS = ("pure-python", "compiled")


def twin(module: str, name: str, implementation: RecordPath) -> Any:
    """``module.name`` (``module`` one of the compiled modules) as ``implementation`` runs it."""
    return getattr(load_module(module, implementation), name)


LEAF_MODULES = (
    "velomux_quic.mux.batch_codec",
    "velomux_quic.mux.credit",
    "velomux_quic.mux.slots",
    "velomux_quic.streaming.channels",
    "velomux_quic.streaming.frames",
    "velomux_quic.streaming.inbox",
)
"""The compiled modules that cimport no other: on the pure path, only these load apart in
their compiled form (one that cimports another needs that one's compiled classes as the
modules the library runs)."""


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
