"""Every ``VELOMUX_`` variable the package itself reads is one the unknown-variable check
knows, so setting a real switch never draws the "not one velomux reads" warning.

A switch added in one module and not in ``ops/environment.py`` would otherwise warn every
user who sets it that it is ignored, while it is read.
"""

from __future__ import annotations

import re
from pathlib import Path

import velomux_quic
from velomux_quic.ops.environment import known_variables, unknown_variables

PACKAGE = Path(velomux_quic.__file__).resolve().parent
"""The package this run imports: the checkout's, or the installed wheel's under
``make test-pythons`` (whose tree has no source beside the tests)."""
# A whole name in quotes: a variable the code reads, not a prefix it builds names from.
NAME_IN_CODE = re.compile(r"""["'](VELOMUX_[A-Z0-9_]*[A-Z0-9])["']""")


def names_in_the_package() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names.update(NAME_IN_CODE.findall(path.read_text(encoding="utf-8")))
    return names


def test_every_variable_the_package_reads_is_known() -> None:
    names = names_in_the_package()
    assert len(names) >= 5, names  # the switches are spelt somewhere
    assert not unknown_variables(dict.fromkeys(names, "1")), sorted(names - known_variables())


def test_a_misspelt_switch_is_unknown_and_names_the_real_one() -> None:
    assert unknown_variables({"VELOMUX_UDP_GS0": "0"}) == [("VELOMUX_UDP_GS0", "VELOMUX_UDP_GSO")]
    assert unknown_variables({"VELOMUX_PERF_CALLGRIND_DIR": "/x"}) == []  # the benchmarks' own
