"""The ``velomux`` command. Each command group adds itself; this module only dispatches.

Every leaf parser sets ``handler`` (``Callable[[argparse.Namespace], int]``), so adding a
group is one ``add_*_commands(subparsers)`` call here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Sequence

from velomux_quic.demo import add_demo_commands
from velomux_quic.probe import add_probe_commands
from velomux_quic.recordpath import IMPLEMENTATION as RECORD_PATH
from velomux_quic.security.cli import add_certs_commands
from velomux_quic.service import add_node_commands

__all__ = ["build_parser", "main", "version_line"]

QUIC_ENGINE = "aioquic"
"""The QUIC engine every connection runs on (the only one today)."""


def version_line() -> str:
    """What ``velomux --version`` prints: the package version, the record path this process
    runs (``compiled``, or ``pure-python`` under VELOMUX_PURE_PYTHON=1) and the QUIC engine,
    so a bug report says which implementation produced it."""
    try:
        version = importlib.metadata.version("velomux_quic")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"velomux_quic {version} (record path: {RECORD_PATH}; QUIC engine: {QUIC_ENGINE})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="velomux",
        description="Stream records between cluster nodes over mutually authenticated QUIC.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print the version, the record path (compiled or pure-python) and the QUIC "
        "engine, and exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_certs_commands(commands)
    add_demo_commands(commands)
    add_node_commands(commands)
    add_probe_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (argparse exits 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
