"""The ``velomux`` command. Each command group adds itself; this module only dispatches.

Every leaf parser sets ``handler`` (``Callable[[argparse.Namespace], int]``), so adding a
group is one ``add_*_commands(subparsers)`` call here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from velomux_quic.demo import add_demo_commands
from velomux_quic.probe import add_probe_commands
from velomux_quic.security.cli import add_certs_commands
from velomux_quic.service import add_node_commands

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="velomux",
        description="Stream records between cluster nodes over mutually authenticated QUIC.",
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
