"""The ``VELOMUX_`` environment variables, and a warning for one that none of them is.

A misspelt variable (``VELOMUX_TRANSPRT_LANES=4``) would otherwise be ignored without a
word, the node running on the default the operator meant to change. The configuration
loader refuses an unknown key under a section it knows (``VELOMUX_TRANSPORT_LANEZ``); a
name under no known section, or a switch misspelt, reaches no loader at all, so it is
warned about here, once per process, when a node starts or a ``velomux`` command runs,
naming the closest variable that exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import threading
import warnings
from collections.abc import Mapping

from ..config import DEPRECATED_VARIABLES, ENV_PREFIX, NodeConfig
from ..mux.config import DISABLE_ENV
from ..recordpath import PURE_PYTHON_ENV
from ..tracing import ENV_SWITCH as TRACING_ENV
from ..transport.batched_udp import GSO_ENVIRONMENT
from ..transport.engine_choice import ENGINE_ENVIRONMENT

__all__ = ["known_variables", "unknown_variables", "warn_unknown_variables"]

SWITCHES = frozenset(
    {
        DISABLE_ENV,
        PURE_PYTHON_ENV,
        TRACING_ENV,
        ENGINE_ENVIRONMENT,
        GSO_ENVIRONMENT,
        "VELOMUX_NO_UVLOOP",
        "VELOMUX_DEBUG_BUILD",  # read by the build (setup.py), harmless at run time
        *DEPRECATED_VARIABLES,
    }
)
"""Variables read where they act, not by the configuration loader."""

TOOLING = (
    "VELOMUX_TEST_",
    "VELOMUX_FUZZ_",
    "VELOMUX_TWIN_",
    "VELOMUX_PROFILE_",
    "VELOMUX_PERF_",
    "VELOMUX_ETCD",
)
"""Prefixes of variables the project's own tests and benchmarks read; never warned about."""

_warned = False
_warned_lock = threading.Lock()


def known_variables() -> frozenset[str]:
    """Every ``VELOMUX_`` variable a node or a command reads: each configuration key as
    ``VELOMUX_<SECTION>_<KEY>`` (the ``[node]`` keys as ``VELOMUX_NODE_<KEY>``) and the
    switches."""
    names = set(SWITCHES)
    for field in dataclasses.fields(NodeConfig):
        default = NodeConfig.__dataclass_fields__[field.name].default_factory
        if field.name == "peers":
            continue
        if default is not dataclasses.MISSING and dataclasses.is_dataclass(section := default()):
            names.update(
                f"{ENV_PREFIX}{field.name.upper()}_{key.name.upper()}"
                for key in dataclasses.fields(section)
            )
        else:
            names.add(f"{ENV_PREFIX}NODE_{field.name.upper()}")
    return frozenset(names)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``VELOMUX_`` variable set that velomux does not read, with the closest one it
    does (None when nothing is close)."""
    environ = os.environ if environ is None else environ
    known = known_variables()
    found = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(TOOLING):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        found.append((name, close[0] if close else None))
    return found


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> int:
    """Warn (a ``UserWarning``) about each unknown ``VELOMUX_`` variable, the first time
    it is called in a process (later calls say nothing); returns how many there were."""
    global _warned
    with _warned_lock:
        if _warned:
            return 0
        _warned = True
    unknown = unknown_variables(environ)
    for name, close in unknown:
        hint = f"did you mean {close}? " if close else ""
        # A warning, not a log record: Python shows it even to a program that configured
        # no logging, and `velomux node` routes warnings to its log lines.
        warnings.warn(
            f"environment variable {name} is not one velomux reads, so it is ignored: "
            f"{hint}the variables are VELOMUX_<SECTION>_<KEY> for each configuration key "
            "('velomux node --example-config' lists the keys) and the switches "
            + ", ".join(sorted(SWITCHES - set(DEPRECATED_VARIABLES))),
            UserWarning,
            stacklevel=3,
        )
    return len(unknown)
